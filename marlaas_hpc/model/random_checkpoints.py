"""Random-weight checkpoints with the traits of real Qwen3 (dense and MoE), Qwen2.5 and Llama 3.x models, built
locally (nothing is downloaded).

The project's tiny model has a 128-char vocabulary and untied embeddings; real checkpoints differ in every way
that breaks code written only for it. These checkpoints keep each family's real traits and shrink the rest:

- the family's vocabulary (model/vocabularies.py): 151,936 rows for Qwen (more rows than tokenizer tokens),
  128,256 for Llama 3, which no TP size above 1 divides into megatron's 128-row multiples: the trainer pads it;
  special tokens at the real ids, bos (Llama) or none (Qwen), an eos list in generation_config.json with
  sampling defaults the rollout engines must ignore, the family's chat template;
- tied input/output embeddings (Qwen3-0.6B..4B, Qwen2.5-0.5B..3B, Llama 3.2 1B/3B) or untied ones (Qwen3-8B,
  Qwen2.5-7B, Llama 3.1 8B and up);
- grouped-query attention; Qwen3's qk-norm and head_dim decoupled from hidden_size / heads; Qwen2's q/k/v
  biases; Llama 3's `llama3` RoPE scaling (factor 32 for 3.2, 8 for 3.1) and rope_theta 500,000;
- Qwen3-MoE's experts (Qwen3-30B-A3B: every layer routed, top-k weights renormalised, untied), saved per expert
  (`mlp.experts.N.gate_proj.weight`, router `mlp.gate.weight`) as transformers 5 writes them.

Weights are random (transformers' init), and then every RMSNorm weight and bias is drawn away from its
constant init (1 and 0): a checkpoint whose norms are all ones and biases all zeros cannot tell a mis-mapped
norm or bias from a right one. Router weights are drawn wider than the init (`ROUTER_STD`): with transformers'
0.02 every token's expert logits nearly tie, and a last-bit difference between two implementations would pick
other experts, where a trained router's choices have margins.

Shapes: `qwen3-0.6b` is the full Qwen3-0.6B shape (28 layers: benchmarks only); `qwen3-8b` the full Qwen3-8B
shape (its published dims), for `marlaas plan` and the GPU dry run, which read config.json only (`write_config`;
its random weights would take 33 GB); the `-mini` shapes keep
vocabulary, GQA, head_dim >= 32 and the family's traits at a width and depth that tests afford on two CPU cores.
Jobs name them `model: random:<shape>` (built once into the cache, like `tiny`); weights are random, so they
test plumbing and numerics, not learning.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from marlaas_hpc.model.families import FAMILIES
from marlaas_hpc.model.shape import ModelShape
from marlaas_hpc.model.vocabularies import (ENDOFTEXT_ID, IM_END_ID, IM_START_ID, LLAMA3, QWEN2, QWEN3,
                                            Vocabulary, save_tokenizer)

__all__ = ["ENDOFTEXT_ID", "IM_END_ID", "IM_START_ID", "RANDOM_PREFIX", "SHAPES", "RandomModel",
           "ensure_random_checkpoint", "write_config"]

RANDOM_PREFIX = "random:"
"""`JobConfig.model` prefix naming one of SHAPES, e.g. 'random:qwen3-0.6b-mini'."""
FAMILY_VOCABULARY = {"qwen3": QWEN3, "qwen3_moe": QWEN3, "qwen2": QWEN2, "llama": LLAMA3}
ROUTER_STD = 0.3
"""Std of the random router weights: logits of std ~0.3 * sqrt(hidden) (3.4 at width 128) over normed inputs."""


@dataclass(frozen=True, kw_only=True)
class RandomModel:
    """A random-weight checkpoint's recipe: a family, its shape and its RoPE."""

    family: str
    """Model family (model/families.py): 'qwen3', 'qwen3_moe', 'qwen2' or 'llama'."""
    shape: ModelShape
    """Widths, depth, heads (Qwen3 decouples head_dim from hidden_size / num_heads; Qwen2 and Llama do not),
    the family's vocabulary rows, tied or untied embeddings, context length and the family's qk-norm / biases."""
    rope_theta: float
    """RoPE base."""
    rope_llama3_factor: float | None = None
    """Llama 3.x RoPE scaling factor (32: 3.2, 8: 3.1; low/high frequency factors 1 and 4 over 8,192 original
    positions, as released); None: plain RoPE."""

    @property
    def vocabulary(self) -> Vocabulary:
        return FAMILY_VOCABULARY[self.family]


