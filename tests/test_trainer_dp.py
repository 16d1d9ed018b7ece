"""Data parallelism inside a trainer group (layout.trainer_dp): a step's rows are split over the DP replicas and
the LoRA gradients all-reduced over the DP group, so DP=2 equals DP=1 -- losses, statistics, gradients and the
weights after the optimizer step -- on CPU with gloo, also with micro-batches and with TP=2 x DP=2."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from support.checks import max_diff
from support.dp_scenarios import run_dp_scenario
from support.trainer_scenarios import TASKS

TOL = 1e-5
SHAPES = {"tp1dp1": (1, 1, 0), "tp1dp2": (1, 2, 40), "tp2dp2": (2, 2, 0)}
"""name -> (TP, DP, micro-batch token budget; 0 = the whole share at once)."""
pytestmark = pytest.mark.slow  # megatron imports in 7 spawned processes


@pytest.fixture(scope="module")
def runs(tiny_model_path):
    from support.local_group import run_local

    with ThreadPoolExecutor(len(SHAPES)) as pool:
        futures = {name: pool.submit(run_local, run_dp_scenario, tp * dp, str(tiny_model_path), tp, dp, micro,
                                     timeout=420)
                   for name, (tp, dp, micro) in SHAPES.items()}
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.parametrize("shape", ["tp1dp2", "tp2dp2"])
def test_dp2_equals_dp1_losses_grads_and_weights(runs, shape):
    one, two = runs["tp1dp1"][0], runs[shape][0]
    assert two["dp_size"] == 2 and one["dp_size"] == 1
    assert len(one["steps"]) == len(two["steps"]) == 3
    for step_one, step_two in zip(one["steps"], two["steps"]):
        assert step_one["metrics"].keys() == step_two["metrics"].keys()
        for task_id, m1 in step_one["metrics"].items():
            m2 = step_two["metrics"][task_id]
            for key in ("loss", "clip_frac", "ratio_mean", "logp_diff_abs", "grad_norm", "tokens", "trajectories"):
                assert abs(m1[key] - m2[key]) < TOL * max(1.0, abs(m1[key])), (task_id, key, m1[key], m2[key])
            assert max_diff(step_one["grads"][task_id], step_two["grads"][task_id]) < TOL
        for task_id in TASKS:  # Adam amplifies 1e-7 gradient differences on near-zero entries (see test_trainer_tp)
            assert max_diff(step_one["tensors"][task_id], step_two["tensors"][task_id]) < 1e-3
    last = one["steps"][1]  # the second step: at the first, B = 0 makes A's gradient 0
    assert all(last["grads"]["a"][k].abs().max() > 0 for k in last["grads"]["a"]), "the gradients are not trivial"
    assert 0 < last["metrics"]["a"]["clip_frac"] < 1 and last["metrics"]["a"]["kl"] > 0
    assert one["versions"] == two["versions"] == {"a": 3, "b": 3, "c": 2}


@pytest.mark.parametrize("shape", ["tp1dp2", "tp2dp2"])
def test_dp_replicas_hold_identical_adapters(runs, shape):
    records = runs[shape]
    by_tp: dict[int, list] = {}
    for record in records:
        by_tp.setdefault(record["tp_rank"], []).append(record)
    for replicas in by_tp.values():
        assert sorted(r["dp_rank"] for r in replicas) == [0, 1]
        first, second = replicas
        for step_first, step_second in zip(first["steps"], second["steps"]):
            for task_id in TASKS:  # the same all-reduced gradients and optimizer state: bit for bit
                assert max_diff(step_first["tensors"][task_id], step_second["tensors"][task_id]) == 0.0
            assert step_first["metrics"] == step_second["metrics"]
