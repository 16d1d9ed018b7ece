"""`marlaas` command line: run a job locally (or under MPI/Slurm), and the per-component tools."""
from __future__ import annotations

import argparse
import os
import shutil
import sys

from marlaas_hpc.tasks.spec import SpecError


def _under_mpi() -> bool:
    """Started by mpirun/srun as one of several ranks: run the rank directly."""
    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS"):
        if int(os.environ.get(name, "1") or 1) > 1:
            return True
    return int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_STEP_ID" in os.environ


def mpirun_command(job, config: str, run_dir: str, mode: str) -> list[str]:
    """Local mode: one MPI world of the layout's size on this machine."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise SystemExit("marlaas: mpirun not found (Debian: apt-get install openmpi-bin libopenmpi-dev)")
    return [mpirun, "-np", str(job.layout.world_size), "--oversubscribe", "--bind-to", "none",
            "--mca", "mpi_yield_when_idle", "1",
            sys.executable, "-m", "marlaas_hpc.runtime.main", config, "--run-dir", run_dir, "--mode", mode]


def cmd_run(args) -> int:
    from marlaas_hpc.runtime.main import load_job
    from marlaas_hpc.runtime import main as runtime_main

    if _under_mpi():
        argv = [args.config] + (["--run-dir", args.run_dir] if args.run_dir else []) + \
               (["--mode", args.mode] if args.mode else [])
        return runtime_main.main(argv)
    try:
        job = load_job(args.config, args.run_dir, args.mode)  # refuse a bad config before any process starts
    except SpecError as exc:
        print(f"marlaas: invalid config {args.config}: {exc}", file=sys.stderr)
        return 2
    job.model_path()  # build the tiny model once here, not in every rank
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # keep the per-task progress lines readable
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    command = mpirun_command(job, args.config, job.run_dir, job.mode)
    print(f"[marlaas] local mode: {job.layout.world_size} ranks ({job.layout.env_ranks} env, "
          f"{job.layout.rollout_ranks} rollout, {job.layout.trainer_ranks} trainer), {len(job.tasks)} tasks, "
          f"mode {job.mode}, run dir {job.run_dir}", flush=True)
    os.execvpe(command[0], command, env)


def job_command(config: str, run_dir: str) -> str:
    """What every rank of a Slurm job runs (srun --het-group=0-3 starts one per task)."""
    import shlex
    from pathlib import Path

    return shlex.join([sys.executable, "-m", "marlaas_hpc.runtime.main", str(Path(config).resolve()),
                       "--run-dir", str(Path(run_dir).resolve())])


def cmd_sbatch(args) -> int:
    """Writes the heterogeneous-job batch script for users who prefer plain `sbatch`."""
    from pathlib import Path

    from marlaas_hpc.launch.sbatch import render_sbatch
    from marlaas_hpc.runtime.main import load_job

    try:
        job = load_job(args.config, args.run_dir, None)
    except SpecError as exc:
        print(f"marlaas: invalid config {args.config}: {exc}", file=sys.stderr)
        return 2
    folder = Path(job.run_dir).resolve() / "slurm"
    print(render_sbatch(job.layout, job_command(args.config, job.run_dir), args.job_name, folder), end="")
    print(f"# the log folder must exist before submission: mkdir -p {folder}", file=sys.stderr)
    return 0


def cmd_status(args) -> int:
    """Per-task progress of a run dir (live while the job runs: rank 0 rewrites status.json each step)."""
    import json
    from pathlib import Path

    run_dir = Path(args.run_dir)
    path = run_dir / "summary.json" if (run_dir / "summary.json").is_file() else run_dir / "status.json"
    if not path.is_file():
        print(f"marlaas: {run_dir} has no status.json or summary.json (not a run dir, or not started)",
              file=sys.stderr)
        return 2
    state = json.loads(path.read_text())
    finished = path.name == "summary.json"
    elapsed = state.get("wall_time_s", state.get("elapsed_s", 0.0))
    print(f"{run_dir}: mode {state['mode']}, {'finished' if finished else 'running'}, {elapsed:.0f} s")
    print(f"{'task':<16} {'tenant':<10} {'state':<10} {'step':>9} {'k':>2} {'reward':>7} {'TTFS_s':>7} {'TPTS_s':>7}")
    for task_id, t in state["tasks"].items():
        reward = "-" if t["reward_last"] is None else f"{t['reward_last']:.3f}"
        ttfs = "-" if t["ttfs_s"] is None else f"{t['ttfs_s']:.1f}"
        tpts = "-" if t["tpts_s"] is None else f"{t['tpts_s']:.2f}"
        print(f"{task_id:<16} {t['tenant']:<10} {t['status']:<10} {t['steps_done']:>4}/{t['total_steps']:<4} "
              f"{t['staleness_bound']:>2} {reward:>7} {ttfs:>7} {tpts:>7}" + (f"  {t['error']}" if t["error"] else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="marlaas", description="Multi-task asynchronous RL fine-tuning (MARLaaS).")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a job: local mode (launches mpirun) or as a rank under MPI/Slurm")
    run.add_argument("config", help="job config YAML (see configs/)")
    run.add_argument("--run-dir", help="output directory (default: the config's run_dir)")
    run.add_argument("--mode", choices=["async", "sync", "sequential"], help="override the config's mode")
    run.set_defaults(func=cmd_run)
    sbatch = sub.add_parser("sbatch", help="print the Slurm heterogeneous-job script of a config (marlaas sbatch C > job.sbatch)")
    sbatch.add_argument("config")
    sbatch.add_argument("--run-dir", help="output directory (default: the config's run_dir)")
    sbatch.add_argument("--job-name", default="marlaas")
    sbatch.set_defaults(func=cmd_sbatch)
    status = sub.add_parser("status", help="per-task step / state / reward of a run dir")
    status.add_argument("run_dir")
    status.set_defaults(func=cmd_status)
    from marlaas_hpc.sim.command import add_parser as add_simulate_parser

    add_simulate_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
