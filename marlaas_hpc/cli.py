"""`marlaas` command line: run a job locally (or under MPI/Slurm), scale a live one, and the per-component tools."""
from __future__ import annotations

import argparse
import os
import shutil
import sys

from marlaas_hpc.config_loader import SpecError
from marlaas_hpc.scheduler import MODES


def _under_mpi() -> bool:
    """Started by mpirun/srun as one of several ranks: run the rank directly."""
    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS"):
        if int(os.environ.get(name, "1") or 1) > 1:
            return True
    return int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_STEP_ID" in os.environ


def _gpus_visible(job) -> bool:
    """Whether the ranks will find a GPU, without importing torch to ask CUDA (~1 s before any rank starts): the
    driver's GPUs as CUDA_VISIBLE_DEVICES / Slurm's variables narrow them (launch/devices.py)."""
    from marlaas_hpc.launch.devices import DeviceError, count_driver_gpus, visible_gpus

    if job.layout.accelerator == "cpu":
        return False
    try:
        return bool(visible_gpus(os.environ, count_driver_gpus())[0])
    except DeviceError:
        return False  # every rank refuses it at start, naming the variable


def mpirun_command(job, config: str | None, run_dir: str, mode: str, resume: bool = False, mpi=None) -> list[str]:
    """Local mode: one MPI world of the layout's size on this machine, run under `marlaas run` as its supervisor
    (launch/supervise.py), which passes SIGUSR2 on to the launcher and the launcher to every rank: `kill -USR2
    <pid of marlaas run>` checkpoints the job (resume with --resume RUN_DIR). `mpi` (launch/mpi.py LocalMpi,
    default: the one `fault.local_mpi` names) is the fault-tolerant Open MPI when installed, else mpirun."""
    from marlaas_hpc.launch.mpi import find_local_mpi

    mpi = mpi or find_local_mpi(job.fault.local_mpi)
    return [*mpi.launch_args(job.layout.world_size),
            sys.executable, "-m", "marlaas_hpc.runtime.main", *([config] if config else []),
            *(["--resume", run_dir] if resume else ["--run-dir", run_dir]), "--mode", mode]


def cmd_run(args) -> int:
    from marlaas_hpc.plan.command import check_fits
    from marlaas_hpc.runtime import main as runtime_main
    from marlaas_hpc.runtime.process import check_run_dir, load_job

    if _under_mpi():
        argv = ([args.config] if args.config else []) + (["--run-dir", args.run_dir] if args.run_dir else []) + \
               (["--mode", args.mode] if args.mode else []) + (["--resume", args.resume] if args.resume else [])
        return runtime_main.main(argv)
    resume = bool(args.resume)
    try:  # refuse a bad config (or run dir) before any process starts
        job = load_job(args.config, args.resume or args.run_dir, args.mode, resume=resume)
        check_run_dir(job, resume)
    except SpecError as exc:
        print(f"marlaas: invalid {'resume' if resume else 'config'} {args.config or args.resume}: {exc}",
              file=sys.stderr)
        return 2
    try:  # build the tiny model (or a random checkpoint) once here, not in every rank; then check it
        gpus = _gpus_visible(job)
        job.check_models(vllm_on_cpu=not gpus)
        check_fits(job, gpus_visible=gpus)  # every GPU rank's memory estimate against its GPU (marlaas plan)
    except SpecError as exc:
        print(f"marlaas: invalid config {args.config or args.resume}: {exc}", file=sys.stderr)
        return 2
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # keep the per-task progress lines readable
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    from marlaas_hpc.launch.mpi import find_local_mpi

    try:
        mpi = find_local_mpi(job.fault.local_mpi)
    except SpecError as exc:
        print(f"marlaas: cannot start {args.config or args.resume}: {exc}", file=sys.stderr)
        return 2
    command = mpirun_command(job, args.config, job.run_dir, job.mode, resume=resume, mpi=mpi)
    print(f"[marlaas] local mode: {job.layout.world_size} ranks ({job.layout.env_ranks} env, "
          f"{job.layout.rollout_ranks} rollout, {job.layout.trainer_ranks} trainer), {len(job.tasks)} tasks, "
          f"mode {job.mode}, run dir {job.run_dir}, {_describe_mpi(mpi, job)}", flush=True)
    from marlaas_hpc.launch.supervise import supervise

    return supervise(command, mpi.environ(env), job.run_dir)  # one message naming the rank if one dies or fails


