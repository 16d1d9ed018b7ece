"""launch/step_guard.py without Slurm: reading squeue/sacct output, and running outside an allocation.
Its behaviour against a real srun that outlives its step is in test_slurm_cluster.py."""
from __future__ import annotations

import os
import subprocess
import sys

from marlaas_hpc.launch.step_guard import running_steps, step_exit_status


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


def test_outside_an_allocation_it_just_runs_the_command():
    env = {k: v for k, v in os.environ.items() if k != "SLURM_JOB_ID"}
    out = subprocess.run([sys.executable, "-m", "marlaas_hpc.launch.step_guard", "--", "sh", "-c", "exit 7"],
                         env=env, capture_output=True, text=True)
    assert out.returncode == 7
    usage = subprocess.run([sys.executable, "-m", "marlaas_hpc.launch.step_guard", "--"], env=env,
                           capture_output=True, text=True)
    assert usage.returncode == 2 and "no srun command" in usage.stderr
