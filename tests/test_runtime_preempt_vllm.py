"""Preemption and engine death in a local job whose vLLM engine core runs in a process of its own
(`vllm.engine_process: own`, CPU twin).

USR2 is sent as the README says (to `marlaas run`, which passes it on to the launcher, which forwards it to each
rank's process group, where the engine core sits) and as Slurm's `--signal` does (to every process of the job). The
engine processes ignore it (rollout/vllm_plugin.py): the job checkpoints every task, ends with the requeue status
(75), no engine died or was rebuilt, and `marlaas run --resume` finishes every task with every version trained
exactly once. An engine core SIGKILLed mid-job is rebuilt by its rank within seconds (rollout/vllm_liveness.py,
RestartingEngine), and the job finishes as if nothing happened; before, the rank waited on the dead core until the
hang watchdog (`fault.hang_timeout_s`) killed it and the job stopped with no rollout rank left."""
from __future__ import annotations

import collections
import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml

from support.configs import small_config
from support.jobs import ROOT, job_env, marlaas, min_steps

pytestmark = [pytest.mark.mpi, pytest.mark.slow, pytest.mark.vllm]
STEPS = 30
"""Steps of each task: enough that a signal or a kill sent once both tasks trained 2 lands mid-job. The job trains
8 steps in ~3 s once its ranks are up, and a CI run with the other tests beside this one once took longer than that
between seeing step 2 and signalling (the job ended with 0, not the requeue status)."""
HANG_TIMEOUT_S = 150
"""The jobs' hang watchdog: shorter than the default 600 s so that a rank waiting on a dead engine core (the defect)
fails the test in minutes; far longer than any engine rebuild here."""


def _config() -> dict:
    config = small_config(engine="vllm", vllm={"engine_process": "own", "cpu_kv_cache_gib": 0.25})
    for task in config["tasks"]:
        task["total_steps"] = STEPS
    config["fault"] = {"hang_timeout_s": HANG_TIMEOUT_S}
    return config