def _describe_mpi(mpi, job) -> str:
    """What the start line says about the MPI: whether a rank's loss stops the job."""
    if not mpi.fault_tolerant:
        return f"MPI {mpi.mpiexec} (no fault tolerance: a lost rank stops the job)"
    if job.fault.on_rank_loss == "stop":
        return "Open MPI with ULFM (fault.on_rank_loss: stop)"
    return "Open MPI with ULFM (a lost worker rank stops no task)"


def job_command(config: str, run_dir: str) -> str:
    """What every rank of a Slurm job runs (srun --het-group=0-3 starts one per task)."""
    import shlex
    from pathlib import Path

    return shlex.join([sys.executable, "-m", "marlaas_hpc.runtime.main", str(Path(config).resolve()),
                       "--run-dir", str(Path(run_dir).resolve()), "--auto-resume"])


def cmd_sbatch(args) -> int:
    """Writes the heterogeneous-job batch script for users who prefer plain `sbatch`."""
    from pathlib import Path

    from marlaas_hpc.launch.sbatch import render_sbatch
    from marlaas_hpc.runtime.process import load_job

    try:
        job = load_job(args.config, args.run_dir, None)
    except SpecError as exc:
        print(f"marlaas: invalid config {args.config}: {exc}", file=sys.stderr)
        return 2
    folder = Path(job.run_dir).resolve() / "slurm"
    from marlaas_hpc.runtime.checkpoint import requeue_marker

    marker = requeue_marker(Path(job.run_dir).resolve())
    print(render_sbatch(job.layout, job_command(args.config, job.run_dir), args.job_name, folder, marker), end="")
    print(f"# the log folder must exist before submission: mkdir -p {folder}", file=sys.stderr)
    return 0


def cmd_submit(args) -> int:
    """Submits the job as one Slurm heterogeneous job (control, env, rollout, trainer components)."""
    from marlaas_hpc.launch.layout import LayoutError
    from marlaas_hpc.plan.command import check_fits
    from marlaas_hpc.runtime.process import load_job
    from marlaas_hpc.submit import submit

    try:
        job = load_job(args.config, args.run_dir, args.mode)
        check_fits(job)  # the components that ask Slurm for GPUs: each rank's memory against its GPU
        handle = submit(job, args.config, job_name=args.job_name, max_requeues=args.max_requeues)
    except (SpecError, LayoutError) as exc:
        print(f"marlaas: not submitted: {exc}", file=sys.stderr)
        return 2
    print(f"[marlaas] submitted het job {handle.job_id}: {job.layout.world_size} ranks "
          f"(control 1, env {job.layout.env_ranks}, rollout {job.layout.rollout_ranks}, trainer "
          f"{job.layout.trainer_ranks}); run dir {job.run_dir}; logs {job.run_dir}/slurm", flush=True)
    print(handle.job_id)
    return 0


def cmd_cancel(args) -> int:
    """Cancels a submitted job (every het component). Use `scancel --signal=USR2 JOB` to checkpoint instead."""
    import subprocess

    from marlaas_hpc.submit import run_dir_of

    proc = subprocess.run(["scancel", args.job], capture_output=True, text=True)
    if proc.returncode:
        print(f"marlaas: scancel {args.job} failed: {proc.stderr.strip()}", file=sys.stderr)
        return proc.returncode
    run_dir = run_dir_of(args.job)
    print(f"cancelled job {args.job}" + (f" (run dir {run_dir}: adapters and checkpoints stay)" if run_dir else ""))
    return 0


