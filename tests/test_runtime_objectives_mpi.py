"""Objectives in the distributed runtime (mpirun, HF engine, tiny model): a DAPO task's env rank reports
uninformative groups, rank 0 drops and replaces them, and every step of it trains B groups with some learning
signal inside the staleness bound, with TIS reading its samples' behaviour versions; a GSPO task beside it, and a
CISPO one with IcePop masking, which reads them the same way."""
import json

import pytest

from support.jobs import run_marlaas

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


def _task(task_id, loss, k, **algo):
    return {"task_id": task_id, "tenant": "t", "total_steps": 5, "max_staleness": k,
            "dataset": {"kind": "addition", "eval_size": 16}, "lora": {"rank": 8, "alpha": 16},
            "algo": {"loss": loss, "group_size": 4, "batch_prompts": 4, "lr": 0.003, "max_new_tokens": 6, **algo}}


def test_dynamic_sampling_and_tis_in_the_runtime(tmp_path):
    config = {"model": "tiny", "engine": "hf", "mode": "async", "rollout_slots": 6,
              "layout": {"env_ranks": 1, "rollout_ranks": 1, "trainer_tp": 1},
              "tasks": [_task("dapo", "dapo", 1, tis_cap=2.0), _task("gspo", "gspo", 0),
                        _task("cispo", "cispo", 1, icepop_band=[0.5, 2.0])]}
    proc, run_dir = run_marlaas(config, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())["tasks"]
    assert {t: s["status"] for t, s in summary.items()} == {"dapo": "done", "gspo": "done", "cispo": "done"}
    assert summary["dapo"]["objective"] == "dapo" and summary["dapo"]["filtered_groups"] > 0  # addition: ~1 in 4
    assert summary["gspo"]["filtered_groups"] == summary["cispo"]["filtered_groups"] == 0
    audit = [json.loads(line) for line in (run_dir / "audit.jsonl").read_text().splitlines()]
    for task_id, bound in (("dapo", 1), ("gspo", 0), ("cispo", 1)):
        rows = [r for r in audit if r["task_id"] == task_id]
        assert all(0 <= r["trained_into"] - 1 - r["behaviour_version"] <= bound for r in rows)
        per_step = {}
        for row in rows:
            per_step.setdefault(row["trained_into"], set()).add(row["group_id"])
        assert {v: len(groups) for v, groups in per_step.items()} == {v: 4 for v in range(1, 6)}
    metrics = [json.loads(line) for line in (run_dir / "tasks/t/dapo/metrics.jsonl").read_text().splitlines()]
    # a trained group with equal rewards (0 or 1) has advantages exactly 0: the trainer skips those rows
    assert [m["skipped_rows"] for m in metrics] == [0.0] * 5
    # TIS: pi_trainer at the behaviour version against the engine's; the window (k+1) B = 8 makes the second
    # batch one version stale, read from the adapter the trainer kept of v-1 (measured ~5e-7 nats per token
    # on every step; a wrong adapter would show the policy's move, ~1e-2)
    assert any(m["staleness_max"] == 1 for m in metrics) and max(m["staleness_max"] for m in metrics) <= 1
    assert all(m["tis_mismatch"] < 1e-4 and m["tis_weight"] == pytest.approx(1.0, abs=1e-3) for m in metrics)
    # IcePop reads pi_trainer(b) as TIS does: the CPU twin's mismatch is far inside its band, nothing is masked
    metrics = [json.loads(line) for line in (run_dir / "tasks/t/cispo/metrics.jsonl").read_text().splitlines()]
    assert any(m["staleness_max"] == 1 for m in metrics)
    # cispo keeps equal-reward groups (no dynamic sampling): a step whose groups all tied trains no token and
    # has no mismatch to report
    trained = [m for m in metrics if m["skipped_rows"] < m["trajectories"]]
    assert trained and all("tis_mismatch" not in m for m in metrics if m not in trained)
    assert all(m["tis_mismatch"] < 1e-4 and m["icepop_masked"] == 0 for m in trained)
