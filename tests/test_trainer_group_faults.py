"""A per-rank error no longer splits a TP group (issue #36 item 3), in real `marlaas run` jobs (TP=2, gloo): errors
are raised inside the trainer ranks by tests/support/trainer_faults/sitecustomize.py, in a LoRA hook in the middle of a
fused step's forward (between two TP collectives).

- CUDA's out-of-memory error on the follower only (its 3rd step), then on the leader only (its 6th): no hang, no
  failed task, the two steps redone on both ranks (summary.json `trainer_groups.0.regroups`), and every version of
  every task trained exactly once (audit.jsonl, metrics.jsonl). Before the group guard the follower dropped out
  of the step (the leader waited in a collective until the hang watchdog ended it: the job stopped), and the
  leader failed the tasks of its step and then paired its next collectives with the follower's old ones.
- The same ValueError on both ranks in a step of task sort fused with add (sync mode: the tasks step together):
  sort fails, as a task's fault always did; add, fused with it, trains on (before, both failed)."""
from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from support.configs import small_config
from support.jobs import ROOT, job_env as _env

pytestmark = [pytest.mark.mpi, pytest.mark.slow]
STEPS = 8
INJECTOR = Path(__file__).resolve().parent / "support" / "trainer_faults"


def _run(tmp_path: Path, faults: list[dict], **over) -> tuple[subprocess.CompletedProcess, Path]:
    config = small_config(fault={"hang_timeout_s": 120}, **over)  # a group split by a fault hangs: end it sooner
    for task in config["tasks"]:
        task["total_steps"] = STEPS
    path, run_dir = tmp_path / "job.yaml", tmp_path / "run"
    path.write_text(yaml.safe_dump(config))
    env = dict(_env(INJECTOR), MARLAAS_TEST_TRAINER_FAULTS=json.dumps(faults))
    proc = subprocess.run([sys.executable, "-m", "marlaas_hpc.cli", "run", str(path), "--run-dir", str(run_dir)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    return proc, run_dir


def _trained_once(run_dir: Path, task: dict) -> None:
    """Every version of the task trained exactly once, from B x G samples, none twice (audit.jsonl), and each
    version once in its metrics.jsonl."""
    task_id, group = task["task_id"], task["algo"]["batch_prompts"] * task["algo"]["group_size"]
    rows = [r for r in map(json.loads, (run_dir / "audit.jsonl").read_text().splitlines()) if r["task_id"] == task_id]
    assert collections.Counter(r["trained_into"] for r in rows) == {v: group for v in range(1, STEPS + 1)}, task_id
    assert len({(r["group_id"], r["sample"]) for r in rows}) == len(rows), "no sample trained twice"
    metrics = run_dir / "tasks" / task["tenant"] / task_id / "metrics.jsonl"
    assert [json.loads(line)["version"] for line in metrics.read_text().splitlines()] == list(range(1, STEPS + 1))


def test_an_out_of_memory_error_on_one_rank_mid_step_is_redone_by_the_whole_group(tmp_path):
    faults = [{"position": 1, "call": 3, "error": "oom"}, {"position": 0, "call": 6, "error": "oom"}]
    proc, run_dir = _run(tmp_path, faults)
    output = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, output
    assert proc.stderr.count("[inject]") == 2, output
    summary = json.loads((run_dir / "summary.json").read_text())
    assert {t: s["status"] for t, s in summary["tasks"].items()} == {"add": "done", "sort": "done"}, summary["tasks"]
    for task in yaml.safe_load((run_dir / "job.yaml").read_text())["tasks"]:
        _trained_once(run_dir, task)
    regroups = summary["trainer_groups"]["0"]["regroups"]
    assert [(r["section"], r["kinds"], r["outcome"]) for r in regroups] == [
        ("train", {"0": "peer", "1": "rank"}, "again"), ("train", {"0": "rank", "1": "peer"}, "again")], regroups
    assert all("OutOfMemoryError" in r["failed"][rank] for r in regroups for rank, kind in r["kinds"].items()
               if kind == "rank")
    assert all(r["left_open"] == [] for r in regroups), "every group of the failed step was freed"


def test_the_same_error_on_every_rank_fails_that_task_alone(tmp_path):
    faults = [{"position": "all", "task": "sort", "from_version": 2, "error": "task"}]
    proc, run_dir = _run(tmp_path, faults, mode="sync")
    output = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, output
    summary = json.loads((run_dir / "summary.json").read_text())
    tasks = summary["tasks"]
    assert tasks["sort"]["status"] == "failed", tasks
    assert tasks["sort"]["error"] == "trainer: ValueError: injected: this task's step cannot be trained", tasks
    assert tasks["add"]["status"] == "done", tasks
    add = next(t for t in yaml.safe_load((run_dir / "job.yaml").read_text())["tasks"] if t["task_id"] == "add")
    _trained_once(run_dir, add)
    regroups = summary["trainer_groups"]["0"]["regroups"]
    fused, alone = regroups[0], regroups[-1]
    assert sorted(fused["tasks"]) == ["add", "sort"] and fused["kinds"] == {"0": "task", "1": "task"}, regroups
    assert fused["outcome"] == alone["outcome"] == "task fault" and alone["tasks"] == ["sort"], regroups