def _model(family: str, rope_theta: float, rope_llama3_factor: float | None = None, **shape) -> RandomModel:
    """The family's vocabulary rows and traits in the shape."""
    traits = FAMILIES[family]
    return RandomModel(family=family, rope_theta=rope_theta, rope_llama3_factor=rope_llama3_factor,
                       shape=ModelShape(vocab_size=FAMILY_VOCABULARY[family].rows, qk_norm=traits.qk_norm,
                                        qkv_bias=traits.qkv_bias, **shape))


def _qwen3(**kw) -> RandomModel:
    return _model("qwen3", rope_theta=1_000_000.0, **kw)


def _qwen3_moe(**kw) -> RandomModel:
    return _model("qwen3_moe", rope_theta=1_000_000.0, **kw)


def _qwen2(**kw) -> RandomModel:
    return _model("qwen2", rope_theta=1_000_000.0, max_position_embeddings=32768, **kw)


def _llama(**kw) -> RandomModel:
    return _model("llama", rope_theta=500_000.0, max_position_embeddings=131072, **kw)


SHAPES = {
    "qwen3-0.6b": _qwen3(hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                         intermediate_size=3072, tied=True, max_position_embeddings=40960),
    "qwen3-8b": _qwen3(hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                       intermediate_size=12288, tied=False, max_position_embeddings=40960),
    "qwen3-0.6b-mini": _qwen3(hidden_size=128, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=64,
                              intermediate_size=256, tied=True, max_position_embeddings=4096),
    "qwen3-8b-mini": _qwen3(hidden_size=128, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=64,
                            intermediate_size=320, tied=False, max_position_embeddings=4096),
    # Qwen3-30B-A3B's traits (128 experts of 768, top 8 renormalised, every layer routed, untied) in small
    "qwen3-30b-a3b-mini": _qwen3_moe(hidden_size=128, num_layers=2, num_heads=8, num_kv_heads=4, head_dim=64,
                                     intermediate_size=256, tied=False, max_position_embeddings=4096,
                                     num_experts=8, experts_per_token=2, expert_intermediate_size=64,
                                     norm_topk_prob=True),
    "qwen2.5-0.5b-mini": _qwen2(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                                intermediate_size=256, tied=True),
    "qwen2.5-7b-mini": _qwen2(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                              intermediate_size=320, tied=False),
    "llama3.2-1b-mini": _llama(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                               intermediate_size=256, tied=True, rope_llama3_factor=32.0),
    "llama3.1-8b-mini": _llama(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                               intermediate_size=320, tied=False, rope_llama3_factor=8.0),
}


