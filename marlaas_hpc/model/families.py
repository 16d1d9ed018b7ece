"""The model families a job serves, and what each looks like in a checkpoint's config.json.

Each family is one transformers `model_type`, one mbridge bridge (HF names <-> megatron names), one megatron
layer layout and one set of LoRA target modules:

    family     model_type  checkpoints (HF)                     qk-norm  q/k/v bias  RoPE               head_dim
    qwen3      qwen3       Qwen3-0.6B .. 32B (dense)             yes      no          default            config
    qwen3_moe  qwen3_moe   Qwen3-30B-A3B, 235B-A22B (experts)    yes      no          default            config
    qwen2      qwen2       Qwen2 / Qwen2.5 (-Instruct, -Math)    no       yes         default            hidden/heads
    llama      llama       Llama 3, 3.1, 3.2, 3.3                no       no          default or llama3  config

All have SwiGLU MLPs and RMSNorm and no bias anywhere else. The dense families have the same seven projections per
decoder layer (q/k/v/o, gate/up/down), the LoRA targets. Tied input/output embeddings are a per-checkpoint trait
(`tie_word_embeddings`: Qwen2.5 up to 3B, Qwen3 up to 4B, Llama 3.2 1B/3B), as is GQA.

qwen3_moe replaces a layer's MLP by `num_experts` SwiGLU experts of width `moe_intermediate_size`, of which a
softmax router (`mlp.gate`, no bias) picks `num_experts_per_tok` per token, their weights renormalised to sum to 1
when `norm_topk_prob`; a layer listed in `mlp_only_layers`, or off the `decoder_sparse_step`, keeps a dense MLP of
`intermediate_size` (`expert_layers`). Its LoRA targets are the dense families' seven names: q/k/v/o_proj, and
gate/up/down_proj of every expert (not of a dense layer's MLP: trainer/lora.py); attention only is a task's choice
(`lora.target_modules`: ATTENTION_PROJECTIONS). The router takes no adapter.

`family_of(config)` reads a config.json dict (no transformers import) and refuses, naming the config key and the
reason, anything the trainer's bridge and the rollout engine would not reproduce exactly: another model type
(the other mixture-of-experts families included: Mixtral, DeepSeek, Qwen2-MoE...), another activation, RoPE
scaling other than Llama 3's, sliding-window attention, biases outside Qwen2's q/k/v. The trainer
(trainer/model.py) and intake (model/checkpoint.py) use the same check.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from marlaas_hpc.tasks.spec import QWEN3_LORA_TARGETS

DECODER_PROJECTIONS = QWEN3_LORA_TARGETS
"""The seven linear modules of a dense decoder layer (HF names), in the order PEFT files list them."""

LLAMA3_ROPE_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
"""The llama3 RoPE parameters megatron-core 0.16's RotaryEmbedding hard-codes (only `factor` is an argument);
every released Llama 3.1 / 3.2 / 3.3 checkpoint has them (factor 8 or 32)."""

MOE_MODEL_TYPES = ("qwen2_moe", "mixtral", "deepseek_v2", "deepseek_v3", "llama4", "gpt_oss",
                   "olmoe", "glm4_moe")
"""Mixture-of-experts model types outside FAMILIES, named as such in the refusal (any model type outside FAMILIES
is refused anyway)."""

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
"""The attention projections: a task's LoRA on a mixture-of-experts model that leaves the experts alone."""


class UnservedCheckpoint(ValueError):
    """A config.json the job cannot serve: `key` is the config.json key at fault, str() says why."""

    def __init__(self, key: str, reason: str):
        self.key = key
        super().__init__(f"config.json {key}: {reason}")


