"""The trainer on CUDA (marker gpu: collected everywhere, skipped without a GPU): the tied Qwen3-0.6B-like
checkpoint loads onto the device before any collective and matches transformers; bf16 base weights keep
logprobs within the stated tolerance of fp32; micro-batches equal one batch; NCCL TP=2 equals TP=1."""
from __future__ import annotations

import random

import pytest
import torch

from trainer_scenarios import (BF16_LOGPROB_MAX_TOL, BF16_LOGPROB_MEAN_TOL, TASKS, base_logits, make_trajectories,
                               memory_variants_scenario, probe_ids, run_scenario)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
TOL = 1e-4
"""fp32 on GPU vs fp32 transformers on CPU (different reduction orders)."""


@pytest.fixture(scope="module")
def qwen_path():
    from marlaas_hpc.model.random_qwen3 import ensure_random_qwen3

    return ensure_random_qwen3("qwen3-0.6b-mini")


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

    from marlaas_hpc.trainer.launch_local import run_local

    probe = probe_ids(151936)
    hf = AutoModelForCausalLM.from_pretrained(str(qwen_path), dtype=torch.float32).eval()
    with torch.no_grad():
        reference = hf(input_ids=torch.tensor(probe)).logits
    record = run_local(base_logits, 1, str(qwen_path), 1, probe, backend="nccl", timeout=600)[0]
    assert record["base_logits"].is_cuda
    assert float((record["base_logits"].cpu() - reference).abs().max()) <= TOL


def test_gpu_bf16_logprob_parity_and_micro_batches(qwen_path, batches):
    from marlaas_hpc.trainer.launch_local import run_local

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
    from marlaas_hpc.trainer.launch_local import run_local

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
