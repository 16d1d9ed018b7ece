"""chat-mini-moe, chat-mini's Qwen3-MoE sibling (model/chat_mini.py, one recipe with an architecture field): its
shipped weights are the current recipe's and expand bit for bit into a genuine Qwen3MoeForCausalLM checkpoint
(published per-expert key names, a config.json plain transformers loads), served by the job with a TP=2 trainer;
it starts well above 0 with room to learn; its pre-training loss is the full-vocabulary cross-entropy plus the
routers' balance term; a recipe mixing the two architectures' fields is refused."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from marlaas_hpc.model.chat_mini import (CHAT_MINI_MOE_CONFIG, META, ChatMiniConfig, CompactMoeLM,
                                        checkpoint_accuracy, ensure_chat_mini, qwen3_moe_config,
                                        shipped_fingerprint)
from marlaas_hpc.model.codec import TextCodec
from marlaas_hpc.model.vocabularies import ENDOFTEXT_ID, IM_END_ID, QWEN3
from support.chat_mini_losses import full_vocabulary_rows_and_loss


@pytest.fixture(scope="module")
def chat_mini_moe(tmp_path_factory):
    lines = []
    path = ensure_chat_mini(CHAT_MINI_MOE_CONFIG, cache_dir=tmp_path_factory.mktemp("cache"), log=lines.append)
    return path, lines


def test_the_shipped_weights_are_the_current_recipes():
    assert shipped_fingerprint(CHAT_MINI_MOE_CONFIG) == CHAT_MINI_MOE_CONFIG.fingerprint(), (
        "chat-mini-moe's recipe changed: renew its shipped weights with `python tools/build_chat_mini.py --moe "
        "--ship` and commit them")
    assert CHAT_MINI_MOE_CONFIG.fingerprint() != ChatMiniConfig().fingerprint()
    assert (CHAT_MINI_MOE_CONFIG.shipped_dir / "live_weights.safetensors").stat().st_size < 5e6


def test_a_fresh_cache_is_built_from_the_shipped_weights_bit_for_bit(chat_mini_moe, tmp_path):
    path, lines = chat_mini_moe
    assert path.name.startswith("chat-mini-moe-")
    assert lines == [f"[chat-mini-moe] {path}: from the weights shipped with the package"], "no pre-training ran"
    again = ensure_chat_mini(CHAT_MINI_MOE_CONFIG, cache_dir=tmp_path, log=lambda line: None)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "generation_config.json"):
        assert (again / name).read_bytes() == (path / name).read_bytes(), name


def test_the_checkpoint_is_a_genuine_qwen3_moe_the_job_serves(chat_mini_moe):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, Qwen3MoeForCausalLM

    from marlaas_hpc.model.checkpoint import check_checkpoint, read_checkpoint
    from marlaas_hpc.tasks.spec import SpecError

    path, _ = chat_mini_moe
    config = json.loads((path / "config.json").read_text())
    assert (config["model_type"], config["architectures"], config["vocab_size"]) == \
        ("qwen3_moe", ["Qwen3MoeForCausalLM"], 151936)
    assert (config["num_experts_per_tok"], config["norm_topk_prob"], config["mlp_only_layers"]) == (2, True, [])
    info = read_checkpoint(path)
    check_checkpoint(info, trainer_tp=2, vllm_on_cpu=False)
    assert (info.shape.num_experts, info.shape.experts_per_token) == (8, 2)
    with pytest.raises(SpecError, match="mixture-of-experts"):  # vLLM's CPU backend runs no MoE: engine hf
        check_checkpoint(info, trainer_tp=2, vllm_on_cpu=True)
    check_checkpoint(info, trainer_tp=1, trainer_ep=4)  # layout.trainer_ep: 4 ranks of 2 experts
    with pytest.raises(SpecError, match="layout.trainer_ep: must divide the 8 experts of .*, got 3"):
        check_checkpoint(info, trainer_tp=1, trainer_ep=3)
    codec = TextCodec.from_pretrained(path)
    assert codec.stop_ids == [IM_END_ID, ENDOFTEXT_ID] and codec.tokenizer.chat_template
    with safe_open(str(path / "model.safetensors"), "pt") as weights:
        keys = set(weights.keys())
    assert {f"model.layers.3.mlp.experts.7.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")} <= keys
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)  # warns of no missing key
    assert isinstance(model, Qwen3MoeForCausalLM)
    with torch.no_grad():  # the fused experts transformers loads are the shipped ones, un-fused and fused back
        experts = model.model.layers[3].mlp.experts
        with safe_open(str(path / "model.safetensors"), "pt") as weights:
            gate = weights.get_tensor("model.layers.3.mlp.experts.5.gate_proj.weight")
            down = weights.get_tensor("model.layers.3.mlp.experts.5.down_proj.weight")
        assert torch.equal(experts.gate_up_proj[5][:gate.shape[0]], gate) and torch.equal(experts.down_proj[5], down)


@pytest.mark.slow  # ~10 s: greedy decoding by full recompute over 151,936-way logits
def test_it_starts_well_above_zero_with_room_to_learn(chat_mini_moe):
    path, _ = chat_mini_moe
    recorded = json.loads((CHAT_MINI_MOE_CONFIG.shipped_dir / META).read_text())["eval_accuracy"]
    assert all(0.2 <= value <= 0.7 for value in recorded.values()), recorded
    assert checkpoint_accuracy(path, CHAT_MINI_MOE_CONFIG.eval_size) == recorded


def test_the_moe_pretraining_loss_is_the_full_cross_entropy_plus_the_balance_term():
    from transformers import Qwen3MoeForCausalLM

    cfg = replace(CHAT_MINI_MOE_CONFIG, num_layers=1)
    torch.manual_seed(0)
    lm = CompactMoeLM(cfg, QWEN3.rows)
    full = Qwen3MoeForCausalLM(qwen3_moe_config(cfg, QWEN3.rows)).float().eval()
    rows, reference = full_vocabulary_rows_and_loss(lm, full)
    with torch.no_grad():
        lm.model.eval()  # eval: no balance term
        nll = float(lm.loss(rows))
        lm.model.train()  # no dropout in Qwen3-MoE: train mode only adds the routers' balance term
        balanced = float(lm.loss(rows))
    assert abs(nll - reference) < 1e-4, (nll, reference)
    assert balanced > nll, (balanced, nll)  # the routers' Switch balance loss (positive) is added in training


def test_a_recipe_mixing_the_architectures_fields_is_refused():
    with pytest.raises(ValueError, match="qwen3_moe"):
        ChatMiniConfig(num_experts=8)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        replace(CHAT_MINI_MOE_CONFIG, num_experts_per_tok=9)
    with pytest.raises(ValueError, match="architecture"):
        ChatMiniConfig(architecture="mixtral")