def hf_config(model: RandomModel):
    """The transformers config of a random model, with the family's real ids and traits."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    vocab, shape = model.vocabulary, model.shape
    common = dict(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
                  num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
                  num_key_value_heads=shape.num_kv_heads, max_position_embeddings=shape.max_position_embeddings,
                  tie_word_embeddings=shape.tied, hidden_act="silu", initializer_range=0.02, dtype="float32")
    eos = [vocab.token_id(t) for t in vocab.generation_eos]
    if model.family == "llama":
        assert shape.head_dim * shape.num_heads == shape.hidden_size
        rope = {"rope_type": "default", "rope_theta": model.rope_theta}
        if model.rope_llama3_factor is not None:
            rope = {"rope_type": "llama3", "factor": model.rope_llama3_factor, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192, "rope_theta": model.rope_theta}
        return LlamaConfig(**common, head_dim=shape.head_dim, rope_parameters=rope, rms_norm_eps=1e-5,
                           attention_bias=False, mlp_bias=False, bos_token_id=vocab.token_id(vocab.bos),
                           eos_token_id=eos, pad_token_id=None)
    qwen = dict(rope_parameters={"rope_type": "default", "rope_theta": model.rope_theta}, rms_norm_eps=1e-6,
                bos_token_id=ENDOFTEXT_ID, eos_token_id=IM_END_ID, pad_token_id=None, use_sliding_window=False)
    if model.family == "qwen2":
        assert shape.head_dim * shape.num_heads == shape.hidden_size
        return Qwen2Config(**common, **qwen)
    if model.family == "qwen3_moe":
        return Qwen3MoeConfig(**common, **qwen, head_dim=shape.head_dim, attention_bias=False,
                              num_experts=shape.num_experts, num_experts_per_tok=shape.experts_per_token,
                              moe_intermediate_size=shape.expert_intermediate_size,
                              norm_topk_prob=shape.norm_topk_prob, decoder_sparse_step=1,
                              mlp_only_layers=list(shape.dense_layers))
    return Qwen3Config(**common, **qwen, head_dim=shape.head_dim, attention_bias=False)


def write_config(name: str, cache_dir: str | Path | None = None) -> Path:
    """A directory holding only config.json of shape `name` (a key of SHAPES): what `marlaas plan` and the GPU
    dry run read. Written once into the cache."""
    from marlaas_hpc.model.cache import default_cache_dir

    model = SHAPES[name]
    out = Path(cache_dir or default_cache_dir()) / f"config-{name}-{fingerprint(model, 0)}"
    if not (out / "config.json").is_file():
        staging = out.with_name(f"{out.name}.writing-{os.getpid()}")
        hf_config(model).save_pretrained(str(staging))
        try:
            staging.rename(out)
        except OSError:  # another process wrote it first
            shutil.rmtree(staging, ignore_errors=True)
    return out


def build_random_checkpoint(out_dir: str | Path, recipe: RandomModel, seed: int = 0) -> Path:
    """Writes config.json, model.safetensors (fp32, random), generation_config.json and the tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(recipe)).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.1)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.5)
            elif name.endswith("mlp.gate.weight"):  # a router (qwen3_moe)
                param.normal_(0.0, ROUTER_STD)
    vocab = recipe.vocabulary
    # the Instruct checkpoints' generation_config.json: an eos list and sampling defaults a rollout engine must
    # not apply
    model.generation_config = GenerationConfig(
        bos_token_id=vocab.token_id(vocab.bos or "<|endoftext|>"),
        eos_token_id=[vocab.token_id(t) for t in vocab.generation_eos],
        pad_token_id=vocab.token_id(vocab.pad) if vocab.pad else None,
        do_sample=True, temperature=0.6, top_k=20, top_p=0.95)
    model.save_pretrained(str(out), safe_serialization=True)
    save_tokenizer(vocab, out)
    return out


def fingerprint(model: RandomModel, seed: int) -> str:
    sources = b"".join((Path(__file__).parent / name).read_bytes()
                       for name in ("random_checkpoints.py", "vocabularies.py"))
    blob = json.dumps(asdict(model), sort_keys=True).encode() + sources + str(seed).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def ensure_random_checkpoint(name: str, cache_dir: str | Path | None = None, seed: int = 0, log=print) -> Path:
    """Path of the cached random checkpoint `name` (a key of SHAPES), building it first if absent."""
    from marlaas_hpc.model.cache import default_cache_dir

    if name not in SHAPES:
        raise KeyError(f"unknown random checkpoint {name!r}; known: {sorted(SHAPES)}")
    model = SHAPES[name]
    final = Path(cache_dir or default_cache_dir()) / f"random-{name}-{fingerprint(model, seed)}"
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = final.with_name(f"{final.name}.building-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    log(f"[model] building random-weight checkpoint {name} into {final} (once)")
    build_random_checkpoint(staging, model, seed)
    try:
        staging.rename(final)
    except OSError:  # another process finished first: use theirs
        shutil.rmtree(staging, ignore_errors=True)
    return final
