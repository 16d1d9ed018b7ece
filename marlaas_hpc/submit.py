"""`marlaas submit`: the whole multi-task job as one Slurm heterogeneous job through HetJobExecutor.

Every world rank runs `python -m marlaas_hpc.submit FOLDER` (`rank_main`): submitit's task main runs
`MarlaasJob()(config, run_dir)` (pickled once) and writes the rank's result; then the rank ends through
`end_rank` (runtime/main.py: MPI finalized, os._exit), as the ranks of `marlaas run` do, not through the
interpreter's teardown with NCCL groups and the vLLM engine alive: after the result was written, a hang there held
the allocation until the time limit and a crash there failed the step of a job that had finished.

The runtime installs its own SIGUSR2 handler over submitit's: Slurm's `--signal=USR2@lead` (or `scancel
--signal=USR2`) makes rank 0 drain and checkpoint every task (runtime/checkpoint.py). Rank 0 then requeues the job
the way submitit's handler would (`scontrol requeue` through submitit's JobEnvironment) and exits without a result
(status 255, as sys.exit(-1) in submitit's handler), so submitit keeps reporting the job as running; the requeued
run finds the checkpoint and resumes.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from marlaas_hpc.runtime.checkpoint import load_job_checkpoint

if TYPE_CHECKING:
    from marlaas_hpc.launch.submitit_hetjob import HetJobExecutor

TASK_MODULE = "marlaas_hpc.submit"
"""The module every rank of a `marlaas submit` job runs (`rank_main`)."""


class MarlaasJob:
    """The function a `marlaas submit` job runs on every rank."""

    def __init__(self, max_requeues: int = 10):
        self.max_requeues = max_requeues
        """Preemptions after which the job stops requeueing itself (a job whose time limit is too short for
        any progress would otherwise loop forever)."""

    def __call__(self, config: str, run_dir: str) -> dict | None:
        from marlaas_hpc.runtime.main import main
        from marlaas_hpc.runtime.process import PREEMPTED_EXIT

        code = main([config, "--run-dir", run_dir, "--auto-resume"])  # binds the rank's device, then starts MPI
        from mpi4py import MPI

        rank = MPI.COMM_WORLD.Get_rank()
        if code == PREEMPTED_EXIT:
            if rank == 0:
                self._requeue(Path(run_dir))
            return None
        if code != 0:
            raise RuntimeError(f"marlaas job failed with exit status {code} (see rank 0's log)")
        return json.loads((Path(run_dir) / "summary.json").read_text()) if rank == 0 else None

    def _requeue(self, run_dir: Path) -> None:
        import submitit

        runs = len((load_job_checkpoint(run_dir) or {}).get("runs", []))
        if runs > self.max_requeues:
            raise RuntimeError(f"preempted {runs} times (max_requeues={self.max_requeues}); not requeueing. "
                               f"Resume by hand: marlaas submit --resume {run_dir}")
        submitit.JobEnvironment()._requeue(self.max_requeues - runs)
        sys.stdout.flush()
        sys.exit(-1)  # as submitit's own handler: no result file, the requeued run writes it


def rank_main(folder: str) -> None:
    """Every rank of a `marlaas submit` job: its output to its submitit log files, submitit's task main (unpickle
    MarlaasJob, run it, write this rank's result or error pickle), then `end_rank` once that is written. Exit
    status: 0, 1 after an error (its traceback in the rank's log), or the requeue's (rank 0 after a preemption)."""
    import traceback

    from submitit.core.submission import process_job

    from marlaas_hpc.launch.hetjob_task import redirect_output
    from marlaas_hpc.runtime.process import end_rank

    redirect_output(folder)
    try:
        process_job(folder)
        code = 0
    except SystemExit as exc:  # MarlaasJob requeued the job: no result pickle, as submitit's own USR2 handler
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # of an Exception, process_job wrote the error pickle
        traceback.print_exc()
        code = 1
    end_rank(code)


def het_executor(folder: str | Path, layout) -> "HetJobExecutor":
    """The executor `marlaas submit` uses: every rank runs `rank_main`."""
    from marlaas_hpc.launch.submitit_hetjob import HetJobExecutor

    return HetJobExecutor(folder, layout, task_module=TASK_MODULE)


def submit(job, config_path: str, job_name: str = "marlaas", max_requeues: int = 10, check_cluster: bool = True):
    """Submits a validated JobConfig as one het job; returns submitit's Job handle. Refuses what Slurm would
    only refuse later (or never): partitions the cluster lacks, a run dir holding another job's checkpoint."""
    from marlaas_hpc.launch.sbatch import check_partitions
    from marlaas_hpc.runtime.process import check_run_dir, save_job_file

    job.layout.validate()
    if check_cluster:
        check_partitions(job.layout)
    # a placeholder checkpoint path renders (marlaas sbatch) but is not submitted; the tiny model (or a random
    # checkpoint) is built here once, not in every rank at once; rollout ranks run vLLM on CPU when their
    # component asks Slurm for no GPU
    job.check_models(vllm_on_cpu=not job.layout.rollout.requests_gpus())
    run_dir = Path(job.run_dir).resolve()
    job.run_dir = str(run_dir)
    check_run_dir(job, resume=False)
    save_job_file(job, config_path)
    executor = het_executor(run_dir / "slurm", job.layout)
    executor.update_parameters(job_name=job_name)
    handle = executor.submit(MarlaasJob(max_requeues), str(run_dir / "job.yaml"), str(run_dir))
    record_job(handle.job_id, run_dir)
    return handle


def jobs_registry() -> Path:
    from marlaas_hpc.model.cache import default_cache_dir

    return default_cache_dir() / "jobs"


def record_job(job_id: str, run_dir: Path) -> None:
    """job id -> run dir, for `marlaas status JOB` / `marlaas cancel JOB` (and RUN_DIR/slurm/job_id)."""
    for path in (jobs_registry() / f"{job_id}.json", Path(run_dir) / "slurm" / "job_id"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"job_id": job_id, "run_dir": str(run_dir)}) + "\n")


def run_dir_of(job_id: str) -> Path | None:
    path = jobs_registry() / f"{job_id}.json"
    return Path(json.loads(path.read_text())["run_dir"]) if path.is_file() else None


def slurm_state(job_id: str) -> str | None:
    """The het job's state from sacct (components folded into one), None if Slurm does not know it."""
    import subprocess

    from marlaas_hpc.launch.submitit_hetjob import fold_states

    try:
        out = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", job_id], capture_output=True,
                             text=True, timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    rows = [dict(zip(("JobID", "State"), line.split("|"))) for line in out.stdout.splitlines() if line.strip()]
    return fold_states(rows)["State"] if rows else None


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m marlaas_hpc.submit SUBMITIT_FOLDER")
    rank_main(sys.argv[1])
