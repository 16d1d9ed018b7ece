"""Jobs on the local Slurm cluster (slurm/local-cluster/start.sh): whether it is usable, `marlaas submit` of a
config, sacct states, waiting for a step or for the end, and the known MPI_Init crash of the emulated nodes."""
from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from support.jobs import ROOT, marlaas

START = "bash slurm/local-cluster/start.sh"
SLURM_SMALL = ROOT / "configs" / "slurm-small.yaml"
# On the emulated cluster, under load, ~4 % of het steps lose a rank to a segfault inside MPI_Init
# (Open MPI 4.1.4: btl/tcp calls a NULL active-message callback while the rank waits in the modex fence;
# seen in 5 of ~120 jobs, with and without PMIX_MCA_gds=hash / mpi_add_procs_cutoff). That is the MPI
# library on this test bed, not the launcher: such a job is retried once, visibly.


def cluster_problem() -> str | None:
    """Why the local cluster cannot run the tests' het jobs (None: it can)."""
    if shutil.which("sinfo") is None:
        return f"no Slurm here: sinfo not found (start a local cluster as root: {START})"
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%R %t %D"], capture_output=True, text=True, timeout=15)
    except subprocess.TimeoutExpired:
        return f"sinfo timed out: slurmctld not answering ({START})"
    if out.returncode:
        return f"Slurm cluster down: sinfo failed ({out.stderr.strip()}); {START}"
    usable: dict[str, int] = {}
    for line in out.stdout.splitlines():
        partition, state, count = line.split()
        if state in ("idle", "mix", "alloc", "comp"):  # responding nodes (not down/drain/unknown)
            usable[partition.rstrip("*")] = usable.get(partition.rstrip("*"), 0) + int(count)
    if usable.get("cpu", 0) < 2 or usable.get("gpu", 0) < 2:
        return f"need >= 2 up nodes in partitions cpu and gpu, sinfo has {usable or 'none up'}"
    return None


@pytest.fixture(scope="module")
def cluster():
    problem = cluster_problem()
    if problem:
        pytest.skip(problem)


def mpi_init_crashed(logs: list[Path]) -> bool:
    """A rank segfaulted in the MPI layer: Python's faulthandler naming mpi4py, or Open MPI's handler."""
    text = "".join(p.read_text(errors="replace") for p in logs if p.exists())
    return "Segmentation fault" in text and ("mpi4py" in text or "*** Process received signal ***" in text)


def retry_note(job_id: str) -> None:
    print(f"\n[slurm test] job {job_id}: a rank segfaulted in MPI_Init (Open MPI on the emulated cluster); "
          "retrying once")


def sacct_states(job_id: str) -> list[str]:
    out = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", job_id], capture_output=True,
                         text=True, timeout=30).stdout
    return [line.split("|")[1] for line in out.splitlines() if line.strip()]


def slurm_small_config(steps: int) -> dict:
    """configs/slurm-small.yaml with `steps` steps for every task."""
    config = yaml.safe_load(SLURM_SMALL.read_text())
    for task in config["tasks"]:
        task["total_steps"] = steps
    return config


def submit(config: dict, tmp_path: Path) -> tuple[str, Path, float]:
    """`marlaas submit` of `config` into TMP/run; returns (Slurm job id, run dir, submit time)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    run_dir = tmp_path / "run"
    t0 = time.time()
    proc = marlaas("submit", path, "--run-dir", run_dir, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1], run_dir, t0


def wait_final(job_id: str, run_dir: Path, timeout_s: float) -> list[str]:
    """sacct states once every component has ended; on timeout cancels the job and shows rank 0's log."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = sacct_states(job_id)
        if len(states) == 4 and not any(s.split()[0] in ("PENDING", "RUNNING", "COMPLETING", "REQUEUED",
                                                         "REQUEUE_HOLD", "REQUEUE_FED") for s in states):
            return states
        time.sleep(1)
    subprocess.run(["scancel", job_id], check=False)
    log = run_dir / "slurm" / f"{job_id}_0_log.err"
    pytest.fail(f"job {job_id} not done in {timeout_s}s: {sacct_states(job_id)}\n"
                f"{log.read_text()[-3000:] if log.exists() else 'no rank 0 log'}")


def preempt_at_step(job_id: str, run_dir: Path, step: int) -> list[str] | None:
    """Waits until every task has `step` steps (None), or returns the sacct states if the job ended first."""
    deadline = time.monotonic() + 400
    while True:
        try:
            tasks = json.loads((run_dir / "status.json").read_text())["tasks"]
            if min(t["steps_done"] for t in tasks.values()) >= step:
                return None
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        states = sacct_states(job_id)
        if len(states) == 4 and all(s.split()[0] in ("FAILED", "CANCELLED", "COMPLETED", "TIMEOUT") for s in states):
            return states
        assert time.monotonic() < deadline, f"job {job_id} never reached step {step}: {states}"
        time.sleep(0.5)