def cmd_status(args) -> int:
    """Per-task progress of a run dir (live while the job runs: rank 0 rewrites status.json about once a
    second), or of a submitted Slurm job by id (with its Slurm state)."""
    import json
    from pathlib import Path

    from marlaas_hpc.submit import run_dir_of, slurm_state

    run_dir = Path(args.run_dir)
    if not run_dir.exists() and args.run_dir.replace("_", "").isdigit():
        job_id, run_dir = args.run_dir, run_dir_of(args.run_dir)
        print(f"Slurm job {job_id}: {slurm_state(job_id) or 'unknown to sacct'}")
        if run_dir is None:
            print(f"marlaas: job {job_id} was not submitted by `marlaas submit` here (no run dir on record)",
                  file=sys.stderr)
            return 2
    elif (run_dir / "slurm" / "job_id").is_file():
        job_id = json.loads((run_dir / "slurm" / "job_id").read_text())["job_id"]
        print(f"Slurm job {job_id}: {slurm_state(job_id) or 'unknown to sacct'}")
    path = run_dir / "summary.json" if (run_dir / "summary.json").is_file() else run_dir / "status.json"
    if not path.is_file():
        print(f"marlaas: {run_dir} has no status.json or summary.json (not a run dir, or not started)",
              file=sys.stderr)
        return 2
    state = json.loads(path.read_text())
    finished = path.name == "summary.json" and not state.get("preempted")
    elapsed = state.get("wall_time_s", state.get("elapsed_s", 0.0))
    phase = "finished" if finished else "preempted (checkpointed)" if state.get("preempted") else "running"
    crash = run_dir / "crash.json"
    if phase == "running" and crash.is_file() and crash.stat().st_mtime >= path.stat().st_mtime:
        phase = "stopped by a crash (marlaas run --resume continues it)"
    print(f"{run_dir}: mode {state['mode']}, {phase}, {elapsed:.0f} s")
    if phase.startswith("stopped"):
        print(json.loads(crash.read_text()).get("message", ""))
    ranks = state.get("ranks")
    if ranks:  # a rank was lost, joined or left the live job
        print(f"ranks: rollout {ranks['rollout']} (joined {ranks['joined']}), env {ranks['env']}, lost {ranks['lost']}")
    serving = state.get("rollout_models")
    if serving:  # a job of several base models, live: the model rank 0 assigned each rollout rank
        print("rollout ranks serve: " + ", ".join(f"{rank} {model}" for rank, model in serving.items()))
    print(f"{'task':<16} {'tenant':<10} {'model':<12} {'state':<10} {'step':>9} {'k':>2} {'reward':>7} {'TTFS_s':>7} "
          f"{'TPTS_s':>7}")
    for task_id, t in state["tasks"].items():
        reward = "-" if t["reward_last"] is None else f"{t['reward_last']:.3f}"
        ttfs = "-" if t["ttfs_s"] is None else f"{t['ttfs_s']:.1f}"
        tpts = "-" if t["tpts_s"] is None else f"{t['tpts_s']:.2f}"
        model = _short_model(t.get("base_model"))  # a run dir from before models were named has none
        print(f"{task_id:<16} {t['tenant']:<10} {model:<12} {t['status']:<10} "
              f"{t['steps_done']:>4}/{t['total_steps']:<4} "
              f"{t['staleness_bound']:>2} {reward:>7} {ttfs:>7} {tpts:>7}" + (f"  {t['error']}" if t["error"] else ""))
    return 0


def _short_model(model: str | None) -> str:
    """A task's base model as `marlaas status` shows it: its name, or a path's last part ('-' if unknown)."""
    if not model:
        return "-"
    return model.rstrip("/").rsplit("/", 1)[-1]


