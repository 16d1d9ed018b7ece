"""Trainer memory and precision settings on the tied Qwen3-0.6B-like checkpoint (CPU twin of the GPU paths):
micro-batches by a token budget with gradient accumulation equal one whole-batch pass, activation recompute and
skipping the frozen weights' gradients change nothing, and bf16 base weights keep LoRA weights, optimizer,
logprobs and loss in float32 within a stated tolerance of the float32 trainer."""
from __future__ import annotations

import random

import pytest
import torch

from support.checks import max_diff
from support.trainer_scenarios import (BF16_LOGPROB_MAX_TOL, BF16_LOGPROB_MEAN_TOL, TASKS, make_trajectories,
                               memory_variants_scenario)

pytestmark = pytest.mark.slow
TOL = 1e-5


@pytest.fixture(scope="module")
def records(qwen_path):
    from marlaas_hpc.trajectory import assign_advantages
    from support.local_group import run_local

    noise = random.Random(1)
    batches = {}
    for index, task_id in enumerate(TASKS):
        trajs = make_trajectories(task_id, seed=200 + index, vocab=151936)
        for traj in trajs:  # behaviour near the random model's ~-12 nats: ratios near 1, some clipped
            traj.behaviour_logprobs = [-11.9 + noise.gauss(0.0, 0.1) if m else 0.0 for m in traj.mask()]
        assign_advantages(trajs)
        batches[task_id] = trajs
    return run_local(memory_variants_scenario, 1, str(qwen_path), batches, timeout=600)[0]


@pytest.mark.parametrize("variant", ["micro", "recompute", "megatron_wgrad"])
def test_micro_batches_and_recompute_equal_one_whole_batch(records, variant):
    """A fused step of three tasks keeps each task's token-mean loss whatever the micro-batching, with or without
    activation recompute; skipping the frozen base weights' gradients (trainer/frozen_base.py) changes no LoRA
    gradient."""
    whole, other = records["whole"], records[variant]
    if variant == "recompute":  # a different path: each training pass runs every layer again in backward
        assert other["layer_forwards"] > records["micro"]["layer_forwards"] > 0
    for task_id in TASKS:
        for key in ("loss", "clip_frac", "ratio_mean", "grad_norm", "tokens"):
            a, b = whole["metrics"][task_id][key], other["metrics"][task_id][key]
            assert abs(a - b) < TOL * max(1.0, abs(a)), (variant, task_id, key, a, b)
        assert max_diff(whole["grads"][task_id], other["grads"][task_id]) < TOL
    assert all(whole["grads"]["a"][k].abs().max() > 0 for k in whole["grads"]["a"] if "lora_B" in k)


def test_bf16_base_keeps_lora_and_logprobs_float32_within_tolerance(records):
    fp32, bf16 = records["whole"], records["bf16"]
    assert (fp32["base_dtype"], bf16["base_dtype"]) == ("torch.float32", "torch.bfloat16")
    assert bf16["lora_dtypes"] == ["torch.float32"]
    diffs = torch.tensor([abs(x - y) for t in TASKS for a, b in zip(fp32["logprobs"][t], bf16["logprobs"][t])
                          for x, y in zip(a, b)])
    assert float(diffs.mean()) < BF16_LOGPROB_MEAN_TOL and float(diffs.max()) < BF16_LOGPROB_MAX_TOL, \
        (float(diffs.mean()), float(diffs.max()))
    for task_id in TASKS:
        assert abs(fp32["metrics"][task_id]["loss"] - bf16["metrics"][task_id]["loss"]) < 0.01  # measured 2e-4
