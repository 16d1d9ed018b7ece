"""The project's small chat model (model/chat_mini.py) ships with the package: its weights are the current recipe's,
a fresh cache is built from them bit for bit without pre-training, the result is a Qwen3 checkpoint every part of
the job serves (tied embeddings, 151,936 rows, the eos list), and it starts well above 0 with room to learn. The
pre-training's compact softmax equals the full vocabulary's."""
from __future__ import annotations

import json
import random

import pytest
import torch

from marlaas_hpc.model.chat_mini import (META, SHIPPED_DIR, ChatMiniConfig, CompactLM, checkpoint_accuracy,
                                        ensure_chat_mini, live_ids, shipped_fingerprint)
from marlaas_hpc.model.codec import TextCodec
from marlaas_hpc.model.vocabularies import ENDOFTEXT_ID, IM_END_ID, QWEN3
from marlaas_hpc.tasks.gsm8k import one_step_gsm8k
from support.chat_mini_losses import full_vocabulary_rows_and_loss


@pytest.fixture(scope="module")
def chat_mini(tmp_path_factory):
    lines = []
    path = ensure_chat_mini(cache_dir=tmp_path_factory.mktemp("cache"), log=lines.append)
    return path, lines


def test_the_shipped_weights_are_the_current_recipes():
    assert shipped_fingerprint() == ChatMiniConfig().fingerprint(), (
        "the chat model's recipe changed (ChatMiniConfig, chat_mini.PRETRAINING, model/vocabularies.py, the "
        "one-step problems or the GSM8K wording, TextCodec's prompt encoding): renew the shipped weights with "
        "`python tools/build_chat_mini.py --ship` and commit them")


def test_a_fresh_cache_is_built_from_the_shipped_weights_bit_for_bit(chat_mini, tmp_path):
    path, lines = chat_mini
    assert lines == [f"[chat-mini] {path}: from the weights shipped with the package"], "no pre-training ran"
    again = ensure_chat_mini(cache_dir=tmp_path, log=lambda line: None)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "generation_config.json"):
        assert (again / name).read_bytes() == (path / name).read_bytes(), name
    assert ensure_chat_mini(cache_dir=tmp_path, log=lines.append) == again and len(lines) == 1  # cached now


def test_the_checkpoint_is_a_served_qwen3_with_real_traits(chat_mini):
    from safetensors import safe_open

    from marlaas_hpc.model.checkpoint import check_checkpoint, read_checkpoint

    path, _ = chat_mini
    config = json.loads((path / "config.json").read_text())
    assert (config["model_type"], config["vocab_size"], config["tie_word_embeddings"]) == ("qwen3", 151936, True)
    check_checkpoint(read_checkpoint(path), trainer_tp=2, vllm_on_cpu=True)
    from marlaas_hpc.tasks.spec import SpecError

    with pytest.raises(SpecError, match="layout.trainer_ep: is 2, but .* has no experts"):
        check_checkpoint(read_checkpoint(path), trainer_tp=1, trainer_ep=2)
    codec = TextCodec.from_pretrained(path)
    assert codec.stop_ids == [IM_END_ID, ENDOFTEXT_ID] and codec.tokenizer.chat_template
    with safe_open(str(path / "model.safetensors"), "pt") as weights:
        embed = weights.get_tensor("model.embed_tokens.weight")
        assert "lm_head.weight" not in weights.keys()
    live = torch.zeros(embed.shape[0], dtype=torch.bool)
    live[live_ids()] = True
    assert embed[~live].abs().max() == 0 and embed[live].abs().amin(dim=1).gt(0).float().mean() > 0.9


@pytest.mark.slow  # ~45 s: greedy decoding by full recompute over 151,936-way logits
def test_it_starts_well_above_zero_with_room_to_learn(chat_mini):
    path, _ = chat_mini
    recorded = json.loads((SHIPPED_DIR / META).read_text())["eval_accuracy"]
    assert all(0.2 <= value <= 0.7 for value in recorded.values()), recorded
    assert checkpoint_accuracy(path, ChatMiniConfig().eval_size) == recorded  # the full checkpoint, as shipped


def test_one_step_problems_and_their_carry_mistake():
    rng = random.Random(0)
    for _ in range(200):
        question, answer, meta = one_step_gsm8k(rng)
        a, b = meta["terms"]
        assert str(a) in question and int(answer) == a + b and meta["solution"].endswith(f"#### {a + b}")
        assert (meta["mistake"] == answer) == (a + b < 10)


def test_the_compact_softmax_equals_the_full_vocabularys():
    """CompactLM's loss (live rows, plus log(zero rows) in the normaliser) = transformers' cross-entropy over all
    151,936 rows of the same model with the other rows zero."""
    from transformers import Qwen3ForCausalLM

    from marlaas_hpc.model.chat_mini import qwen3_config

    cfg = ChatMiniConfig(num_layers=1)
    torch.manual_seed(0)
    lm = CompactLM(cfg, QWEN3.rows)
    full = Qwen3ForCausalLM(qwen3_config(cfg, QWEN3.rows)).float().eval()
    rows, reference = full_vocabulary_rows_and_loss(lm, full)
    with torch.no_grad():
        compact = lm.loss(rows)
    assert abs(float(compact) - float(reference)) < 1e-4, (float(compact), float(reference))
