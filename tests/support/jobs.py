"""Launching `marlaas` from tests: the environment every job gets, one-shot commands, a job read as it runs, and
the run-dir records tests read back (ranks/, timeline/, status.json)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
SEED = int(os.environ.get("MARLAAS_FAULT_SEED", time.time_ns() % 100_000))
"""Seed of the random kill points of the fault tests (set MARLAAS_FAULT_SEED to replay; printed on failure)."""
FAULT_STEPS = 60
"""Steps of each task of a job that gains a rank (a joiner or a replacement) or waits out a hang timeout: enough that
the job still runs once the new rank is up or the hang is found (steps of the tiny model take ~0.1-0.2 s here, ~0.45 s
in a CI run)."""
KILL_STEPS = 30
"""Steps of each task of a job that only loses a rank, killed at step 3-8: the job runs on for 20 steps or more
after the kill (60 steps spent ~15 s of CI time per test after its last event, 2026-11-29)."""
RUN_TIMEOUT_S = 600
TRAINING_TASKS = ("add", "sort")
"""The training tasks of configs/test-small.yaml: a Job counts their steps."""


def job_env(extra_path: Path | str | None = None) -> dict[str, str]:
    """The environment of a job and of the CLI: one thread per process, mpirun allowed as root; `extra_path`
    first on PYTHONPATH."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join([str(extra_path), env.get("PYTHONPATH", "")])
    return env


