"""Preemption in local mode: SIGUSR2 to `marlaas run` (passed on to mpirun, which forwards it to every rank)
checkpoints every task at a step boundary; `marlaas run --resume RUN_DIR` continues at exactly those versions.
The proof is in the outputs: every version 1..total_steps is trained exactly once (metrics.jsonl and the audit),
the resumed adapter is the checkpointed one, and the staleness bound still holds for every trained sample."""
import collections
import json

import pytest
import yaml

from support.configs import small_config
from support.jobs import marlaas, preempt_after

pytestmark = [pytest.mark.mpi, pytest.mark.slow]
STEPS = 14


def test_usr2_checkpoints_and_resume_trains_every_version_once(tmp_path):
    config = small_config()
    for task in config["tasks"]:
        task["total_steps"] = STEPS
    config["adapters"] = {"keep_every": 1}  # the checkpointed version's adapter is compared after the run
    config_path = tmp_path / "job.yaml"
    config_path.write_text(yaml.safe_dump(config))
    run_dir = tmp_path / "run"

    code, out = preempt_after(config_path, run_dir, steps=3)
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

    refused = marlaas("run", str(config_path), "--run-dir", str(run_dir), timeout=120)
    assert refused.returncode == 2 and "holds a checkpoint" in refused.stderr  # a fresh start would mix jobs

    resumed = marlaas("run", "--resume", run_dir, timeout=600)
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
    proc = marlaas("run", "--resume", str(run_dir), timeout=120)
    assert proc.returncode == 2 and "nothing to resume" in proc.stderr
    proc = marlaas("run", "--resume", str(tmp_path / "nowhere"), timeout=120)
    assert proc.returncode == 2 and "no job.yaml" in proc.stderr