@dataclass(frozen=True)
class ModelFamily:
    name: str
    """Family name (= its transformers model_type)."""
    qk_norm: bool
    """RMSNorm on each head's queries and keys before RoPE (megatron's qk_layernorm)."""
    qkv_bias: bool
    """q/k/v projections carry biases (megatron's add_qkv_bias); no other linear does."""
    rope_types: tuple[str, ...]
    """RoPE variants the bridge reproduces ('default': plain theta; 'llama3': Llama 3.1's frequency scaling)."""
    head_dim_in_config: bool
    """head_dim is read from config.json (Qwen3, Llama); else it is hidden_size / num_attention_heads, as both
    transformers and vLLM compute it for Qwen2."""
    lora_targets: tuple[str, ...] = DECODER_PROJECTIONS
    """HF module names a task's LoRA may target."""
    experts: bool = False
    """Mixture-of-experts MLPs (qwen3_moe): config.json declares the experts (`experts_of`)."""


FAMILIES = {family.name: family for family in (
    ModelFamily("qwen3", qk_norm=True, qkv_bias=False, rope_types=("default",), head_dim_in_config=True),
    ModelFamily("qwen3_moe", qk_norm=True, qkv_bias=False, rope_types=("default",), head_dim_in_config=True,
                experts=True),
    ModelFamily("qwen2", qk_norm=False, qkv_bias=True, rope_types=("default",), head_dim_in_config=False),
    ModelFamily("llama", qk_norm=False, qkv_bias=False, rope_types=("default", "llama3"), head_dim_in_config=True),
)}


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    """RoPE base."""
    scaling: str = "default"
    """'default' or 'llama3'."""
    factor: float = 1.0
    """llama3 scaling factor (8 for Llama 3.1, 32 for 3.2)."""


def family_of(config: dict[str, Any]) -> ModelFamily:
    """The family of a config.json dict, after every check a served checkpoint must pass (UnservedCheckpoint)."""
    model_type = str(config.get("model_type"))
    if model_type not in FAMILIES:
        why = "a mixture-of-experts model; the trainer's LoRA sites and bridge cover dense MLPs only" \
            if model_type in MOE_MODEL_TYPES or _experts(config) else "not a served family"
        raise UnservedCheckpoint("model_type", f"{model_type!r} is {why} (served: {sorted(FAMILIES)})")
    family = FAMILIES[model_type]
    if family.experts:
        experts_of(config)
    elif _experts(config):
        raise UnservedCheckpoint(_experts(config), f"mixture-of-experts layers are not served in {model_type} "
                                                   f"models (served with experts: qwen3_moe)")
    if config.get("hidden_act", "silu") != "silu":
        raise UnservedCheckpoint("hidden_act", f"{config['hidden_act']!r}; the bridge builds SwiGLU (silu) MLPs")
    for key in ("attention_bias", "mlp_bias"):  # Llama's attention_bias also biases o_proj: no megatron twin
        if config.get(key):
            raise UnservedCheckpoint(key, "true; biases are served only on Qwen2's q/k/v projections")
    _check_attention_span(config)
    if not family.head_dim_in_config and config.get("head_dim") not in (None, _hidden_per_head(config)):
        raise UnservedCheckpoint("head_dim", f"{config['head_dim']} differs from hidden_size / num_attention_heads "
                                             f"= {_hidden_per_head(config)}, which {model_type} models use")
    rope = rope_of(config)
    if rope.scaling not in family.rope_types:
        raise UnservedCheckpoint("rope_scaling", f"rope_type {rope.scaling!r} is not served for {model_type} "
                                                 f"(served: {list(family.rope_types)})")
    return family


@dataclass(frozen=True)
class ExpertsSpec:
    """The mixture-of-experts part of a config.json (qwen3_moe)."""

    num_experts: int
    """Routed experts per MoE layer (`num_experts`; transformers 5 writes `num_local_experts`)."""
    experts_per_token: int
    """Experts each token is routed to (`num_experts_per_tok`)."""
    intermediate_size: int
    """Each expert's SwiGLU width (`moe_intermediate_size`)."""
    norm_topk_prob: bool
    """The top-k routing weights are renormalised to sum to 1 (else: their softmax over all experts)."""
    expert_layers: tuple[bool, ...]
    """Per decoder layer: MoE (True) or a dense MLP of `intermediate_size` (False)."""


