"""The served model families (model/families.py) as intake reads them from config.json, the random-weight
checkpoints that stand in for each (model/random_checkpoints.py), and every checkpoint refused by its config key.

No torch model is built here (tests/test_trainer_tp.py runs the trainer on every family's checkpoints)."""
from __future__ import annotations

import json

import pytest

from marlaas_hpc.model.checkpoint import check_checkpoint, read_checkpoint
from marlaas_hpc.model.families import RopeSpec, experts_of, family_of, rope_of
from marlaas_hpc.model.random_checkpoints import SHAPES, ensure_random_checkpoint
from marlaas_hpc.tasks import SpecError
from support.published_configs import QWEN3_30B_A3B

FAMILY_SHAPES = {"qwen3": ("qwen3-0.6b-mini", "qwen3-8b-mini"), "qwen2": ("qwen2.5-0.5b-mini", "qwen2.5-7b-mini"),
                 "llama": ("llama3.2-1b-mini", "llama3.1-8b-mini"), "qwen3_moe": ("qwen3-30b-a3b-mini",)}

LLAMA31_8B_INSTRUCT = {  # config.json of meta-llama/Llama-3.1-8B-Instruct as released (transformers 4.43 format)
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 128256}
QWEN25_7B_INSTRUCT = {  # config.json of Qwen/Qwen2.5-7B-Instruct as released
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
    "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
    "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 152064}


@pytest.mark.parametrize("family, name", [(f, n) for f, names in FAMILY_SHAPES.items() for n in names])
def test_random_checkpoints_have_their_familys_traits(family, name):
    from safetensors import safe_open

    path = ensure_random_checkpoint(name)
    config = json.loads((path / "config.json").read_text())
    assert family_of(config).name == family == config["model_type"]
    assert config["vocab_size"] == (128256 if family == "llama" else 151936)
    assert config["tie_word_embeddings"] is SHAPES[name].shape.tied
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # GQA
    with safe_open(str(path / "model.safetensors"), "pt") as weights:
        names = set(weights.keys())
        norm = weights.get_tensor("model.layers.0.input_layernorm.weight")
        bias = weights.get_tensor("model.layers.0.self_attn.k_proj.bias") if family == "qwen2" else None
    assert ("lm_head.weight" in names) is not SHAPES[name].shape.tied
    assert ("model.layers.0.self_attn.q_norm.weight" in names) is family.startswith("qwen3")
    experts = {n for n in names if ".mlp.experts." in n}
    assert len(experts) == (3 * 8 * 2 if family == "qwen3_moe" else 0)  # per expert, as transformers saves them
    assert ("model.layers.1.mlp.experts.7.down_proj.weight" in names) is (family == "qwen3_moe")
    assert {f"model.layers.0.self_attn.{p}_proj.bias" for p in "qkv"} <= names if family == "qwen2" else \
        not any(n.endswith(".bias") for n in names)
    assert norm.std() > 0.05 and (bias is None or bias.std() > 0.2)  # not the constant init: a swap would show
    rope = rope_of(config)
    assert rope == (RopeSpec(500000.0, "llama3", SHAPES[name].rope_llama3_factor) if family == "llama"
                    else RopeSpec(1_000_000.0))
    if family == "qwen3_moe":
        assert (config["num_local_experts"], config["num_experts_per_tok"], config["norm_topk_prob"]) == (8, 2, True)
        assert experts_of(config).expert_layers == (True, True)
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == ([128001, 128008, 128009] if family == "llama" else [151645, 151643])
    # vLLM's CPU backend serves the dense families; an MoE runs on its GPU path or the `hf` engine
    check_checkpoint(read_checkpoint(path), trainer_tp=2, vllm_on_cpu=family != "qwen3_moe")


@pytest.mark.parametrize("released, family, rope", [
    (LLAMA31_8B_INSTRUCT, "llama", RopeSpec(500000.0, "llama3", 8.0)),
    (QWEN25_7B_INSTRUCT, "qwen2", RopeSpec(1000000.0)),
])
def test_released_config_files_are_served(tmp_path, released, family, rope):
    """Released checkpoints keep rope_theta / rope_scaling at the top level (transformers 4 format)."""
    assert family_of(released).name == family and rope_of(released) == rope
    (tmp_path / "config.json").write_text(json.dumps(released))
    (tmp_path / "tokenizer.json").write_text("{}")
    info = read_checkpoint(tmp_path)
    assert info.shape.head_dim == 128 and info.shape.num_kv_heads in (8, 4)
    check_checkpoint(info, trainer_tp=4 if family == "llama" else 2, vllm_on_cpu=True)


def test_released_qwen3_moe_config_is_served(tmp_path):
    """Qwen3-30B-A3B's config.json as published (num_experts, rope_theta) and as transformers 5 writes it
    (num_local_experts, rope_parameters) read the same; dense layers are read from either key."""
    from marlaas_hpc.model.shape import ModelShape

    assert family_of(QWEN3_30B_A3B).name == "qwen3_moe" and rope_of(QWEN3_30B_A3B) == RopeSpec(1_000_000.0)
    written = {k: v for k, v in QWEN3_30B_A3B.items() if k not in ("num_experts", "rope_theta", "rope_scaling")}
    written.update(num_local_experts=128, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
    shape = ModelShape.from_config(QWEN3_30B_A3B)
    assert shape == ModelShape.from_config(written)
    assert (shape.num_experts, shape.experts_per_token, shape.expert_intermediate_size) == (128, 8, 768)
    assert shape.norm_topk_prob and shape.dense_layers == () and not shape.tied
    assert 30.0e9 < shape.parameters() < 30.7e9  # "30.5B in total"
    assert ModelShape.from_config({**QWEN3_30B_A3B, "mlp_only_layers": [0, 5]}).dense_layers == (0, 5)
    assert experts_of({**QWEN3_30B_A3B, "decoder_sparse_step": 2}).expert_layers[:4] == (False, True, False, True)
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    (tmp_path / "tokenizer.json").write_text("{}")
    check_checkpoint(read_checkpoint(tmp_path), trainer_tp=4)
    with pytest.raises(SpecError, match="model: .* a mixture-of-experts model .128 experts. is not served by vLLM on CPU"):
        check_checkpoint(read_checkpoint(tmp_path), trainer_tp=4, vllm_on_cpu=True)


@pytest.mark.parametrize("base, change, key, reason", [
    ("qwen3", {"model_type": "qwen3_moe", "num_experts": 128}, "num_experts_per_tok", "must be 1..num_experts=128"),
    ("qwen3", {"model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2}, "moe_intermediate_size",
     "must be > 0"),
    ("qwen3", {"model_type": "qwen3_moe"}, "num_experts", "needs its experts"),
    ("qwen3", {**QWEN3_30B_A3B, "decoder_sparse_step": 0}, "decoder_sparse_step", "must be >= 1"),
    ("qwen3", {**QWEN3_30B_A3B, "shared_expert_intermediate_size": 512}, "shared_expert_intermediate_size",
     "shared experts"),
    ("qwen2", {"model_type": "qwen2_moe"}, "model_type", "mixture-of-experts"),
    ("llama", {"model_type": "mixtral", "num_local_experts": 8}, "model_type", "mixture-of-experts"),
    ("llama", {"model_type": "deepseek_v3", "n_routed_experts": 256}, "model_type", "mixture-of-experts"),
    ("qwen2", {"num_experts": 60}, "num_experts", "mixture-of-experts"),
    ("llama", {"model_type": "gemma2"}, "model_type", "not a served family"),
    ("llama", {"hidden_act": "gelu_pytorch_tanh"}, "hidden_act", "SwiGLU"),
    ("llama", {"attention_bias": True}, "attention_bias", "Qwen2's q/k/v"),
    ("llama", {"mlp_bias": True}, "mlp_bias", "Qwen2's q/k/v"),
    ("qwen2", {"use_sliding_window": True}, "use_sliding_window", "sliding-window"),
    ("qwen3", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types", "sliding_attention"),
    ("qwen2", {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
     "rope_scaling", "'yarn' is not served"),
    ("qwen3", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e6}}, "rope_scaling",
     "'llama3' is not served for qwen3"),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 4096}},
     "rope_scaling.original_max_position_embeddings", "fixes it at 8192"),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling", "'linear' is not served"),
    ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor", "part of each head"),
    ("qwen2", {"head_dim": 64}, "head_dim", "hidden_size / num_attention_heads = 128"),
])
def test_checkpoints_outside_the_families_are_refused_naming_the_config_key(tmp_path, base, change, key, reason):
    config = {**(LLAMA31_8B_INSTRUCT if base == "llama" else QWEN25_7B_INSTRUCT), **change}
    if base == "qwen3":
        config = {**QWEN25_7B_INSTRUCT, "model_type": "qwen3", "head_dim": 128, **change}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(SpecError) as info:
        check_checkpoint(read_checkpoint(tmp_path), trainer_tp=1)
    assert info.value.field == "model"
    assert f"config.json {key}:" in info.value.reason and reason in info.value.reason, info.value.reason


def test_qwen3_moe_default_lora_targets_include_the_experts():
    """An MoE task's default targets are the seven names, gate/up/down_proj meaning every expert's; attention
    only stays a task's choice."""
    from marlaas_hpc.model.families import ATTENTION_PROJECTIONS, DECODER_PROJECTIONS, FAMILIES
    from marlaas_hpc.tasks.spec import LoraSpec

    assert FAMILIES["qwen3_moe"].lora_targets == DECODER_PROJECTIONS == LoraSpec().target_modules
    assert set(ATTENTION_PROJECTIONS) < set(FAMILIES["qwen3_moe"].lora_targets)
