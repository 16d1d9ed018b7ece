"""How a rank of a `marlaas submit` job ends (marlaas_hpc.submit.rank_main): submitit's task main writes the rank's
result, then the process ends through runtime/main.py's `end_rank` (MPI finalized, os._exit), never through the
interpreter's teardown, where NCCL groups and the vLLM engine are still alive.

Here the rank's command (as the submit executor renders it) runs in a plain process, in the Slurm environment
submitit reads, on functions that leave a non-daemon thread running: a real teardown hang (Python waits for such
threads at exit), standing in for the engine's and NCCL's threads, which this CPU does not have. The real job on
the local Slurm cluster: tests/test_slurm_job.py.
"""
from __future__ import annotations

import os
import pickle
import shlex
import subprocess
import sys
import threading
from pathlib import Path

import cloudpickle
import pytest
from submitit.core.utils import DelayedSubmission, JobPaths

from marlaas_hpc.launch.layout import JobLayout

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import this test module
JOB_ID = "4242"


def _leave_a_thread_running() -> None:
    threading.Thread(target=threading.Event().wait, name="engine-like", daemon=False).start()


def returns_with_mpi_up(value: int) -> dict:
    """A rank's function that started MPI (as MarlaasJob's runtime does) and leaves a thread behind."""
    from mpi4py import MPI

    _leave_a_thread_running()
    return {"value": value, "world": MPI.COMM_WORLD.Get_size()}


def raises() -> None:
    _leave_a_thread_running()
    raise RuntimeError("marlaas job failed with exit status 2 (see rank 0's log)")


def requeues() -> None:
    """What MarlaasJob does on rank 0 after a checkpoint: `scontrol requeue` (not here), then sys.exit(-1)."""
    _leave_a_thread_running()
    sys.exit(-1)


def _run_rank(tmp_path: Path, function, *args) -> tuple[subprocess.CompletedProcess, Path]:
    """Runs world rank 0's command of a `marlaas submit` job on `function(*args)`; returns the process and the
    rank's result pickle path."""
    from marlaas_hpc.submit import het_executor

    folder = tmp_path / "slurm"
    folder.mkdir()
    executor = het_executor(folder, JobLayout())
    paths = JobPaths(folder, job_id=JOB_ID, task_id=0)
    DelayedSubmission(function, *args).dump(paths.submitted_pickle)
    env = dict(os.environ, SUBMITIT_EXECUTOR="slurm", SLURM_JOB_ID=JOB_ID, SLURM_PROCID="0", SLURM_NTASKS="1",
               SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_JOB_NUM_NODES="1",
               PYTHONPATH=str(Path(__file__).resolve().parents[1]), OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    try:
        proc = subprocess.run(shlex.split(executor._submitit_command_str), env=env, capture_output=True, text=True,
                              timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail("the rank did not end: its interpreter waited for the thread the function left running")
    return proc, paths.result_pickle


def test_a_finished_rank_writes_its_result_then_ends_through_end_rank(tmp_path):
    proc, result = _run_rank(tmp_path, returns_with_mpi_up, 7)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert pickle.loads(result.read_bytes()) == ("success", {"value": 7, "world": 1})


def test_a_failed_rank_writes_its_error_then_ends_with_status_1(tmp_path):
    proc, result = _run_rank(tmp_path, raises)
    assert proc.returncode == 1
    outcome, text = pickle.loads(result.read_bytes())
    assert outcome == "error" and "marlaas job failed with exit status 2" in text
    log = (tmp_path / "slurm" / f"{JOB_ID}_0_log.err").read_text()
    assert "RuntimeError: marlaas job failed" in log  # the traceback in the rank's own log


def test_a_requeued_rank_leaves_no_result_and_ends_as_submitit_would(tmp_path):
    proc, result = _run_rank(tmp_path, requeues)
    assert proc.returncode == 255 and not result.exists()  # submitit's sys.exit(-1); the rerun writes the result
