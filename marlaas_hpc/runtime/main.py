"""Entry point of every rank of a job (under mpirun in local mode, or srun --het-group under Slurm).

    python -m marlaas_hpc.runtime.main CONFIG --run-dir DIR [--mode MODE]

Roles come from assign_role(rank, layout); the world size must equal the layout's.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

from marlaas_hpc.config import JobConfig
from marlaas_hpc.launch.layout import assign_role, ranks_of, world_size_matches


def roles_of(layout) -> dict[str, list[int]]:
    return {kind: list(ranks_of(kind, layout)) for kind in ("env", "rollout", "trainer")}


def load_job(config_path: str, run_dir: str | None, mode: str | None) -> JobConfig:
    job = JobConfig.load(config_path)
    if run_dir:
        job.run_dir = run_dir
    if mode:
        job.mode = mode
    return job.validate()


def _trainer(comm, job, roles, model_path: Path):
    """Sets up the trainer ranks' own torch.distributed world (their TP group) from MPI, then the trainer."""
    from marlaas_hpc.trainer.trainer import MultiLoraTrainer, TrainerConfig

    trainers = roles["trainer"]
    leader = trainers[0]
    me = comm.Get_rank()
    if me == leader:
        with socket.socket() as sock:
            sock.bind(("", 0))
            address = (socket.gethostname(), sock.getsockname()[1])
        for rank in trainers[1:]:
            comm.send(address, dest=rank, tag=21)
    else:
        address = comm.recv(source=leader, tag=21)
    os.environ.update(MASTER_ADDR=address[0], MASTER_PORT=str(address[1]), RANK=str(trainers.index(me)),
                      WORLD_SIZE=str(len(trainers)), LOCAL_RANK=str(trainers.index(me)))
    return MultiLoraTrainer(TrainerConfig(model_path=str(model_path), tensor_parallel=job.layout.trainer_tp,
                                          seed=job.seed))


def run_rank(comm, job: JobConfig, log=print) -> dict | None:
    """Sets up this rank's role, waits until every rank is ready (so TTFS and busy fractions measure the
    job, not engine start-up), then runs the role's loop. Rank 0 returns the summary."""
    import time

    from marlaas_hpc.model import TextCodec
    from marlaas_hpc.runtime.delta import DeltaGroup

    start = time.time()
    rank = comm.Get_rank()
    role = assign_role(rank, job.layout)
    roles = roles_of(job.layout)
    run_dir = Path(job.run_dir).resolve()
    model_path = Path(comm.bcast(str(job.model_path()) if rank == 0 else None, root=0))
    codec = TextCodec.from_pretrained(model_path)
    leader = roles["trainer"][0]
    if role.kind == "scheduler":
        from marlaas_hpc.runtime.scheduler_rank import SchedulerRank

        run_dir.mkdir(parents=True, exist_ok=True)
        comm.Barrier()
        log(f"[job] all {comm.Get_size()} ranks ready after {time.time() - start:.1f} s")
        return SchedulerRank(comm, job, roles, codec, run_dir, log=log, startup_s=time.time() - start).run()
    if role.kind == "env":
        from marlaas_hpc.runtime.env_rank import EnvRank

        worker = EnvRank(comm, codec, leader, run_dir=run_dir, pool_config=job.env_pool)
        comm.Barrier()
        worker.run()
    elif role.kind == "rollout":
        from marlaas_hpc.model.tiny import default_cache_dir
        from marlaas_hpc.rollout import make_engine
        from marlaas_hpc.runtime.rollout_rank import RolloutRank

        work = run_dir / "rollout" / f"rank{rank}"
        # compiled-kernel caches persist across runs (a cold inductor cache costs tens of seconds at start)
        kwargs = {"work_dir": work, "cache_dir": default_cache_dir() / "vllm", "max_loras": job.max_adapters,
                  "max_lora_rank": job.max_lora_rank} if job.engine == "vllm" else {}
        engine = make_engine(job.engine, model_path, seed=job.seed + rank, **kwargs)
        delta = DeltaGroup(comm, leader, roles["rollout"])
        worker = RolloutRank(comm, engine, delta, work / "adapters", seed=job.seed, run_dir=run_dir)
        comm.Barrier()
        worker.run()
    else:
        from marlaas_hpc.runtime.trainer_rank import TrainerRank

        trainer = _trainer(comm, job, roles, model_path)
        if rank == leader:
            delta = DeltaGroup(comm, leader, roles["rollout"])
            worker = TrainerRank(comm, trainer, run_dir, leader, roles["trainer"][1:], delta)
            comm.Barrier()
            worker.run_leader()
        else:
            worker = TrainerRank(comm, trainer, run_dir, leader, [])
            comm.Barrier()
            worker.run_follower()
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("config")
    parser.add_argument("--run-dir")
    parser.add_argument("--mode", choices=["async", "sync", "sequential"])
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    job = load_job(args.config, args.run_dir, args.mode)
    check = world_size_matches(job.layout, comm.Get_size())
    if not check:
        if comm.Get_rank() == 0:
            print(f"marlaas: {check.message}", file=sys.stderr, flush=True)
        return 2
    log = (lambda message: print(message, flush=True)) if comm.Get_rank() == 0 else (lambda message: None)
    try:
        summary = run_rank(comm, job, log=log)
    except BaseException:
        # one dead rank would leave the others blocked in MPI or a collective: take the whole job down
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        comm.Abort(1)
    if summary is not None:
        log(f"[job] {job.mode} finished in {summary['wall_time_s']:.1f} s; summary: {Path(job.run_dir) / 'summary.json'}")
    comm.Barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
