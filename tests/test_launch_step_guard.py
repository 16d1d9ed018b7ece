"""launch/step_guard.py without Slurm: reading squeue/sacct output, and running outside an allocation.
Its behaviour against a real srun that outlives its step is in test_slurm_cluster.py."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from marlaas_hpc.launch.step_guard import finished_steps, running_steps, step_exit_status


def test_running_steps_keeps_numbered_steps_only():
    assert running_steps("935.0\n935.batch\n935.extern\n") == {"0"}
    assert running_steps("935.batch\n") == set()
    assert running_steps("") == set()
    assert running_steps("12.3\n12.10\n") == {"3", "10"}


SACCT = """917+0|COMPLETED|0:0
917+0.batch|CANCELLED|0:15
917+0.0|COMPLETED|0:0
917+1|CANCELLED|0:15
917+1.0|COMPLETED|0:0
917+2.0|COMPLETED|0:0
917+3.0|COMPLETED|0:0
"""


def test_step_exit_status_is_the_worst_component():
    assert step_exit_status(SACCT, "917", "0") == 0
    failed = SACCT.replace("917+2.0|COMPLETED|0:0", "917+2.0|FAILED|3:0")
    assert step_exit_status(failed, "917", "0") == 3
    killed = SACCT.replace("917+1.0|COMPLETED|0:0", "917+1.0|CANCELLED|0:9")
    assert step_exit_status(killed, "917", "0") == 128 + 9
    assert step_exit_status("5.0|OUT_OF_MEMORY|0:125\n", "5", "0") == 128 + 125
    assert step_exit_status("5.0|NODE_FAIL|0:0\n", "5", "0") == 1  # failed without a code: still a failure


def test_step_exit_status_unknown_while_running_or_absent():
    assert step_exit_status(SACCT.replace("917+3.0|COMPLETED", "917+3.0|RUNNING"), "917", "0") is None
    assert step_exit_status(SACCT, "917", "1") is None
    assert step_exit_status(SACCT, "91", "0") is None  # another job's id is not a prefix match


def test_finished_steps_are_numbered_steps_in_a_final_state_since_the_guard_started():
    """A step too short for squeue to list it is known from accounting (the hung probe steps of the Slurm tests)."""
    rows = ("45+0|CANCELLED by 0|2026-11-24T18:50:08\n45+0.batch|RUNNING|2026-11-24T18:50:08\n"
            "45+0.0|COMPLETED|2026-11-24T18:50:08\n45+1.0|COMPLETED|2026-11-24T18:50:08\n"
            "45+2.1|RUNNING|2026-11-24T18:50:09\n45.7|COMPLETED|2026-11-24T18:40:00\n")
    assert finished_steps(rows, "45", "2026-11-24T18:50:07") == {"0"}  # 2 still runs, 7 is an older run's
    assert finished_steps(rows, "45", "2026-11-24T18:30:00") == {"0", "7"}
    assert finished_steps(rows, "4", "2026-11-24T18:30:00") == set()
    assert finished_steps("", "45", "2026-11-24T18:30:00") == set()


def test_outside_an_allocation_it_just_runs_the_command():
    env = {k: v for k, v in os.environ.items() if k != "SLURM_JOB_ID"}
    out = subprocess.run([sys.executable, "-m", "marlaas_hpc.launch.step_guard", "--", "sh", "-c", "exit 7"],
                         env=env, capture_output=True, text=True)
    assert out.returncode == 7
    usage = subprocess.run([sys.executable, "-m", "marlaas_hpc.launch.step_guard", "--"], env=env,
                           capture_output=True, text=True)
    assert usage.returncode == 2 and "no srun command" in usage.stderr


def _guarded_sleep(tmp_path):
    """The guard inside a (made-up) allocation, running a child that records its pid and sleeps."""
    pid_file = tmp_path / "child.pid"
    env = dict(os.environ, SLURM_JOB_ID="999999")  # squeue knows no such job: the guard keeps waiting
    guard = subprocess.Popen([sys.executable, "-m", "marlaas_hpc.launch.step_guard", "--poll", "0.2", "--",
                              "sh", "-c", f"echo $$ > {pid_file}; exec sleep 300"], env=env,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (pid_file.is_file() and pid_file.read_text().strip()):
        assert time.monotonic() < deadline and guard.poll() is None, "the child never started"
        time.sleep(0.05)
    return guard, int(pid_file.read_text())


def _gone(pid: int, timeout: float = 15.0) -> bool:
    """The process ended (absent, or a zombie nobody reaped yet)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_ending_the_guard_ends_srun(tmp_path, signum):
    """A requeue or scancel ends the batch step: srun must not outlive it (it did, reparented to init)."""
    guard, child = _guarded_sleep(tmp_path)
    guard.send_signal(signum)
    assert guard.wait(30) == 128 + signum
    assert _gone(child), "the guarded command outlived the guard"
    assert "passing it on to srun" in guard.stderr.read()


def test_srun_gets_sigterm_when_the_guard_is_killed_outright(tmp_path):
    guard, child = _guarded_sleep(tmp_path)
    guard.kill()
    guard.wait(30)
    assert _gone(child), "the guarded command outlived a SIGKILLed guard"
