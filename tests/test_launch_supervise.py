"""The job supervisor with real processes (tests/support/fault_ranks.py under mpirun): when a rank dies or fails, ONE
message names that rank, its role and the cause, also kept in RUN_DIR/crash.json; a rank that only saw its peer
die is not named; a launcher that does not stop by itself is stopped."""
import json
import shutil
import signal
import subprocess
import sys
import time

import pytest

from marlaas_hpc.launch.mpi import LocalMpi, ulfm_prefix
from marlaas_hpc.launch.supervise import Supervisor, supervise
from support.jobs import ROOT, job_env

pytestmark = [pytest.mark.mpi]
RANKS = str(ROOT / "tests" / "support" / "fault_ranks.py")


def _mpirun(what, run_dir):
    return [shutil.which("mpirun"), "-np", "3", "--oversubscribe", sys.executable, RANKS, what, str(run_dir)]


def _supervised(what, tmp_path, capfd):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    code = supervise(_mpirun(what, run_dir), job_env(ROOT), run_dir)
    return code, capfd.readouterr().err, run_dir


@pytest.fixture(autouse=True)
def _restore_signals():
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR2, signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def test_killed_rank_is_named_not_the_rank_whose_collective_failed(tmp_path, capfd):
    code, err, run_dir = _supervised("kill", tmp_path, capfd)
    assert code != 0
    lines = [line for line in err.splitlines() if line.startswith("marlaas: job stopped")]
    assert len(lines) == 1, err[-3000:]
    assert "rank 2 (rollout" in lines[0] and "killed by signal 9 (SIGKILL)" in lines[0]
    assert "no task is at fault" in lines[0] and f"marlaas run --resume {run_dir}" in lines[0]
    assert "mpirun noticed" not in err, "Open MPI's banner is replaced by the one message"
    crash = json.loads((run_dir / "crash.json").read_text())
    assert crash["rank"] == 2 and crash["role"] == "rollout" and crash["message"] == lines[0]
    # rank 1 did crash (gloo: connection closed by peer) and kept its traceback, but it is not the cause
    assert "Connection closed by peer" in (run_dir / "crash" / "rank1.txt").read_text()


def test_rank_that_raises_is_named_with_its_error_and_traceback(tmp_path, capfd):
    code, err, run_dir = _supervised("raise", tmp_path, capfd)
    assert code != 0
    lines = [line for line in err.splitlines() if line.startswith("marlaas: job stopped")]
    assert len(lines) == 1, err[-3000:]
    assert "rank 1 (env" in lines[0] and "failed: OSError: [Errno 28] No space left on device" in lines[0]
    assert f"traceback: {run_dir / 'crash' / 'rank1.txt'}" in lines[0]
    assert "Traceback" not in err, "the traceback is in the file, not repeated on every screen"
    assert "MPI_ABORT was invoked" not in err


def test_a_job_that_ends_normally_says_nothing(tmp_path, capfd):
    code, err, run_dir = _supervised("ok", tmp_path, capfd)
    assert code == 0 and "marlaas:" not in err and not (run_dir / "crash.json").exists()


def test_a_launcher_that_does_not_stop_is_stopped(tmp_path, capfd):
    supervisor = Supervisor(tmp_path, stop_after_failure_s=2.0)
    try:
        t0 = time.monotonic()
        supervisor.start([sys.executable, RANKS, "hang", str(tmp_path)], job_env(ROOT))
        code = supervisor.wait()
        assert time.monotonic() - t0 < 120, "stopped long before the ranks' own 300 s"
        message = supervisor.report(code)
    finally:
        supervisor.close()
    assert "rank 2 (rollout" in message and "ended without an error report" in message
    assert "the launcher is still running: stopping it" in capfd.readouterr().err


def test_under_slurm_the_step_guard_reports_and_requeues_at_most_max_crash_requeues(tmp_path):
    """The step guard in a made-up allocation (no controller answers: the requeue itself fails here; the
    Slurm suite checks a real one) supervises the step like `marlaas run` does, then requeues once."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "job.yaml").write_text("{}\n")
    env = dict(job_env(ROOT), SLURM_JOB_ID="999999")
    guard = [sys.executable, "-m", "marlaas_hpc.launch.step_guard", "--poll", "0.5", "--"]
    first = subprocess.run(guard + _mpirun("kill", run_dir), env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in first.stderr.splitlines() if line.startswith("marlaas: job stopped")]
    assert len(lines) == 1 and "rank 2 (rollout" in lines[0], first.stderr[-3000:]
    assert "Requeueing job 999999 (crash requeue 1 of 1)" in lines[0]
    assert json.loads((run_dir / "crash.json").read_text())["requeued"] is True
    assert (run_dir / "slurm" / "crash_requeues").read_text() == "1\n"
    second = subprocess.run(guard + _mpirun("kill", run_dir), env=env, capture_output=True, text=True, timeout=300)
    assert "Not requeued: 1 crash requeues already (checkpoint.max_crash_requeues=1)" in second.stderr
    assert second.returncode not in (0, 75)


def test_a_crash_report_is_not_overtaken_by_the_deaths_it_causes():
    """A failing rank sends its report, then aborts; the launcher kills the others at once. When the monitor
    reads the report and a bystander's end in one go (a loaded node), the report still names the cause."""
    from marlaas_hpc.launch.monitor import RankMonitor, RankReporter

    monitor = RankMonitor("127.0.0.1")
    try:
        env = {"MARLAAS_MONITOR": monitor.address}
        failing = RankReporter.connect({"rank": 4, "role": "trainer leader"}, env)
        bystanders = [RankReporter.connect({"rank": r, "role": "env"}, env) for r in (1, 2, 3)]
        deadline = time.monotonic() + 10
        while len(monitor.hellos) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        with monitor._lock:  # the monitor stalls (as under load) while the report and the deaths arrive
            failing.crash("DistNetworkError: address already in use", peer_lost=False)
            for reporter in bystanders:
                reporter.sock.close()  # killed: the connection ends without a word
            time.sleep(0.3)
        while len(monitor.failures) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        first = monitor.first_failure()
        assert (first.rank, first.kind) == (4, "crash"), monitor.failures
    finally:
        monitor.close()


