"""Retention of adapter versions in a whole job (mpirun, HF engine, tiny model): a multi-turn tool task whose
episodes wait on a slow tool while newer versions land, next to a single-turn task, under a tight policy
(keep_last 1, keep_every 4, a pinned version). The run dir ends with exactly the policy's versions, the pins
and the final one; rollout ranks leave no copies; and the timelines show that no version was deleted while a
group sampling with it was still open, on the trainer (its adapters/ dir) or on a rollout rank (its copy)."""
import json

import pytest

from support.configs import tool_and_addition_job
from support.jobs import finished_run

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

STEPS = 6


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_model_path):
    config = tool_and_addition_job(STEPS, rollout_ranks=1, adapters={"keep_last": 1, "keep_every": 4})
    config["tasks"][0]["keep_versions"] = [3]
    return finished_run(tmp_path_factory, "retention", config)


def test_run_dir_keeps_the_policy_the_pins_and_the_final_version(finished):
    run_dir, _ = finished
    summary = json.loads((run_dir / "summary.json").read_text())
    assert {t: (s["status"], s["steps_done"]) for t, s in summary["tasks"].items()} == \
        {"lookup": ("done", STEPS), "add": ("done", STEPS)}
    for tenant, task_id, kept in (("tools", "lookup", [0, 3, 4, 6]), ("plain", "add", [0, 4, 6])):
        folder = run_dir / "tasks" / tenant / task_id / "adapters"
        assert sorted(p.name for p in folder.iterdir()) == [f"v{v:04d}" for v in kept]
        assert all((folder / f"v{v:04d}" / "adapter_model.safetensors").is_file() for v in kept)
    assert not list((run_dir / "rollout").rglob("adapter_model.safetensors")), "rollout ranks keep no copies"
    assert not list((run_dir / "tasks").rglob("*.pt")), "an ended task's checkpoint shards are gone"


def _groups(timeline):
    return [r for records in timeline.values() for r in records if r["stage"] == "group"]


def test_no_version_is_deleted_while_a_group_samples_with_it(finished):
    _, timeline = finished
    groups = _groups(timeline)
    prunes = [r for records in timeline.values() for r in records if r["stage"] == "prune_adapters"]
    assert prunes, "the trainer deleted versions"
    for prune in (p for p in prunes if not p["ended"]):  # once a task ended, its open groups are discarded
        for group in groups:  # sampling: from its start until its last turn was generated (GroupEnded comes later)
            if group["tasks"] == prune["tasks"] and group["start"] <= prune["start"] <= group["sampled_until"]:
                assert group["version"] not in prune["deleted"], (prune, group)
    drops = {rank: [r for r in records if r["stage"] == "drop_adapter"] for rank, records in timeline.items()}
    assert any(drops.values()), "the rollout rank deleted its copies of retired versions"
    for rank, records in drops.items():
        open_groups = [r for r in timeline[rank] if r["stage"] == "group"]
        for drop in records:
            for group in open_groups:
                if group["tasks"] == drop["tasks"] and group["version"] == drop["version"]:
                    assert not group["start"] <= drop["start"] < group["end"], (drop, group)
    # how often a group kept a version past the staleness window and the policy (a slow tool makes it likely,
    # not certain; tests/test_retention.py provokes it deterministically)
    held = [p for p in prunes if p["in_flight"] and min(p["in_flight"]) < p["newest"] - 1]
    print(f"\n[retention] {len(prunes)} prunes, {sum(len(p['deleted']) for p in prunes)} versions deleted; "
          f"{len(held)} prunes held a version back for a group still open")
