"""The relay tier as the running job's delta plane (`delta.transport: relay`, runtime/relay_plane.py; issue #29
item 1), whole local jobs under mpirun (HF engine, tiny model, CPU, gloo links):

- a job of a multi-turn tool task (episodes wait on a slow tool while newer versions land) and a single-turn task,
  over a chain of 2 relays (2 rollout ranks), finishes every task with the audit exact: every sample trained once,
  into each version once, within its task's staleness bound; each leader pushed every version once; each rollout
  rank installed versions from its relay only (newest first, never older);
- every group's version was still held by its rank's relay when the group completed, including groups whose
  version had been superseded meanwhile (so without the group's pin the relay would have evicted it);
- a sync job of one task gives bit-identical adapters at every version, and the same rewards and losses, under
  relays as under the broadcast (the rollouts at each version sampled the same tokens with the same logprobs, or
  the next version would differ). One task: with two, which task's version lands first between two engine steps
  decides an engine batch's make-up, and the HF engine's float rounding with it, in either transport. The task's
  evals reach the rank at timing-dependent moments too: the HF engine decodes them apart from training rows
  (rollout/hf_engine.py `step`), and a step's groups reach the trainer in sampling order (scheduler `_train`);
  before both, a loaded CI machine gave adapters differing in their last bits from v0001 on.
"""
import json
from collections import Counter

import pytest

from support.configs import tool_and_addition_job
from support.jobs import finished_run, run_marlaas

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

STEPS = 6


@pytest.fixture(scope="module")
def relay_run(tmp_path_factory, tiny_model_path):
    config = tool_and_addition_job(STEPS, rollout_ranks=2, fault={"on_rank_loss": "stop"},
                                   delta={"transport": "relay"})
    return finished_run(tmp_path_factory, "relay_job", config)


def test_a_relay_job_finishes_every_task_with_the_audit_exact(relay_run):
    run_dir, timeline = relay_run
    summary = json.loads((run_dir / "summary.json").read_text())
    tasks = summary["tasks"]
    assert {t: (s["status"], s["steps_done"]) for t, s in tasks.items()} == {"lookup": ("done", STEPS),
                                                                            "add": ("done", STEPS)}
    audit = [json.loads(line) for line in (run_dir / "audit.jsonl").read_text().splitlines()]
    for task_id, bound in (("lookup", 1), ("add", 0)):
        rows = [r for r in audit if r["task_id"] == task_id]
        assert len(rows) == tasks[task_id]["trained_samples"] == STEPS * 2 * 4  # steps x B x G
        assert len({(r["group_id"], r["sample"]) for r in rows}) == len(rows), "a sample trained twice"
        per_version = Counter(r["trained_into"] for r in rows)
        assert per_version == {v: 2 * 4 for v in range(1, STEPS + 1)}, per_version  # each version once, whole
        for row in rows:
            assert row["trained_into"] - 1 - bound <= row["behaviour_version"] <= row["trained_into"] - 1, row
    # one leader, every version pushed once: v0 of each task at admission, then one per step
    (group,) = summary["trainer_groups"].values()
    assert group["delta"]["sent"] == 2 * (STEPS + 1)
    assert group["delta"]["blocked_s"] > 0 and group["delta"]["flush_s"] >= 0
    rollout_ranks = [rank for rank, records in timeline.items() if any(r["stage"] == "group" for r in records)]
    assert len(rollout_ranks) == 2, "both rollout ranks (the chain's two relays) generated"
    for rank in rollout_ranks:
        for task_id in ("lookup", "add"):
            installed = [r["version"] for r in timeline[rank] if r["stage"] == "load_delta"
                         and r["tasks"] == [task_id]]
            assert installed == sorted(set(installed)) and installed[-1] == STEPS, (rank, task_id, installed)


def test_a_group_s_version_stays_at_its_relay_until_the_group_completes(relay_run):
    _, timeline = relay_run
    groups = [r for records in timeline.values() for r in records if r["stage"] == "group" and "relay_held" in r]
    training = [g for g in groups if not g["eval"]]
    assert len(training) >= 2 * STEPS * 2, "every training group pinned its version at its relay"
    assert all(g["relay_held"] for g in groups), [g for g in groups if not g["relay_held"]][:3]
    superseded = [g for g in groups if g["superseded"]]
    print(f"\n[relay] {len(groups)} groups pinned their version, {len(superseded)} completed after a newer one "
          "was installed")
    assert superseded, "no group outlived its version's successor: the pins were not exercised"