def experts_of(config: dict[str, Any]) -> ExpertsSpec:
    """The experts of a qwen3_moe config.json, as transformers builds them (UnservedCheckpoint naming the key)."""
    key = _experts(config)
    if key is None:
        raise UnservedCheckpoint("num_experts", "missing or 0; a qwen3_moe model needs its experts")
    if config.get("shared_expert_intermediate_size"):  # Qwen2-MoE's shared expert: no Qwen3-MoE has one
        raise UnservedCheckpoint("shared_expert_intermediate_size", "shared experts are not served")
    number, per_token = int(config[key]), int(config.get("num_experts_per_tok") or 0)
    if not 0 < per_token <= number:
        raise UnservedCheckpoint("num_experts_per_tok", f"{config.get('num_experts_per_tok')!r}; must be 1.."
                                                        f"{key}={number}")
    width = int(config.get("moe_intermediate_size") or 0)
    if width <= 0:
        raise UnservedCheckpoint("moe_intermediate_size", f"{config.get('moe_intermediate_size')!r}; must be > 0")
    step = int(config.get("decoder_sparse_step", 1) or 0)
    if step <= 0:
        raise UnservedCheckpoint("decoder_sparse_step", f"{config.get('decoder_sparse_step')!r}; must be >= 1")
    dense = set(config.get("mlp_only_layers") or [])
    # transformers' Qwen3MoeDecoderLayer: experts unless the layer is listed or off the sparse step
    layers = tuple(layer not in dense and (layer + 1) % step == 0 for layer in range(int(config.get("num_hidden_layers") or 0)))
    return ExpertsSpec(num_experts=number, experts_per_token=per_token, intermediate_size=width,
                       norm_topk_prob=bool(config.get("norm_topk_prob", False)), expert_layers=layers)


def head_dim_of(config: dict[str, Any]) -> int:
    """Per-head width as the family's models compute it."""
    family = FAMILIES.get(str(config.get("model_type")))
    if family is not None and not family.head_dim_in_config:
        return _hidden_per_head(config)
    return int(config.get("head_dim") or _hidden_per_head(config))


def rope_of(config: dict[str, Any]) -> RopeSpec:
    """RoPE of a config.json: transformers 5 writes `rope_parameters` (theta inside), released checkpoints
    `rope_theta` and `rope_scaling` (null, or {rope_type or type, factor, ...})."""
    params = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or {})
    merged = {**scaling, **params}
    kind = str(merged.get("rope_type", merged.get("type", "default")))
    theta = float(merged.get("rope_theta", config.get("rope_theta", 10000.0)))
    if float(merged.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))) != 1.0:
        raise UnservedCheckpoint("partial_rotary_factor", "RoPE on part of each head is not served")
    if kind != "llama3":
        if kind != "default":
            raise UnservedCheckpoint("rope_scaling", f"rope_type {kind!r} is not served (served: default, llama3)")
        return RopeSpec(theta)
    for key, value in LLAMA3_ROPE_DEFAULTS.items():
        if float(merged.get(key, value)) != value:
            raise UnservedCheckpoint(f"rope_scaling.{key}", f"{merged[key]}; megatron-core's llama3 RoPE fixes it "
                                                            f"at {value} (every released Llama 3.x has that)")
    return RopeSpec(theta, "llama3", float(merged["factor"]))


def _experts(config: dict[str, Any]) -> str | None:
    """The config key that declares experts (num_experts, num_local_experts, n_routed_experts), if any."""
    return next((key for key in ("num_experts", "num_local_experts", "n_routed_experts") if config.get(key)), None)


def _check_attention_span(config: dict[str, Any]) -> None:
    if config.get("use_sliding_window"):
        raise UnservedCheckpoint("use_sliding_window", "sliding-window attention is not served (full causal only)")
    sliding = [kind for kind in config.get("layer_types") or [] if kind != "full_attention"]
    if sliding:
        raise UnservedCheckpoint("layer_types", f"{sorted(set(sliding))} layers are not served (full_attention only)")


def _hidden_per_head(config: dict[str, Any]) -> int:
    heads = int(config.get("num_attention_heads") or 0)
    return int(config.get("hidden_size") or 0) // heads if heads else 0
