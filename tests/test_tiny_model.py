"""The tiny base model ships with the package (marlaas_hpc/tiny_weights): its weights are the current
recipe's, a fresh cache is filled from them without pre-training, and they are a model transformers loads, with
the pre-training's starting accuracies (room for RL on every task)."""
from __future__ import annotations

import json

from marlaas_hpc.tiny_model import SHIPPED_DIR, TinyModelConfig, ensure_tiny_model, shipped_fingerprint


def test_the_shipped_weights_are_the_current_recipes():
    assert shipped_fingerprint() == TinyModelConfig().fingerprint(), (
        "the tiny model's recipe changed (TinyModelConfig, tiny_model.PRETRAINING, model/tokenizer.py, "
        "TextCodec.encode_prompt or LookupTask): renew the shipped weights with `python tools/build_tiny_model.py "
        "--ship` and commit them (a change that cannot alter the weights, a pure refactor, may instead move the "
        "fingerprint in tiny_weights/marlaas_tiny.json: another CPU pre-trains other weights)")


def test_a_fresh_cache_is_filled_from_the_shipped_weights(tmp_path):
    lines = []
    path = ensure_tiny_model(cache_dir=tmp_path, log=lines.append)
    assert lines == [f"[tiny-model] {path}: the weights shipped with the package"], "no pre-training ran"
    assert (path / "model.safetensors").read_bytes() == (SHIPPED_DIR / "model.safetensors").read_bytes()
    assert ensure_tiny_model(cache_dir=tmp_path, log=lines.append) == path and len(lines) == 1  # cached now


def test_the_shipped_model_loads_and_starts_with_room_to_learn():
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(SHIPPED_DIR), dtype=torch.float32)
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA, like Qwen3
    accuracy = json.loads((SHIPPED_DIR / "marlaas_tiny.json").read_text())["eval_accuracy"]
    for task in ("addition", "reverse", "count", "sort"):
        assert 0.05 <= accuracy[task] <= 0.7, (task, accuracy[task])
    assert accuracy["lookup"] < 0.2  # the tool task starts near zero: RL must learn to call the tool