def _sync_job(transport: str):
    return {
        "model": "tiny", "engine": "hf", "mode": "sync", "rollout_slots": 4,
        "layout": {"env_ranks": 1, "rollout_ranks": 1, "trainer_tp": 1},
        "fault": {"on_rank_loss": "stop"}, "adapters": {"keep_every": 1},
        "delta": {"transport": transport},
        "tasks": [{"task_id": "sort", "tenant": "bob", "dataset": {"kind": "sort", "eval_size": 16},
                   "lora": {"rank": 4, "alpha": 8}, "total_steps": 4, "max_staleness": 1,
                   "algo": {"group_size": 4, "batch_prompts": 4, "lr": 0.003, "max_new_tokens": 7}}]}


def test_relay_and_broadcast_give_the_same_adapter_bytes_and_rollouts_at_every_version(tmp_path, tiny_model_path):
    outputs = {}
    for transport in ("broadcast", "relay"):
        (tmp_path / transport).mkdir()
        proc, run_dir = run_marlaas(_sync_job(transport), tmp_path / transport, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        folder = run_dir / "tasks" / "bob" / "sort"
        adapters = {p.parent.name: p.read_bytes() for p in sorted(folder.glob("adapters/v*/adapter_model.safetensors"))}
        metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        outputs[transport] = adapters, [(m["version"], m["reward_mean"], m["loss"], m["logp_diff_abs"],
                                         m["ratio_mean"]) for m in metrics]
    (broadcast_adapters, broadcast_metrics), (relay_adapters, relay_metrics) = outputs["broadcast"], outputs["relay"]
    assert sorted(relay_adapters) == [f"v{v:04d}" for v in range(5)]
    assert relay_adapters == broadcast_adapters
    assert relay_metrics == broadcast_metrics and len(relay_metrics) == 4


def test_two_trainer_groups_push_into_one_tree_of_three_relays(tmp_path, tiny_model_path):
    """Two leaders push into the root relay (one upstream link each), which forwards along a tree (fan-out 2) to
    the other two rollout ranks' relays: both tasks finish, each group's leader pushed each of its versions once,
    and every rollout rank installed versions of both tasks from its relay (the final ones reached the ranks)."""
    job = {"model": "tiny", "engine": "hf", "mode": "async", "rollout_slots": 4,
           "layout": {"env_ranks": 1, "rollout_ranks": 3, "trainer_tp": 1, "trainer_groups": 2},
           "fault": {"on_rank_loss": "stop"}, "delta": {"transport": "relay", "relay_fanout": 2},
           "tasks": [{"task_id": task_id, "dataset": {"kind": kind, "eval_size": 8}, "lora": {"rank": 4, "alpha": 8},
                      "total_steps": 3, "max_staleness": 1,
                      "algo": {"group_size": 4, "batch_prompts": 2, "lr": 0.003, "max_new_tokens": 6}}
                     for task_id, kind in (("add", "addition"), ("sort", "sort"))]}
    proc, run_dir = run_marlaas(job, tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert {t: (s["status"], s["steps_done"]) for t, s in summary["tasks"].items()} == {"add": ("done", 3),
                                                                                        "sort": ("done", 3)}
    groups = summary["trainer_groups"]
    assert sorted(len(g["tasks"]) for g in groups.values()) == [1, 1], groups
    assert [g["delta"]["sent"] for g in groups.values()] == [4, 4]  # v0..v3 of its one task
    finals = {}
    for path in (run_dir / "timeline").glob("rank*.jsonl"):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        installed = {(r["tasks"][0], r["version"]) for r in records if r["stage"] == "load_delta"}
        if installed:  # a rollout rank
            finals[path.stem] = installed
    assert len(finals) == 3 and all({t for t, _ in held} == {"add", "sort"} for held in finals.values()), finals
    assert {("add", 3), ("sort", 3)} <= set().union(*finals.values()), finals
