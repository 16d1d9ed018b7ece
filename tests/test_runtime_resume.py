"""Preemption in local mode: SIGUSR2 to `marlaas run` (passed on to mpirun, which forwards it to every rank)
checkpoints every task at a step boundary; `marlaas run --resume RUN_DIR` continues at exactly those versions.
The proof is in the outputs: every version 1..total_steps is trained exactly once (metrics.jsonl and the audit),
the resumed adapter is the checkpointed one, and the staleness bound still holds for every trained sample."""
import collections
import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from test_runtime_mpi import ROOT, _env, small_config

pytestmark = [pytest.mark.mpi, pytest.mark.slow]
STEPS = 14


def _marlaas(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "marlaas_hpc.cli", *args], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def _min_steps(lines: list[str], tasks: list[str]) -> int:
    """The fewest steps any task has made, from rank 0's progress lines ("[add] v3/14 reward ..."): printed as
    each step lands, where status.json is rewritten at most once a second."""
    steps = {task: 0 for task in tasks}
    for line in list(lines):
        match = re.match(r"\[([^\]]+)\] v(\d+)/", line)
        if match and match.group(1) in steps:
            steps[match.group(1)] = max(steps[match.group(1)], int(match.group(2)))
    return min(steps.values())


def _preempt_after(config_path: Path, run_dir: Path, steps: int, timeout_s: float = 400):
    """Starts the job, sends USR2 once every task has `steps` steps, returns the finished process."""
    tasks = [task["task_id"] for task in yaml.safe_load(config_path.read_text())["tasks"]]
    proc = subprocess.Popen([sys.executable, "-m", "marlaas_hpc.cli", "run", str(config_path), "--run-dir",
                             str(run_dir)], cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines: list[str] = []

    def read():
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout_s
    while _min_steps(lines, tasks) < steps:
        assert proc.poll() is None, "job ended before the preemption:\n" + "\n".join(lines[-60:])
        assert time.monotonic() < deadline, "job too slow to reach the preemption point"
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR2)  # `marlaas run` supervises mpirun and passes USR2 on
    proc.wait(timeout=timeout_s)
    reader.join(timeout=30)
    return proc.returncode, "\n".join(lines)


def test_usr2_checkpoints_and_resume_trains_every_version_once(tmp_path):
    config = small_config()
    for task in config["tasks"]:
        task["total_steps"] = STEPS
    config["adapters"] = {"keep_every": 1}  # the checkpointed version's adapter is compared after the run
    config_path = tmp_path / "job.yaml"
    config_path.write_text(yaml.safe_dump(config))
    run_dir = tmp_path / "run"

    code, out = _preempt_after(config_path, run_dir, steps=3)
    assert code == 75, out[-3000:]
    assert "[job] preempted: every task checkpointed" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["preempted"] is True
    from marlaas_hpc.runtime.checkpoint import load_job_checkpoint

    saved = load_job_checkpoint(run_dir)
    versions = {t: r["saved"]["version"] for t, r in saved["tasks"].items()}
    assert all(3 <= v < STEPS for v in versions.values()), versions
    tenants = {t["task_id"]: t["tenant"] for t in config["tasks"]}
    adapter_bytes = {}
    for task_id, version in versions.items():
        task_dir = run_dir / "tasks" / tenants[task_id] / task_id
        for tp in (0, 1):
            assert (task_dir / "checkpoint" / f"tp{tp}-v{version:06d}.pt").is_file()
        adapter = task_dir / "adapters" / f"v{version:04d}" / "adapter_model.safetensors"
        adapter_bytes[task_id] = adapter.read_bytes()
        assert not (task_dir / "adapters" / f"v{version + 1:04d}").exists(), "no step after the checkpoint"

    refused = _marlaas("run", str(config_path), "--run-dir", str(run_dir), timeout=120)
    assert refused.returncode == 2 and "holds a checkpoint" in refused.stderr  # a fresh start would mix jobs

    resumed = _marlaas("run", "--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "[job] resuming (run 2)" in resumed.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["preempted"] is False and [r["ended"] for r in summary["previous_runs"]] == ["preempted"]
    audit = [json.loads(line) for line in (run_dir / "audit.jsonl").read_text().splitlines()]
    for task in config["tasks"]:
        task_id, batch, group = task["task_id"], task["algo"]["batch_prompts"], task["algo"]["group_size"]
        info = summary["tasks"][task_id]
        assert info["status"] == "done" and info["steps_done"] == STEPS
        task_dir = run_dir / "tasks" / tenants[task_id] / task_id
        trained = [json.loads(line)["version"] for line in (task_dir / "metrics.jsonl").read_text().splitlines()]
        assert trained == list(range(1, STEPS + 1)), "each version trained exactly once, none lost"
        rows = [r for r in audit if r["task_id"] == task_id]
        per_version = collections.Counter(r["trained_into"] for r in rows)
        assert per_version == {v: batch * group for v in range(1, STEPS + 1)}
        assert len({(r["group_id"], r["sample"]) for r in rows}) == len(rows), "no sample trained twice"
        for row in rows:
            assert row["trained_into"] - 1 - row["bound"] <= row["behaviour_version"] <= row["trained_into"] - 1
        # the resumed trainer republished the checkpointed adapter: same bytes as before the preemption
        adapter = task_dir / "adapters" / f"v{versions[task_id]:04d}" / "adapter_model.safetensors"
        assert adapter.read_bytes() == adapter_bytes[task_id]
        assert info["eval_accuracy_before"] is not None and info["eval_accuracy_after"] is not None


def test_resume_without_checkpoint_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "job.yaml").write_text(yaml.safe_dump(small_config()))
    proc = _marlaas("run", "--resume", str(run_dir), timeout=120)
    assert proc.returncode == 2 and "nothing to resume" in proc.stderr
    proc = _marlaas("run", "--resume", str(tmp_path / "nowhere"), timeout=120)
    assert proc.returncode == 2 and "no job.yaml" in proc.stderr