def rank_program(program: str, mode: str, ranks: int, timeout: float = 300) -> dict:
    """`mpirun -np RANKS python tests/support/PROGRAM MODE`: a self-checking rank program; its last line, JSON."""
    proc = subprocess.run(["mpirun", "-np", str(ranks), "--oversubscribe", sys.executable,
                           str(ROOT / "tests" / "support" / program), mode], cwd=ROOT, env=job_env(),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def marlaas(*args, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m marlaas_hpc.cli ARGS` from the checkout, its output captured."""
    return subprocess.run([sys.executable, "-m", "marlaas_hpc.cli", *map(str, args)], cwd=ROOT,
                          env=env or job_env(), capture_output=True, text=True, timeout=timeout)


def run_marlaas(config: dict, tmp_path: Path, *args, extra_path=None, timeout=600):
    """`marlaas run` of `config` (written to TMP/job.yaml) into TMP/run; returns (process, run dir)."""
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    run_dir = tmp_path / "run"
    proc = marlaas("run", path, "--run-dir", run_dir, *args, timeout=timeout, env=job_env(extra_path))
    return proc, run_dir


def finished_run(tmp_path_factory, name: str, config: dict) -> tuple[Path, dict[str, list[dict]]]:
    """A module's one job, run to its end (asserted) in a fresh folder `name`: its run dir and its rank timelines,
    for every test of the module to read."""
    proc, run_dir = run_marlaas(config, tmp_path_factory.mktemp(name), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir, rank_timelines(run_dir)


def job_output(proc: subprocess.CompletedProcess) -> str:
    """The tails a failed job is judged by."""
    return proc.stdout[-3000:] + proc.stderr[-3000:]


def marlaas_stdout(*args, timeout: float = 60) -> str:
    """The stdout of a `marlaas` command that must succeed."""
    proc = marlaas(*args, timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def scale(run_dir: Path, rollout: int) -> None:
    """`marlaas scale RUN_DIR --rollout N`, which must succeed."""
    marlaas_stdout("scale", run_dir, "--rollout", rollout)


class Job:
    """One `marlaas run` (fresh or --resume) whose stdout is read as it comes."""

    def __init__(self, args: list[str], extra_path: Path):
        self.proc = subprocess.Popen([sys.executable, "-m", "marlaas_hpc.cli", "run", *args], cwd=ROOT,
                                     env=job_env(extra_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.lines: list[str] = []
        self.err = ""
        threading.Thread(target=self._read, daemon=True).start()
        self._stderr = threading.Thread(target=self._read_err, daemon=True)
        self._stderr.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def _read_err(self):
        self.err = self.proc.stderr.read()

    def steps(self) -> int:
        """Training steps this run has logged for each of add and sort that is not done (the fewer; rank 0 prints
        a line per step)."""
        lines = list(self.lines)
        resumed = next((line for line in lines if line.startswith("[job] resuming")), "")
        going = [task for task in TRAINING_TASKS if f"{task} done" not in resumed
                 and not any(line.startswith(f"[{task}] done") for line in lines)]
        return min((sum(1 for line in lines if line.startswith(f"[{task}] v")) for task in going), default=1 << 30)

    def wait_steps(self, count: int) -> None:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while self.steps() < count:
            assert self.proc.poll() is None, f"seed {SEED}: job ended early:\n{self.output()}"
            assert time.monotonic() < deadline, f"seed {SEED}: no progress:\n{self.output()}"
            time.sleep(0.2)

    def wait_lines(self, *starts: str) -> None:
        """Until a line starting with each of `starts` has been printed."""
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not all(any(line.startswith(start) for line in list(self.lines)) for start in starts):
            assert self.proc.poll() is None, f"seed {SEED}: job ended early:\n{self.output()}"
            assert time.monotonic() < deadline, f"seed {SEED}: never printed {starts}:\n{self.output()}"
            time.sleep(0.2)

    def finish(self) -> int:
        code = self.proc.wait(timeout=RUN_TIMEOUT_S)
        self._stderr.join(timeout=30)
        return code

    def output(self) -> str:
        return "\n".join(self.lines[-40:]) + "\n--- stderr ---\n" + self.err[-4000:]


def rank_record(run_dir: Path, role: str) -> dict:
    """RUN_DIR/ranks/rank<N>.json of the first rank with `role`."""
    for path in sorted((run_dir / "ranks").glob("rank*.json")):
        record = json.loads(path.read_text())
        if record["role"] == role:
            return record
    raise AssertionError(f"no rank with role {role!r}")


def rank_timelines(run_dir: Path) -> dict[str, list[dict]]:
    """Each rank's timeline records (RUN_DIR/timeline/rank<N>.jsonl), by file stem, in rank-file order."""
    return {path.stem: [json.loads(line) for line in path.read_text().splitlines()]
            for path in sorted((run_dir / "timeline").glob("rank*.jsonl"))}


def live_tasks(run_dir: Path) -> dict:
    """The tasks of a running job's status.json ({} until it is written)."""
    try:
        return json.loads((run_dir / "status.json").read_text())["tasks"]
    except (OSError, ValueError, KeyError):
        return {}


def wait_for(predicate, timeout: float, what: str, job: subprocess.Popen | None = None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        if job is not None and job.poll() is not None:
            raise AssertionError(f"job ended while waiting for {what}: {job.stdout.read()[-3000:]}")
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def min_steps(lines: list[str], tasks: list[str]) -> int:
    """The fewest steps any task has made, from rank 0's progress lines ("[add] v3/14 reward ..."): printed as
    each step lands, where status.json is rewritten at most once a second."""
    steps = {task: 0 for task in tasks}
    for line in list(lines):
        match = re.match(r"\[([^\]]+)\] v(\d+)/", line)
        if match and match.group(1) in steps:
            steps[match.group(1)] = max(steps[match.group(1)], int(match.group(2)))
    return min(steps.values())


def preempt_after(config_path: Path, run_dir: Path, steps: int, timeout_s: float = 400):
    """Starts the job, sends USR2 once every task has `steps` steps, returns (exit code, output)."""
    tasks = [task["task_id"] for task in yaml.safe_load(config_path.read_text())["tasks"]]
    proc = subprocess.Popen([sys.executable, "-m", "marlaas_hpc.cli", "run", str(config_path), "--run-dir",
                             str(run_dir)], cwd=ROOT, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines: list[str] = []

    def read():
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout_s
    while min_steps(lines, tasks) < steps:
        assert proc.poll() is None, "job ended before the preemption:\n" + "\n".join(lines[-60:])
        assert time.monotonic() < deadline, "job too slow to reach the preemption point"
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR2)  # `marlaas run` supervises mpirun and passes USR2 on
    proc.wait(timeout=timeout_s)
    reader.join(timeout=30)
    return proc.returncode, "\n".join(lines)