def cmd_scale(args) -> int:
    """Sets the number of rollout ranks of a live job (runtime/scaling.py): rank 0 starts ranks that join, or
    drains the newest ones, and says so in its log (under Slurm with layout.mpi: ulfm, within the allocation)."""
    from pathlib import Path

    from marlaas_hpc.runtime.scaling import not_live, request_scale

    run_dir = Path(args.run_dir)
    if not (run_dir / "job.json").is_file():
        print(f"marlaas: {run_dir} is not the run dir of a job (no job.json)", file=sys.stderr)
        return 2
    why = not_live(run_dir)
    if why is not None:
        print(f"marlaas: not scaled: the job of {run_dir} {why}", file=sys.stderr)
        return 2
    if args.rollout < 1:
        print("marlaas: --rollout must be at least 1 (a job needs a rollout rank)", file=sys.stderr)
        return 2
    path = request_scale(run_dir, args.rollout)
    print(f"asked the job of {run_dir} for {args.rollout} rollout ranks ({path}); its log says what rank 0 does")
    return 0


def cmd_report(args) -> int:
    """Figures and a Markdown summary of one or several run dirs (several: compared side by side)."""
    from marlaas_hpc.report import write_report

    try:
        report = write_report(args.run_dirs, args.out)
    except FileNotFoundError as exc:
        print(f"marlaas: {exc}", file=sys.stderr)
        return 2
    print(f"report: {report}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="marlaas", description="Multi-task asynchronous RL fine-tuning (MARLaaS).")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a job: local mode (launches mpirun) or as a rank under MPI/Slurm")
    run.add_argument("config", nargs="?", help="job config YAML (see configs/); optional with --resume")
    run.add_argument("--run-dir", help="output directory (default: the config's run_dir)")
    run.add_argument("--mode", choices=MODES, help="override the config's mode")
    run.add_argument("--resume", metavar="RUN_DIR",
                     help="continue a preempted or crashed job from RUN_DIR's checkpoints")
    run.set_defaults(func=cmd_run)
    sbatch = sub.add_parser("sbatch", help="print the Slurm heterogeneous-job script of a config (marlaas sbatch C > job.sbatch)")
    sbatch.add_argument("config")
    sbatch.add_argument("--run-dir", help="output directory (default: the config's run_dir)")
    sbatch.add_argument("--job-name", default="marlaas")
    sbatch.set_defaults(func=cmd_sbatch)
    submit = sub.add_parser("submit", help="submit the job to Slurm as one heterogeneous job (submitit)")
    submit.add_argument("config")
    submit.add_argument("--run-dir", help="output directory on the shared filesystem (default: the config's)")
    submit.add_argument("--mode", choices=MODES, help="override the config's mode")
    submit.add_argument("--job-name", default="marlaas")
    submit.add_argument("--max-requeues", type=int, default=10,
                        help="preemptions (USR2) after which the job stops requeueing itself")
    submit.set_defaults(func=cmd_submit)
    cancel = sub.add_parser("cancel", help="cancel a submitted job (all components)")
    cancel.add_argument("job")
    cancel.set_defaults(func=cmd_cancel)
    status = sub.add_parser("status", help="per-task step / state / reward of a run dir or a submitted job id")
    status.add_argument("run_dir", metavar="RUN_DIR|JOB")
    status.set_defaults(func=cmd_status)
    from marlaas_hpc.service.commands import add_tasks_parser

    add_tasks_parser(sub)
    scale = sub.add_parser("scale", help="set the number of rollout ranks of a live job (ranks join or drain; under Slurm within the allocation)")
    scale.add_argument("run_dir", metavar="RUN_DIR")
    scale.add_argument("--rollout", type=int, required=True, help="rollout ranks wanted")
    scale.set_defaults(func=cmd_scale)
    report = sub.add_parser("report", help="PNG figures + Markdown summary of run dirs (several: compared)")
    report.add_argument("run_dirs", nargs="+")
    report.add_argument("-o", "--out", default="report", help="output folder (default: ./report)")
    report.set_defaults(func=cmd_report)
    from marlaas_hpc.sim.command import add_parser as add_simulate_parser

    add_simulate_parser(sub)
    from marlaas_hpc.plan.command import add_parser as add_plan_parser

    add_plan_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
