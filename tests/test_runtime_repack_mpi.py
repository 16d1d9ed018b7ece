"""Repack in the running job (`repack.enabled`, runtime/repack.py; issue #29 item 2), a whole local job under
mpirun (HF engine, tiny model, CPU): two tasks of the heavy-tailed `long_tail` kind on 2 regular rollout ranks
and 1 tail rank. The regular ranks hand their long tails over (cut mid-way, with their pinned versions), the tail
rank continues them, and the job ends with the audit exact: every sample trained once, into each version once,
within its bound; the tail rank generated nothing but what it was handed, under the version it was handed."""
import json
from collections import Counter

import pytest

from support.jobs import finished_run

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

STEPS = 6
BOUNDS = {"a": 1, "b": 2}


def _repack_job():
    algo = {"group_size": 4, "batch_prompts": 4, "lr": 0.003, "max_new_tokens": 96}
    return {
        "model": "tiny", "engine": "hf", "mode": "async", "rollout_slots": 4,
        "layout": {"env_ranks": 1, "rollout_ranks": 3, "trainer_tp": 1},
        "fault": {"on_rank_loss": "stop"},
        "repack": {"enabled": True, "tail_ranks": 1, "min_lengths": 8, "step_tokens": 4},
        "tasks": [{"task_id": task, "tenant": "t", "total_steps": STEPS, "max_staleness": bound,
                   "dataset": {"kind": "long_tail", "eval_size": 4, "seed": i}, "lora": {"rank": 4, "alpha": 8},
                   "algo": algo} for i, (task, bound) in enumerate(BOUNDS.items())]}


@pytest.fixture(scope="module")
def repack_run(tmp_path_factory, tiny_model_path):
    return finished_run(tmp_path_factory, "repack_job", _repack_job())


def test_a_repack_job_hands_tails_over_and_keeps_the_audit_exact(repack_run):
    run_dir, timeline = repack_run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert {t: (s["status"], s["steps_done"]) for t, s in summary["tasks"].items()} == \
        {task: ("done", STEPS) for task in BOUNDS}
    audit = [json.loads(line) for line in (run_dir / "audit.jsonl").read_text().splitlines()]
    for task_id, bound in BOUNDS.items():
        rows = [r for r in audit if r["task_id"] == task_id]
        assert len(rows) == STEPS * 4 * 4  # steps x B x G
        assert len({(r["group_id"], r["sample"]) for r in rows}) == len(rows), "a sample trained twice"
        assert Counter(r["trained_into"] for r in rows) == {v: 16 for v in range(1, STEPS + 1)}
        for row in rows:
            assert row["trained_into"] - 1 - bound <= row["behaviour_version"] <= row["trained_into"] - 1, row

    tail = "rank4"  # world: 0 scheduler, 1 env, 2-4 rollout (4 the tail), 5 trainer
    out = {r["group_id"]: r for rank in ("rank2", "rank3") for r in timeline[rank] if r["stage"] == "repack_out"}
    taken = {r["group_id"]: r for r in timeline[tail] if r["stage"] == "repack_in"}
    assert out, "no rollout rank handed a tail over"
    assert set(out) == set(taken) and all(r["to_rank"] == 4 for r in out.values())
    assert all(taken[g]["version"] == out[g]["version"] and taken[g]["held"] for g in out), taken
    assert all(any(n > 0 for n in r["cut_tokens"]) for r in out.values()), "handed over before any token"
    groups = [r for r in timeline[tail] if r["stage"] == "group"]
    assert {r["group_id"] for r in groups} == set(taken), "the tail rank sampled work it was not handed"
    for record in groups:  # continued under the version it was handed, to the lengths the kind set
        assert record["version"] == taken[record["group_id"]]["version"]
    lengths = {r["group_id"]: r["completion_tokens"] for rank in ("rank2", "rank3") for r in timeline[rank]
               if r["stage"] == "group"}
    assert not set(lengths) & set(taken), "a handed-over group also completed on its source rank"