def test_a_rank_whose_loop_stops_turning_is_killed_and_named_with_what_it_was_doing(tmp_path, capfd):
    """Rank 2's loop stops turning inside a 'generate' span (its heartbeat thread goes on): after its
    hang_timeout_s the supervisor names it, says what it was doing, and kills it; the job then stops as after
    any rank's death."""
    t0 = time.monotonic()
    code, err, run_dir = _supervised("stuck", tmp_path, capfd)
    assert code != 0 and time.monotonic() - t0 < 60, "killed long before the ranks' own 120 s"
    lines = [line for line in err.splitlines() if line.startswith("marlaas: job stopped")]
    assert len(lines) == 1, err[-3000:]
    assert "rank 2 (rollout" in lines[0] and "hung: its loop has not turned for" in lines[0]
    assert "in 'generate' of add" in lines[0] and "killed with SIGKILL" in lines[0]


def test_a_stopped_rank_sends_no_heartbeat_and_is_found_hung():
    """A process stopped with SIGSTOP: its heartbeat thread stops too, and the silence is what counts."""
    from marlaas_hpc.launch.monitor import RankMonitor

    monitor = RankMonitor("127.0.0.1")
    script = ("import sys, time\nfrom marlaas_hpc.launch.monitor import RankReporter\n"
              "r = RankReporter.connect({'rank': 3, 'role': 'rollout', 'hang_timeout_s': 2.0})\n"
              "r.start_heartbeat()\nwhile True:\n    r.turned(); time.sleep(0.05)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], env=dict(job_env(ROOT), MARLAAS_MONITOR=monitor.address))
    try:
        deadline = time.monotonic() + 30
        while not any(p.beat for p in monitor._peers.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(2.5)
        assert monitor.hung() == [], "a rank that turns and beats is not hung"
        proc.send_signal(signal.SIGSTOP)
        time.sleep(3.5)
        (found,) = monitor.hung()
        assert found.rank == 3 and found.kind == "hang" and "no heartbeat for" in found.cause
        assert monitor.hung() == [], "each hang is found once"
    finally:
        proc.kill()
        proc.wait()
        monitor.close()


@pytest.mark.skipif(ulfm_prefix() is None, reason="needs the ULFM Open MPI (tools/setup_env.sh)")
def test_under_ulfm_the_step_guard_does_not_take_a_0_for_a_finish_when_rank_0_died(tmp_path):
    """ULFM's mpiexec exits 0 whatever its ranks died of. A CI run had PRRTE lose a node's daemon and take every rank
    down, rank 0 included: mpiexec said 0 and the step guard with it, so Slurm recorded the job COMPLETED with its
    tasks half done and no requeue. Now a 0 stands only when rank 0 said the job ended."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "job.yaml").write_text("{}\n")
    mpi = LocalMpi(kind="ulfm", mpiexec=str(ulfm_prefix() / "bin" / "mpiexec"), prefix=ulfm_prefix())
    mpiexec = [mpi.mpiexec, "--with-ft", "ulfm", "-n", "3", "--oversubscribe", sys.executable, RANKS, "kill0",
               str(run_dir)]
    assert subprocess.run(mpiexec, env=mpi.environ(job_env(ROOT)), timeout=120).returncode == 0, "what ULFM says"
    env = dict(mpi.environ(job_env(ROOT)), SLURM_JOB_ID="999999")
    guard = [sys.executable, "-m", "marlaas_hpc.launch.step_guard", "--poll", "0.5", "--"]
    out = subprocess.run(guard + mpiexec, env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in out.stderr.splitlines() if line.startswith("marlaas: job stopped")]
    assert len(lines) == 1 and "rank 0 (scheduler" in lines[0], out.stderr[-3000:]
    assert "Requeueing job 999999 (crash requeue 1 of 1)" in lines[0]
    assert out.returncode not in (0, 75)
