"""Entry point of every rank of a job (under mpirun in local mode, or srun --het-group under Slurm).

    python -m marlaas_hpc.runtime.main CONFIG --run-dir DIR [--mode MODE]
    python -m marlaas_hpc.runtime.main --resume DIR          (continue a preempted or crashed job)

The rank's life, in order: its job and device (runtime/process.py, before MPI_Init), the start checks every rank
makes together, its role's loop (runtime/roles.py: roles come from assign_role(rank, layout); the world size must
equal the layout's), then its end. SIGUSR2 checkpoints every task at a step boundary and ends the job with exit
status 75 (runtime/checkpoint.py); tasks are also checkpointed periodically, so `--resume` continues a crashed job
too. A rank that dies of an exception reports it and aborts the job (every other rank is blocked in MPI or a
collective with it), unless the job tolerates the loss of a worker (runtime/membership.py).
A rank started into the live job (`--join`) runs runtime/join.py instead.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from marlaas_hpc.launch.layout import assign_role
from marlaas_hpc.runtime.process import (PREEMPTED_EXIT, bind_rank_device, describe_role, end_barrier, end_lost_rank,
                                         end_rank, live_comm, load_job, log_devices, node_gpus, record_rank,
                                         refuse_start, report_crash, start_checks)
from marlaas_hpc.runtime.quiet import silence_library_notices
from marlaas_hpc.scheduler import MODES


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("config", nargs="?")
    parser.add_argument("--run-dir")
    parser.add_argument("--mode", choices=MODES)
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue the preempted job of RUN_DIR")
    parser.add_argument("--auto-resume", action="store_true",
                        help="resume if the run dir holds a checkpoint, else start fresh (Slurm requeue)")
    parser.add_argument("--join", metavar="RUN_DIR", help=argparse.SUPPRESS)  # a rank rank 0 started
    parser.add_argument("--as-rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--gpus", help=argparse.SUPPRESS)  # a joiner's GPUs in local mode (runtime/scaling.py)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    silence_library_notices()
    if args.join:
        from marlaas_hpc.runtime.join import join_main

        join_main(args.join, args.as_rank, args.gpus)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from marlaas_hpc.runtime.checkpoint import PreemptFlag, load_job_checkpoint

    preempt = PreemptFlag.install()  # before anything slow: USR2 must never kill a rank
    run_dir = args.resume or args.run_dir
    resume = bool(args.resume)
    if args.auto_resume and run_dir:
        try:
            resume = load_job_checkpoint(Path(run_dir)) is not None
        except ValueError:
            resume = True  # check_run_dir says what is wrong with it
    job = load_job(args.config, run_dir, args.mode, resume=resume)
    early = bind_rank_device(job)
    from mpi4py import MPI  # MPI_Init: only now, with CUDA_VISIBLE_DEVICES narrowed

    comm = MPI.COMM_WORLD
    refusals, state = start_checks(comm, job, args.config, resume, early)
    if refusals:
        return refuse_start(comm, refusals)
    return run_job(comm, job, early, preempt, state)


def run_job(comm, job, early, preempt, state: dict | None) -> int:
    """This rank's role, from the ready barrier to its exit status (PREEMPTED_EXIT on rank 0 of a preempted job)."""
    from marlaas_hpc.launch.monitor import RankReporter
    from marlaas_hpc.runtime.roles import run_rank

    log = (lambda message: print(message, flush=True)) if comm.Get_rank() == 0 else (lambda message: None)
    binding = early.binding
    bindings = comm.gather(binding, root=0)
    log_devices(bindings, log)
    rank, run_path = comm.Get_rank(), Path(job.run_dir).resolve()
    role = describe_role(assign_role(rank, job.layout), job.layout.trainer_groups)
    record_rank(run_path, rank, role)
    live = live_comm(comm, job)
    reporter = live.reporter = RankReporter.connect({
        "rank": rank, "role": role, "run_dir": str(run_path), "max_crash_requeues": job.checkpoint.max_crash_requeues,
        "tolerant": live.members.tolerant, "why_not": live.members.why_not, "on_rank_loss": job.fault.on_rank_loss,
        "hang_timeout_s": job.fault.hang_timeout_s})
    try:
        summary = run_rank(live, job, binding, log=log, preempt=preempt, resume=state,
                           devices=(bindings, node_gpus(early)) if rank == 0 else None)
        reporter.stop_heartbeat()
        if live.members.drained:  # this rank alone left the live job (runtime/scaling.py)
            reporter.bye()
            end_lost_rank()
    except BaseException as exc:
        report_crash(exc, run_path, rank, reporter)
        if live.members.tolerant and rank != 0:
            end_lost_rank()  # the others go on without this rank (runtime/membership.py)
        # one dead rank would leave the others blocked in MPI or a collective: take the whole job down
        comm.Abort(1)
    if summary is not None and not summary["preempted"]:
        log(f"[job] {job.mode} finished in {summary['wall_time_s']:.1f} s; summary: {Path(job.run_dir) / 'summary.json'}")
    live.disconnect_all()  # the links to ranks that joined the live job (runtime/scaling.py)
    end_barrier(live)
    # only rank 0 reports the preemption: under srun --kill-on-bad-exit an early non-zero exit of another
    # rank would kill rank 0 while it finalizes
    status = PREEMPTED_EXIT if summary is not None and summary["preempted"] else 0
    reporter.bye(status)
    return status


if __name__ == "__mp_main__":  # a process vLLM spawned from a rank (an engine core of its own): as quiet as the
    silence_library_notices()  # rank, from before it imports vLLM (multiprocessing imports this module first)

if __name__ == "__main__":
    end_rank(main())
