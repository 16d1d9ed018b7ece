"""The LM head in float32 (trainer/lm_head.py) on a checkpoint whose logits have real magnitudes.

Random-weight checkpoints give logits near 0, where bf16 rounding is invisible; a trained model's are 20-40,
where bf16 keeps multiples of 0.125-0.25. `scaled_checkpoint` (tests/support/trainer_scenarios.py) is
random:qwen3-0.6b-mini with every weight rounded to bf16 (as released checkpoints are) and its final norm
scaled so its top logits are 40-50. With bf16 base weights, the trainer's logprobs are checked against a float64
LM head applied to the trainer's own final hidden states (the same bf16 values, the same forward): what remains
is the head's own precision. Before the fix the head rounded the logits to bf16.
"""
from __future__ import annotations

import json

import pytest
import torch

from support.trainer_scenarios import HEAD_MAX_TOL, HEAD_MEAN_TOL, head_inputs, head_precision_scenario, scaled_checkpoint

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return scaled_checkpoint(tmp_path_factory.mktemp("scaled-qwen3"))


@pytest.fixture(scope="module")
def record(checkpoint):
    return head_precision_scenario(0, str(checkpoint), "bfloat16", *head_inputs())


@pytest.mark.parametrize("path", ["logits", "logprobs"])
def test_bf16_trainer_logprobs_are_float32_from_the_hidden_states(checkpoint, record, path):
    """`logits` (probe rows: each next token) and `logprobs` (packed rows in one micro-batch, the path training
    takes) within float32 precision of a float64 head on the same hidden states."""
    from safetensors.torch import load_file

    tensors = load_file(str(checkpoint / "model.safetensors"))  # identical weights for bf16 and the reference
    assert all(torch.equal(v, v.to(torch.bfloat16).float()) for v in tensors.values())
    assert json.loads((checkpoint / "config.json").read_text())["tie_word_embeddings"] is True
    assert float(record["top_logits"].min()) > 20 and float(record["top_logits"].max()) < 100  # real magnitudes
    diff = record[f"{path}_diff"]
    assert record["forwards"] == 1 and len(diff) > 30
    assert float(diff.mean()) < HEAD_MEAN_TOL and float(diff.max()) < HEAD_MAX_TOL, \
        (float(diff.mean()), float(diff.max()))
