"""A decoder model's shape: `ModelShape`, the one type for it, read from a checkpoint's config.json.

What memory and the checks depend on: the plan's formulas (plan/estimate.py), the checkpoint checks
(model/checkpoint.py `CheckpointInfo.shape`) and the random-weight checkpoints (model/random_checkpoints.py, each
a family's ModelShape written out). The two pre-trained models' recipes (tiny_model.py `TinyModelConfig`,
model/chat_mini.py `ChatMiniConfig`) set their widths as fields of the recipe: they are part of the recipe's
fingerprint, which names the shipped weights; their config.json reads back as a ModelShape like any other.
No torch here: `marlaas plan` reads shapes without it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    hidden_size: int
    """Model width."""
    num_layers: int
    """Decoder layers."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (GQA); a TP size must divide them."""
    head_dim: int
    """Per-head width (Qwen3 and Llama set it in config.json; Qwen2's is hidden_size / num_heads)."""
    intermediate_size: int
    """SwiGLU hidden width."""
    vocab_size: int
    """Rows of the embedding (and of the LM head)."""
    tied: bool
    """Tied input/output embeddings, or a separate lm_head."""
    max_position_embeddings: int
    """Context length in config.json (0: not set)."""
    qk_norm: bool = True
    """RMSNorm on each head's queries and keys (Qwen3; not Qwen2 or Llama)."""
    qkv_bias: bool = False
    """Biases on the q/k/v projections (Qwen2)."""
    num_experts: int = 0
    """Routed experts of each MoE layer (0: a dense model)."""
    experts_per_token: int = 0
    """Experts each token is routed to (MoE)."""
    expert_intermediate_size: int = 0
    """Each expert's SwiGLU width (MoE); `intermediate_size` stays the dense layers' width."""
    norm_topk_prob: bool = False
    """MoE: the top-k routing weights are renormalised to sum to 1."""
    dense_layers: tuple[int, ...] = ()
    """MoE: the layers that keep a dense MLP (config.json's `mlp_only_layers`, as a decoder_sparse_step of 1
    reads; model/families.py `experts_of` reads both)."""

    @classmethod
    def from_config(cls, config: dict) -> "ModelShape":
        """The shape of a served family's config.json (model/families.py: anything else raises
        UnservedCheckpoint, naming the key)."""
        from marlaas_hpc.model.families import family_of, head_dim_of

        family = family_of(config)
        heads = int(config["num_attention_heads"])
        return cls(hidden_size=int(config["hidden_size"]), num_layers=int(config["num_hidden_layers"]),
                   num_heads=heads, num_kv_heads=int(config.get("num_key_value_heads", heads)),
                   head_dim=head_dim_of(config), intermediate_size=int(config["intermediate_size"]),
                   vocab_size=int(config["vocab_size"]), tied=bool(config.get("tie_word_embeddings", False)),
                   max_position_embeddings=int(config.get("max_position_embeddings", 0)),
                   qk_norm=family.qk_norm, qkv_bias=family.qkv_bias, **_expert_fields(config, family.experts))

    @classmethod
    def read(cls, model_dir: str | Path) -> "ModelShape":
        return cls.from_config(json.loads(Path(model_dir, "config.json").read_text()))

    def is_expert_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    def layer_weights(self, layer: int = 0) -> int:
        """Elements of one decoder layer's linears (unsharded): attention, then its dense MLP, or its experts and
        router."""
        h, d = self.hidden_size, self.head_dim
        attention = h * (self.num_heads + 2 * self.num_kv_heads) * d + self.num_heads * d * h
        if self.is_expert_layer(layer):
            return attention + self.num_experts * (3 * self.expert_intermediate_size * h + h)
        return attention + 3 * self.intermediate_size * h

    def norm_weights(self) -> int:
        """Elements of every RMSNorm: two per layer, the q/k norms where the family has them, the final one."""
        per_layer = 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)
        return self.num_layers * per_layer + self.hidden_size

    def qkv_biases(self) -> int:
        """Elements of one layer's q/k/v biases (unsharded; 0 unless the family has them)."""
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim if self.qkv_bias else 0

    def parameters(self) -> int:
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tied else 2)
        layers = sum(self.layer_weights(layer) for layer in range(self.num_layers))
        return embeddings + layers + self.num_layers * self.qkv_biases() + self.norm_weights()

    def describe(self) -> str:
        mlp = f"MLP {self.intermediate_size}"
        if self.num_experts:
            mlp = (f"{self.num_experts} experts x {self.expert_intermediate_size} (top {self.experts_per_token})"
                   + (f", dense MLP {self.intermediate_size} in layers {list(self.dense_layers)}"
                      if self.dense_layers else ""))
        return (f"hidden {self.hidden_size}, {self.num_layers} layers, {self.num_heads}/{self.num_kv_heads} heads x "
                f"{self.head_dim}, {mlp}, vocabulary {self.vocab_size} "
                f"({'tied' if self.tied else 'untied'}): {self.parameters() / 1e9:.2f} B parameters")


def _expert_fields(config: dict, experts: bool) -> dict:
    """ModelShape's expert fields of a config.json ({} for a dense family)."""
    from marlaas_hpc.model.families import experts_of

    if not experts:
        return {}
    spec = experts_of(config)
    return dict(num_experts=spec.num_experts, experts_per_token=spec.experts_per_token,
                expert_intermediate_size=spec.intermediate_size, norm_topk_prob=spec.norm_topk_prob,
                dense_layers=tuple(layer for layer, moe in enumerate(spec.expert_layers) if not moe))
