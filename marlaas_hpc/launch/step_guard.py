"""Runs the job's one srun step from the batch script and ends srun if it outlives its step.

    python -m marlaas_hpc.launch.step_guard [--poll S] [--grace S] -- srun ... --het-group=0 ... : ... CMD

On the emulated cluster (Slurm 22.05, several slurmd on one host) srun of a het step sometimes never
returns after every rank has exited: slurmd logs "done with job" for all components and sacct records
each step component COMPLETED 0:0, yet srun, and with it the batch script, keeps the allocation until
the time limit (2 of 216 jobs). The guard watches the step in slurmctld (squeue --steps); once it has
seen the step and the step has been gone for `grace` seconds while srun still runs, it stops srun and
exits with the step's own result from accounting (sacct), so the job ends as it would have.
A step shorter than one poll is never listed by squeue: then accounting tells that it ran and ended (a numbered
step of the job started since the guard started, in a final state), which counts as seen and gone (a probe's
one-second step hung this way twice in 50 test runs under load).

When the batch step itself is ended (scancel, a requeue after a checkpoint) the guard ends srun with it:
it forwards SIGTERM / SIGINT / SIGHUP to srun, and srun gets SIGTERM if the guard dies outright (parent-
death signal). Without that, a requeue left the first run's srun behind, reparented to init: with
proctrack/linuxproc (the emulated cluster) Slurm finds processes only through their parents.

The guard is also the job's supervisor (launch/supervise.py): every rank reports to its monitor, so when a rank
dies or fails (srun --kill-on-bad-exit then ends the step) the guard prints one message naming the rank, its
role and the cause, keeps it in RUN_DIR/crash.json, and requeues the job (`scontrol requeue`) as a preemption
would: the next run resumes from the tasks' periodic checkpoints (--auto-resume). At most
`checkpoint.max_crash_requeues` times per run dir (counted in RUN_DIR/slurm/crash_requeues).
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time

from marlaas_hpc.launch.supervise import Supervisor, stop

CRASH_REQUEUED_EXIT = 75
"""The guard's status after it requeued a crashed job (EX_TEMPFAIL, as a preempted job's)."""


def running_steps(squeue_out: str) -> set[str]:
    """Numbered step ids ('0', '1') in `squeue -h --steps -o %i` output; batch/extern steps are skipped."""
    steps = set()
    for line in squeue_out.split():
        _, dot, step = line.partition(".")
        if dot and step.isdigit():
            steps.add(step)
    return steps


def finished_steps(sacct_out: str, job_id: str, since: str) -> set[str]:
    """Numbered step ids that `sacct -n -P -o JobID,State,Start` output shows in a final state, among those
    started at or after `since` (sacct's ISO time, compared as text), over every het component."""
    pattern = re.compile(rf"{re.escape(job_id)}(\+\d+)?\.(\d+)")
    steps = set()
    for line in sacct_out.splitlines():
        fields = line.split("|")
        match = pattern.fullmatch(fields[0]) if len(fields) >= 3 else None
        if match and fields[1].split()[0] not in ("RUNNING", "PENDING", "COMPLETING") and fields[2] >= since:
            steps.add(match.group(2))
    return steps


def step_exit_status(sacct_out: str, job_id: str, step: str) -> int | None:
    """The exit status of step `step` from `sacct -n -P -o JobID,State,ExitCode` output: the worst over its
    het components (JOB+i.STEP) or the plain JOB.STEP row; None when accounting has no finished row."""
    pattern = re.compile(rf"{re.escape(job_id)}(\+\d+)?\.{re.escape(step)}")
    status = None
    for line in sacct_out.splitlines():
        fields = line.split("|")
        if len(fields) < 3 or not pattern.fullmatch(fields[0]):
            continue
        state, code = fields[1].split()[0], fields[2]
        if state in ("RUNNING", "PENDING", "COMPLETING"):
            return None
        exit_code, _, signal = code.partition(":")
        value = int(exit_code or 0) or (128 + int(signal) if signal.isdigit() and int(signal) else 0)
        if state != "COMPLETED" and value == 0:
            value = 1
        status = max(status or 0, value)
    return status


def _query(argv: list[str]) -> str | None:
    """stdout of a Slurm client command, None when it fails (controller busy, no accounting)."""
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def _log(message: str) -> None:
    print(f"[marlaas step-guard {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


_stop = stop
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""Signals that end the batch step: passed on to srun, then the guard exits."""


class _SignalForwarder:
    """Passes FORWARDED signals on to srun, then stops it and exits 128 + signal. Installed before srun starts:
    a signal that arrives in between is held and passed on once srun exists (it used to hit Python's default
    handler there and leave srun running)."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.pending: int | None = None
        for signum in FORWARDED:
            signal.signal(signum, self._on_signal)

    def attach(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        if self.pending is not None:
            self._forward(self.pending)

    def _on_signal(self, signum, _frame) -> None:
        if self.proc is None:
            self.pending = signum
        else:
            self._forward(signum)

    def _forward(self, signum: int) -> None:
        _log(f"got signal {signum}: passing it on to srun and stopping it")
        self.proc.send_signal(signum)
        _stop(self.proc)
        raise SystemExit(128 + signum)


def guard(argv: list[str], job_id: str, poll_s: float = 5.0, grace_s: float = 60.0) -> int:
    """Runs `argv` (the srun command) and returns its exit status, or the step's status from sacct when
    srun is still alive `grace_s` after slurmctld stopped listing a step it listed before; if a rank's failure
    ended the step, reports it and requeues the job (CRASH_REQUEUED_EXIT)."""
    supervisor = Supervisor()
    forwarder = _SignalForwarder()
    proc = supervisor.start(argv, dict(os.environ))
    forwarder.attach(proc)
    try:
        return after_step(supervisor, _watch(proc, job_id, poll_s, grace_s), job_id)
    finally:
        supervisor.close()


def _watch(proc: subprocess.Popen, job_id: str, poll_s: float, grace_s: float) -> int:
    started = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 1))  # sacct's local time
    seen: set[str] = set()
    gone_since = None
    while True:
        try:
            code = proc.wait(timeout=poll_s)
            return code if code >= 0 else 128 - code  # killed by a signal: the shell's convention
        except subprocess.TimeoutExpired:
            pass
        listing = _query(["squeue", "-h", "--steps", "-j", job_id, "-o", "%i"])
        if listing is None:
            continue  # no answer this time: decide nothing
        steps = running_steps(listing)
        if steps:  # still running
            seen |= steps
            gone_since = None
            continue
        if not seen:  # not started yet (srun waits for its nodes), or so short that squeue never listed it
            accounting = _query(["sacct", "-n", "-P", "-o", "JobID,State,Start", "-j", job_id])
            seen |= finished_steps(accounting or "", job_id, started)
            if not seen:
                continue
        gone_since = gone_since or time.monotonic()
        if time.monotonic() - gone_since < grace_s:
            continue
        step = max(seen, key=int)
        _log(f"srun still running {grace_s:.0f} s after step {job_id}.{step} ended in slurmctld; stopping it")
        _stop(proc)
        status = step_exit_status(_query(["sacct", "-n", "-P", "-o", "JobID,State,ExitCode", "-j", job_id]) or "",
                                  job_id, step)
        if status is None:
            _log("accounting has no result for the step; exiting 1")
            return 1
        _log(f"step {job_id}.{step} ended with status {status} (sacct)")
        return status


def after_step(supervisor: Supervisor, code: int, job_id: str) -> int:
    """A step ended by a rank's failure: one message, and a requeue while the run dir is resumable and the
    job's max_crash_requeues is not used up. Otherwise the step's own status."""
    # layout.mpi: ulfm: a job that went on without a lost rank ends with rank 0's status (ULFM's mpiexec still
    # reports the death: a het job of 6 ranks, one SIGKILLed, ended with status 9), and a 0 stands only if rank 0
    # said so (launch/supervise.py)
    code = supervisor.settle(code)
    failure = supervisor.failure(code)
    if failure is None:
        supervisor.report(code)
        return code
    run_dir = supervisor.run_dir_of(failure)
    hello = supervisor.monitor.hello(0) or failure.info
    limit = int(hello.get("max_crash_requeues", 0))
    counter = run_dir / "slurm" / "crash_requeues" if run_dir else None
    done = int(counter.read_text()) if counter and counter.is_file() else 0
    if run_dir is None or not (run_dir / "job.yaml").is_file():
        supervisor.report(code, "The run dir is unknown: not requeued.")
        return code
    if done >= limit:
        supervisor.report(code, f"Not requeued: {done} crash requeues already (checkpoint.max_crash_requeues="
                                f"{limit}). `scontrol requeue {job_id}` resumes it.")
        return code
    supervisor.report(code, f"Requeueing job {job_id} (crash requeue {done + 1} of {limit}); it resumes from "
                            "the tasks' last checkpoints.", extra={"requeued": True})
    counter.parent.mkdir(parents=True, exist_ok=True)
    counter.write_text(f"{done + 1}\n")
    if _query(["scontrol", "requeue", job_id]) is None:
        _log(f"scontrol requeue {job_id} failed")
        return code
    return CRASH_REQUEUED_EXIT


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m marlaas_hpc.launch.step_guard", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--poll", type=float, default=5.0, help="seconds between squeue polls")
    parser.add_argument("--grace", type=float, default=60.0,
                        help="seconds srun may outlive its step before it is stopped")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- srun ARGS...")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no srun command given (after --)")
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:  # outside an allocation there is no step to watch
        os.execvp(command[0], command)
    raise SystemExit(guard(command, job_id, args.poll, args.grace))


if __name__ == "__main__":
    main()