class _Job:
    """`marlaas run` in a session of its own (as a batch job's processes are), its output collected."""

    def __init__(self, config: dict, tmp_path: Path):
        self.config_path, self.run_dir = tmp_path / "job.yaml", tmp_path / "run"
        self.config_path.write_text(yaml.safe_dump(config))
        self.tasks = [task["task_id"] for task in config["tasks"]]
        self.proc = subprocess.Popen([sys.executable, "-m", "marlaas_hpc.cli", "run", str(self.config_path),
                                      "--run-dir", str(self.run_dir)], cwd=ROOT, env=job_env(), start_new_session=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_steps(self, steps: int, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while min_steps(self.lines, self.tasks) < steps:
            assert self.proc.poll() is None, "the job ended too early:\n" + self.output()[-4000:]
            assert time.monotonic() < deadline, "the job is too slow:\n" + self.output()[-4000:]
            time.sleep(0.05)

    def processes(self) -> list[psutil.Process]:
        """Every process of the job: `marlaas run` and its descendants (what Slurm's proctrack signals)."""
        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]

    def process_names(self) -> list[tuple[int, str, list[str]]]:
        """(pid, name, command line) of every process of the job: what a failed search for a process saw."""
        names = []
        for process in self.processes():
            with contextlib.suppress(psutil.Error):
                names.append((process.pid, process.name(), process.cmdline()[:3]))
        return names

    def engine_cores(self, wait_s: float = 60) -> list[psutil.Process]:
        """The job's vLLM engine cores, waited for while the job runs (a core names itself once it is up)."""
        deadline = time.monotonic() + wait_s
        while True:
            cores = []
            for process in self.processes():
                with contextlib.suppress(psutil.NoSuchProcess):
                    if process.name() == "VLLM::EngineCore":
                        cores.append(process)
            if cores or time.monotonic() > deadline or self.proc.poll() is not None:
                return cores
            time.sleep(0.5)

    def finish(self, timeout_s: float = 600) -> int:
        try:
            code = self.proc.wait(timeout=timeout_s)
        finally:
            if self.proc.poll() is None:
                for process in reversed(self.processes()):
                    process.kill()
        self.reader.join(timeout=30)
        return code


def _signal_launcher(job: _Job) -> None:
    job.proc.send_signal(signal.SIGUSR2)


def _signal_every_process(job: _Job) -> None:
    for process in job.processes():
        try:
            process.send_signal(signal.SIGUSR2)
        except psutil.NoSuchProcess:
            pass


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _outlives_its_rank(core: psutil.Process, rank: psutil.Process, timeout_s: float = 300) -> bool:
    """Whether the engine core lives as long as its rank: it dies with it at the job's end (PR_SET_PDEATHSIG), and
    is found dead while the rank is still there (looked at after the core) only if something else killed it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(core):
            return not _alive(rank)
        time.sleep(0.02)
    return True


def _check_every_version_trained_once(config: dict, run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    audit = [json.loads(line) for line in (run_dir / "audit.jsonl").read_text().splitlines()]
    for task in config["tasks"]:
        task_id, batch, group = task["task_id"], task["algo"]["batch_prompts"], task["algo"]["group_size"]
        assert summary["tasks"][task_id]["status"] == "done" and summary["tasks"][task_id]["steps_done"] == STEPS
        metrics = (run_dir / "tasks" / task["tenant"] / task_id / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["version"] for line in metrics] == list(range(1, STEPS + 1))
        rows = [r for r in audit if r["task_id"] == task_id]
        assert collections.Counter(r["trained_into"] for r in rows) == {v: batch * group for v in range(1, STEPS + 1)}
        assert len({(r["group_id"], r["sample"]) for r in rows}) == len(rows), "no sample trained twice"
    return summary


@pytest.mark.parametrize("send", [_signal_launcher, _signal_every_process], ids=["to-marlaas-run", "to-every-process"])
def test_usr2_checkpoints_a_job_with_own_process_engines_and_resume_trains_every_version_once(tmp_path, send):
    config = _config()
    job = _Job(config, tmp_path)
    job.wait_steps(2)
    cores = job.engine_cores()
    assert len(cores) == 1, ("the rollout rank's engine core runs in a process of its own; the job's processes: "
                             f"{job.process_names()}, ended: {job.proc.poll()}")
    signalled = len(job.processes())
    send(job)
    assert _outlives_its_rank(cores[0], psutil.Process(cores[0].ppid())), "USR2 killed the engine core"
    code = job.finish()
    out = job.output()
    assert code == 75, out[-4000:]
    assert "[job] preempted: every task checkpointed" in out, out[-4000:]
    summary = json.loads((job.run_dir / "summary.json").read_text())
    assert summary["preempted"] is True and summary["engine_restarts"] == {"2": 0}, summary["engine_restarts"]
    from marlaas_hpc.runtime.records import load_job_checkpoint

    saved = {task: record["saved"]["version"] for task, record in load_job_checkpoint(job.run_dir)["tasks"].items()}
    # a task may finish before the signal (tasks run at their own pace): the job itself was cut short
    assert sorted(saved) == sorted(job.tasks) and all(2 <= v <= STEPS for v in saved.values()), saved
    assert min(saved.values()) < STEPS, f"every task had finished before USR2: {saved}"

    resumed = marlaas("run", "--resume", str(job.run_dir), timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    summary = _check_every_version_trained_once(config, job.run_dir)
    assert [run["ended"] for run in summary["previous_runs"]] == ["preempted"]
    print(f"\nUSR2 {send.__name__[1:]} ({signalled} processes): exit {code}, checkpointed {saved}; resumed: every "
          f"version 1..{STEPS} of {sorted(saved)} trained once")


def test_a_killed_engine_core_is_rebuilt_by_its_rank_and_the_job_finishes(tmp_path):
    config = _config()
    job = _Job(config, tmp_path)
    job.wait_steps(2)
    (core,) = job.engine_cores()
    core.kill()
    killed = time.monotonic()
    code = job.finish()
    out = job.output()
    assert code == 0, out[-4000:]
    summary = _check_every_version_trained_once(config, job.run_dir)
    assert summary["engine_restarts"] == {"2": 1}, summary["engine_restarts"]
    restart = [line for line in out.splitlines() if "restarted" in line and "rank 2" in line]
    # the cause: CoreWatch names the signal, unless vLLM's own monitor saw the death first (EngineDeadError)
    assert restart and ("killed by signal 9" in restart[0] or "EngineDeadError" in restart[0]), out[-4000:]
    assert not summary.get("ranks_lost"), "the rank was not lost: it rebuilt its engine"
    print(f"\nengine core SIGKILLed: the job finished {time.monotonic() - killed:.0f} s later; {restart[0]}")
