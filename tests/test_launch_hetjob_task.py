"""The per-rank entry's exit watchdog: a rank whose job is done but whose interpreter shutdown hangs (a
non-daemon thread here; MPI_Finalize on the emulated cluster) still ends, with the job's status."""
import subprocess
import sys
import time

SCRIPT = """
import threading, time
from marlaas_hpc.launch.hetjob_task import exit_watchdog
threading.Thread(target=time.sleep, args=(3600,)).start()  # non-daemon: shutdown would wait an hour
exit_watchdog(3, grace_s=1.0)
"""


def test_hung_shutdown_ends_after_the_grace_period_with_the_jobs_status():
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3
    assert "hung in shutdown" in proc.stderr
    assert time.monotonic() - start < 30


def test_clean_shutdown_is_not_delayed():
    script = "from marlaas_hpc.launch.hetjob_task import exit_watchdog\nexit_watchdog(0, grace_s=60.0)\n"
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and time.monotonic() - start < 30
