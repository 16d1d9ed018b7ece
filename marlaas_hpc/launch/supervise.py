"""The job's supervisor: runs the launcher (mpirun in local mode; srun under the Slurm step guard) with a rank
monitor (launch/monitor.py), and when a rank dies or fails ends the job with ONE message naming the rank, its
role and the cause, also kept in RUN_DIR/crash.json. No task is blamed: the tasks resume from their checkpoints.

    marlaas: job stopped: rank 2 (rollout, pid 4242 on n1) died: killed by signal 9 (SIGKILL); no task is at
    fault. Resume with: marlaas run --resume RUN_DIR

- A rank's failure ends the whole job within seconds: mpirun and `srun --kill-on-bad-exit` take the other ranks
  down themselves; if the launcher is still running STOP_AFTER_FAILURE_S after the first failure, the
  supervisor stops it.
- Open MPI's own banners about the abort ("mpirun noticed that process rank 2 ... exited on signal 9") are not
  passed on when the message above replaces them (the signal is read from them); other launcher output is.
- SIGUSR2 (checkpoint and stop), SIGINT, SIGTERM and SIGHUP are passed on to the launcher; a job stopped by
  SIGINT / SIGTERM / SIGHUP is reported as interrupted, not as a rank's failure.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from marlaas_hpc.launch.monitor import MONITOR_ENV, RankFailure, RankMonitor, tolerated

STOP_AFTER_FAILURE_S = 10.0
"""How long the launcher gets to take the other ranks down after a rank failed before the supervisor stops it."""
STOP_WAIT_S = 10.0
"""How long the launcher gets to exit after SIGTERM before SIGKILL."""
CRASH_FILE = "crash.json"
LOST_RANK_EXIT = 1
"""The job's status when a rank's loss stopped it but the launcher said 0 (the ULFM mpiexec does)."""
ENDED_WAIT_S = 3.0
"""After the launcher exited, how long the monitor gets to see the connections of its killed ranks end."""
LOSS_DIR = "faults"
"""RUN_DIR/faults/rank<N>.json: the cause of a rank's loss that the job went on without (rank 0 names it)."""
FORWARDED = (signal.SIGUSR2, signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
INTERRUPTING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
PR_SET_PDEATHSIG = 1
_BANNER_RULE = re.compile(r"^-{20,}$")
_MPI_SIGNAL = re.compile(r"process rank (\d+) with PID \d+ on node \S+ exited on signal (\d+)")
_SRUN_TASK_ENDED = re.compile(r"^srun: error: (\S+): task (\d+): (.+)$")
_MPI_BANNERS = ("noticed that process rank", "Primary job  terminated normally",
                "MPI_ABORT was invoked on rank", "ORTE has lost communication", "mpirun has exited due to process")


def die_with_parent() -> None:
    """In the child before exec: SIGTERM when the supervisor dies, even by SIGKILL (Linux; elsewhere a no-op)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def loss_cause(run_dir: str | Path, rank: int) -> str | None:
    """The cause the supervisor gave for a rank the job went on without; None until it has written it."""
    path = Path(run_dir) / LOSS_DIR / f"rank{rank}.json"
    try:
        return json.loads(path.read_text())["cause"]
    except (OSError, ValueError, KeyError):
        return None


class Supervisor:
    def __init__(self, run_dir: str | Path | None = None, stop_after_failure_s: float = STOP_AFTER_FAILURE_S):
        self.monitor = RankMonitor(on_failure=self._on_failure)
        self.run_dir = Path(run_dir) if run_dir else None
        self.stop_after_failure_s = stop_after_failure_s
        self.interrupted: int | None = None
        self.rank_signals: dict[int, int] = {}
        """Signals the launcher said ranks died of (Open MPI's banner)."""
        self.held_banners: list[str] = []
        self.srun_said: str | None = None
        """srun's first "error: NODE: task N: Killed" line (its task numbers are per het component: the rank
        is the monitor's to tell, the line only adds how the task ended)."""
        self.stopped_launcher = False
        """The supervisor stopped the launcher (its exit status then says nothing about the failed rank)."""
        self.proc: subprocess.Popen | None = None

    def environ(self, base: dict) -> dict:
        return {**base, MONITOR_ENV: self.monitor.address}

    # ---- while the launcher runs ----
    def start(self, argv: list[str], env: dict, filter_stderr: bool = True) -> subprocess.Popen:
        self.proc = subprocess.Popen(argv, env=self.environ(env), preexec_fn=die_with_parent,
                                     stderr=subprocess.PIPE if filter_stderr else None, text=True,
                                     errors="replace")
        if filter_stderr:
            threading.Thread(target=self._pump_stderr, daemon=True).start()
        threading.Thread(target=self._stop_after_failure, daemon=True).start()
        self.monitor.watch(self._hung)
        return self.proc

    def _hung(self, failure: RankFailure) -> None:
        """A hung rank (launch/monitor.py): on record first (the cause rank 0 names), then killed, so that it is
        handled as a dead rank (the job goes on without it, or stops). Only a rank on this host can be killed from
        here; elsewhere (a Slurm step across nodes) the job stops when the launcher is stopped."""
        self.monitor.record_hang(failure)
        pid, host = failure.info.get("pid"), failure.info.get("host")
        if pid and host == socket.gethostname():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        else:
            print(f"marlaas: rank {failure.rank} on {host} is hung and cannot be killed from here", file=sys.stderr,
                  flush=True)

    def forward_signals(self, on_interrupt=None) -> None:
        """Passes USR2 / INT / TERM / HUP on to the launcher. `on_interrupt(signum)` runs after an interrupting
        one is passed on (the step guard stops srun and exits there)."""
        def forward(signum, _frame):
            if signum in INTERRUPTING:
                self.interrupted = signum
            if self.proc is not None and self.proc.poll() is None:
                self.proc.send_signal(signum)
            if signum in INTERRUPTING and on_interrupt is not None:
                on_interrupt(signum)

        for signum in FORWARDED:
            signal.signal(signum, forward)

    def _pump_stderr(self) -> None:
        """Passes the launcher's stderr on, line by line, holding back Open MPI's abort banners (their facts go
        into the one message instead; they are printed at the end if no rank failure explains them)."""
        block: list[str] | None = None
        for line in self.proc.stderr:
            line = line.replace("\0", "")  # prterun (ULFM) ends its stderr with a NUL and no newline
            if not line.strip():
                continue
            if not line.endswith("\n"):
                line += "\n"  # the supervisor's own message starts a line of its own
            if block is not None:
                block.append(line)
                if _BANNER_RULE.match(line.strip()):
                    self._banner("".join(block))
                    block = None
            elif _BANNER_RULE.match(line.strip()):
                block = [line]
            else:
                match = _SRUN_TASK_ENDED.match(line.strip())
                if match and self.srun_said is None:
                    self.srun_said = line.strip()[len("srun: error: "):]
                sys.stderr.write(line)
                sys.stderr.flush()
        if block:
            sys.stderr.write("".join(block))
            sys.stderr.flush()

    def _banner(self, text: str) -> None:
        for match in _MPI_SIGNAL.finditer(text.replace("\n", " ")):
            self.rank_signals.setdefault(int(match.group(1)), int(match.group(2)))
        if any(marker in text for marker in _MPI_BANNERS):
            self.held_banners.append(text)
        else:
            sys.stderr.write(text)
            sys.stderr.flush()

    def _stop_after_failure(self) -> None:
        self.monitor.failed.wait()
        deadline = time.monotonic() + self.stop_after_failure_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return
            time.sleep(0.2)
        failure = self.monitor.first_failure()
        print(f"marlaas: rank {failure.rank} failed {self.stop_after_failure_s:.0f} s ago and the launcher is still "
              "running: stopping it", file=sys.stderr, flush=True)
        self.stopped_launcher = True
        stop(self.proc)

    def _on_failure(self, failure: RankFailure) -> None:
        """A rank the job goes on without: its cause, where rank 0 reads it for its line and records."""
        if not tolerated(failure):
            return
        run_dir = self.run_dir_of(failure)
        if run_dir is None:
            return
        record = {"rank": failure.rank, "role": failure.role, "cause": self.explain(failure, None),
                  "time": failure.time, "pid": failure.info.get("pid"), "host": failure.info.get("host")}
        from marlaas_hpc.rundir import atomic_write_text

        atomic_write_text(run_dir / LOSS_DIR / f"rank{failure.rank}.json", json.dumps(record) + "\n")

    # ---- after ----
    def wait(self) -> int:
        code = self.proc.wait()
        return self.settle(code if code >= 0 else 128 - code)  # killed by a signal: the shell's convention

    def settle(self, code: int) -> int:
        """The job's status once the launcher exited with `code`. A job that went on without a lost rank ends with
        rank 0's status (the ULFM launcher still reports a rank that joined the live job, another MPI job to it, and
        was then lost, as exit 137). The ULFM launcher exits 0 whatever its ranks died of, so a 0 stands only when
        rank 0 said the job ended: once PRRTE lost a node's daemon it took every rank down and still exited 0, and
        the Slurm job was COMPLETED with its tasks half done."""
        self.monitor.wait_ended(ENDED_WAIT_S)  # the killed ranks' connections end a moment after the launcher
        ended = self.monitor.job_status()
        if ended is not None and self.interrupted is None:
            return ended
        failure = self.monitor.first_failure()
        if code == 0 and failure is not None and not failure.peer_lost and not tolerated(failure):
            return LOST_RANK_EXIT
        if code == 0 and self.interrupted is None and self.monitor.hello(0) and 0 not in self.monitor.statuses:
            return LOST_RANK_EXIT
        return code

    def failure(self, code: int) -> RankFailure | None:
        """The rank failure that ended the job, if it ended by one (None for a normal end, a preemption (75),
        an interruption, or a launcher that failed before any rank reported)."""
        if self.interrupted is not None or code in (0, 75):
            return None
        return self.monitor.first_failure()

    def run_dir_of(self, failure: RankFailure | None) -> Path | None:
        if self.run_dir is not None:
            return self.run_dir
        hello = self.monitor.hello(0) or (failure.info if failure else {})
        return Path(hello["run_dir"]) if hello and hello.get("run_dir") else None

    def explain(self, failure: RankFailure, code: int | None) -> str:
        """The cause, with the signal a killed rank died of when the launcher said so."""
        if failure.kind == "hang":
            return failure.cause
        if failure.kind == "crash":
            where = f" (traceback: {failure.info['traceback']})" if failure.info.get("traceback") else ""
            return f"failed: {failure.cause}{where}"
        signum = self.rank_signals.get(failure.rank)
        if signum is None and code is not None and code > 128 and not self.rank_signals \
                and not self.stopped_launcher:
            signum = code - 128  # mpirun / srun exit with 128 + the signal of the rank that died first
        if signum is not None:
            try:
                name = signal.Signals(signum).name
            except ValueError:
                name = f"signal {signum}"
            return f"died: killed by signal {signum} ({name})"
        said = f"; srun: {self.srun_said}" if self.srun_said else ""
        return ("died: ended without an error report (killed by a signal: an operator, the out-of-memory killer, "
                f"or a crash in native code{said})")

    def report(self, code: int, resume_hint: str | None = None, extra: dict | None = None) -> str | None:
        """After the launcher ended: the one message (printed and kept in RUN_DIR/crash.json) if a rank's
        failure ended the job; else the held-back launcher banners, if any, are printed and None returned."""
        failure = self.failure(code)
        if failure is None:
            if self.interrupted is None and code not in (0, 75):
                sys.stderr.write("".join(self.held_banners))
                sys.stderr.flush()
            return None
        pid, host = failure.info.get("pid"), failure.info.get("host")
        where = f", pid {pid} on {host}" if pid and host else ""
        cause = self.explain(failure, code)
        message = f"marlaas: job stopped: rank {failure.rank} ({failure.role}{where}) {cause}; no task is at fault."
        message += self.why_stopped(failure)
        run_dir = self.run_dir_of(failure)
        if resume_hint:
            message += f" {resume_hint}"
        elif run_dir is not None:
            message += f" Resume with: marlaas run --resume {run_dir}"
        print(message, file=sys.stderr, flush=True)
        if run_dir is not None and run_dir.is_dir():
            record = {"time": failure.time, "rank": failure.rank, "role": failure.role, "kind": failure.kind,
                      "cause": cause, "message": message, "launcher_status": code,
                      "host": host, "pid": pid, **(extra or {})}
            (run_dir / CRASH_FILE).write_text(json.dumps(record, indent=1) + "\n")
        return message

    def why_stopped(self, failure: RankFailure) -> str:
        """Why one rank's loss stopped the job: rank 0's own reason when it could not go on without it, the MPI
        without fault tolerance, or the job's choice."""
        if failure.rank == 0:
            return " Rank 0 runs the scheduler: the job does not go on without it."
        info = failure.info
        if tolerated(failure):
            reasons = [f.cause.split("JobCannotGoOn: ", 1)[-1] for f in self.monitor.failures
                       if f.rank == 0 and f.kind == "crash"]
            return f" The job could not go on without it: {reasons[0]}." if reasons else ""
        if info.get("why_not"):
            return f" The job stops without it: {info['why_not']}."
        if info.get("on_rank_loss") == "stop":
            return " (fault.on_rank_loss: stop)"
        return ""

    def close(self) -> None:
        self.monitor.close()


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def supervise(argv: list[str], env: dict, run_dir: str | Path) -> int:
    """Local mode (`marlaas run`): runs mpirun under a Supervisor; returns its exit status (0 done, 75
    checkpointed on USR2, else failed; a rank's failure is reported as one message)."""
    supervisor = Supervisor(run_dir)
    supervisor.forward_signals()
    try:
        supervisor.start(argv, env)
        code = supervisor.wait()
        supervisor.report(code)
        if supervisor.interrupted is not None and code not in (0, 75):
            print(f"marlaas: job interrupted ({signal.Signals(supervisor.interrupted).name}); tasks continue "
                  f"from their last checkpoints with: marlaas run --resume {run_dir}", file=sys.stderr, flush=True)
        return code
    finally:
        supervisor.close()

