"""The trainer on CUDA (marker gpu: collected everywhere, skipped without a GPU): the tied Qwen3-0.6B-like
checkpoint loads onto the device before any collective and matches transformers; bf16 base weights keep
logprobs within the stated tolerance of fp32; micro-batches equal one batch; NCCL TP=2 equals TP=1; the bf16
trainer's LM head is float32 (cuBLAS bf16 GEMM with float32 output); FlexAttention (compiled) trains as the
dense path does, with and without activation recompute, without its score memory."""
from __future__ import annotations

import random

import pytest
import torch

from support.trainer_scenarios import (BF16_LOGPROB_MAX_TOL, BF16_LOGPROB_MEAN_TOL, HEAD_MAX_TOL, HEAD_MEAN_TOL, TASKS,
                               attention_kernels_scenario, base_logits, head_inputs, head_precision_scenario,
                               long_trajectories, make_trajectories, memory_variants_scenario, probe_ids,
                               run_scenario, scaled_checkpoint)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
TOL = 1e-4
"""fp32 on GPU vs fp32 transformers on CPU (different reduction orders)."""


@pytest.fixture(scope="module")
def batches():
    from marlaas_hpc.trajectory import assign_advantages

    noise = random.Random(1)
    out = {}
    for index, task_id in enumerate(TASKS):
        trajs = make_trajectories(task_id, seed=200 + index, vocab=151936)
        for traj in trajs:
            traj.behaviour_logprobs = [-11.9 + noise.gauss(0.0, 0.1) if m else 0.0 for m in traj.mask()]
        assign_advantages(trajs)
        out[task_id] = trajs
    return out


def test_gpu_tied_checkpoint_forward_equals_transformers(qwen_path):
    from transformers import AutoModelForCausalLM

    from support.local_group import run_local

    probe = probe_ids(151936)
    hf = AutoModelForCausalLM.from_pretrained(str(qwen_path), dtype=torch.float32).eval()
    with torch.no_grad():
        reference = hf(input_ids=torch.tensor(probe)).logits
    record = run_local(base_logits, 1, str(qwen_path), 1, probe, backend="nccl", timeout=600)[0]
    assert record["base_logits"].is_cuda
    assert float((record["base_logits"].cpu() - reference).abs().max()) <= TOL


def test_gpu_bf16_logprob_parity_and_micro_batches(qwen_path, batches):
    from support.local_group import run_local

    records = run_local(memory_variants_scenario, 1, str(qwen_path), batches, backend="nccl", timeout=600)[0]
    assert records["bf16"]["base_dtype"] == "torch.bfloat16" and records["bf16"]["lora_dtypes"] == ["torch.float32"]
    diffs = torch.tensor([abs(x - y) for t in TASKS
                          for a, b in zip(records["whole"]["logprobs"][t], records["bf16"]["logprobs"][t])
                          for x, y in zip(a, b)])
    assert float(diffs.mean()) < BF16_LOGPROB_MEAN_TOL and float(diffs.max()) < BF16_LOGPROB_MAX_TOL
    for variant in ("micro", "recompute"):
        for task_id in TASKS:
            a, b = records["whole"]["metrics"][task_id]["loss"], records[variant]["metrics"][task_id]["loss"]
            assert abs(a - b) < 1e-4 * max(1.0, abs(a)), (variant, task_id, a, b)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL TP=2 needs two GPUs")
def test_gpu_nccl_tp2_equals_tp1(qwen_path, batches, tmp_path):
    from support.local_group import run_local

    probe = probe_ids(151936)
    one = run_local(run_scenario, 1, str(qwen_path), 1, batches, str(tmp_path), 0, probe, backend="nccl",
                    timeout=900)[0]
    two = run_local(run_scenario, 2, str(qwen_path), 2, batches, str(tmp_path), 40, probe, backend="nccl",
                    timeout=900)[0]
    for step_one, step_two in zip(one["steps"], two["steps"]):
        for task_id in TASKS:
            m1, m2 = step_one["metrics"][task_id], step_two["metrics"][task_id]
            assert abs(m1["loss"] - m2["loss"]) < TOL * max(1.0, abs(m1["loss"]))
            grads_one, grads_two = step_one["grads"][task_id], step_two["grads"][task_id]
            assert max(float((grads_one[k] - grads_two[k]).abs().max()) for k in grads_one) < TOL
    assert float((one["base_logits"].cpu() - two["base_logits"].cpu()).abs().max()) < TOL


def test_gpu_bf16_lm_head_is_float32(tmp_path):
    from support.local_group import run_local

    checkpoint = scaled_checkpoint(tmp_path / "scaled")
    record = run_local(head_precision_scenario, 1, str(checkpoint), "bfloat16", *head_inputs(), backend="nccl",
                       timeout=600)[0]
    assert float(record["top_logits"].min()) > 20
    for path in ("logits", "logprobs"):
        diff = record[f"{path}_diff"]
        assert float(diff.mean()) < HEAD_MEAN_TOL and float(diff.max()) < HEAD_MAX_TOL, \
            (path, float(diff.mean()), float(diff.max()))


LONG_COMPLETION = 2900
"""Rows of 3000 tokens in the memory check: the dense path keeps rows x heads x 3000^2 scores per layer."""


def test_gpu_flex_attention_trains_as_dense_without_score_memory(qwen_path, batches):
    """float32 base weights: the kernels agree to float32 reduction-order noise (1e-4) on logprobs, losses and
    LoRA gradients, with and without activation recompute; a step over 3000-token rows peaks lower on the flex
    path by at least half the dense path's fp32 scores of its layers."""
    from transformers import AutoConfig

    from support.local_group import run_local

    long_batch = long_trajectories("a", LONG_COMPLETION, 151936)
    records = run_local(attention_kernels_scenario, 1, str(qwen_path), batches, long_batch, backend="nccl",
                        timeout=900)[0]
    assert (records["dense"]["kernel"], records["flex"]["kernel"]) == ("dense", "flex")
    dense = records["dense"]
    for name in ("flex", "flex_recompute"):
        other = records[name]
        for task_id in TASKS:
            diffs = [abs(x - y) for a, b in zip(dense["logprobs"][task_id], other["logprobs"][task_id])
                     for x, y in zip(a, b)]
            assert max(diffs) < TOL, (name, task_id, max(diffs))
            a, b = dense["metrics"][task_id]["loss"], other["metrics"][task_id]["loss"]
            assert abs(a - b) < TOL * max(1.0, abs(a)), (name, task_id, a, b)
            grads = dense["grads"][task_id]
            assert max(float((grads[k] - other["grads"][task_id][k]).abs().max()) for k in grads) < TOL
    config = AutoConfig.from_pretrained(str(qwen_path))
    rows, width = 2, LONG_COMPLETION + 100
    scores = config.num_hidden_layers * rows * config.num_attention_heads * width * width * 4
    saved = dense["long_step_peak"] - records["flex"]["long_step_peak"]
    assert saved > scores / 2, (dense["long_step_peak"], records["flex"]["long_step_peak"], scores)
