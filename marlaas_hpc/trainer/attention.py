"""How packed rows attend (trainer/packing.py): one visibility rule over the rows' segment ids, two kernels.

A packed row holds several sequences; per position it carries the prompt occurrence it belongs to (`prompt_of`)
and the item whose completion it is (`own`, -1 for a prompt token, PADDING for padding). A position sees the
earlier positions of its prompt occurrence that are the prompt or its own completion (`sees`); padding sees
only itself (a softmax needs one visible key, and nothing more keeps the padding tail's blocks empty).

    kind    kernel                                            memory kept for backward, per layer
    dense   megatron's DotProductAttention over a [rows, 1,   ~6 bytes per score: the fp32 softmax and its
            s, s] bool mask built from the ids on the device  low-precision copy ([rows, heads, s, s])
    flex    torch FlexAttention with a BlockMask built from   q, k, v, the output and one fp32 logsumexp per
            the same ids (`flex_block_mask`)                  query and head: no score matrix

'dense' is the CPU twin's kernel (FlexAttention has no backward on CPU in torch 2.13); 'flex' replaces each
layer's `core_attention` (`FlexCoreAttention`) and is the default on CUDA. FlexAttention materialises scores
unless compiled: `flex_kernel` compiles it once per process on CUDA (dynamic shapes: rows and width change with
every micro-batch; fullgraph, so a failed compile raises instead of falling back to the score-materialising
eager path). On CPU it runs eagerly (forward only), which is what the tests compare with the dense path.
"""
from __future__ import annotations

import functools
import warnings
from contextlib import contextmanager
from typing import Iterator

import torch

ATTENTION_KINDS = ("auto", "dense", "flex")
"""`trainer.attention`: 'auto' = flex on CUDA, dense on CPU."""
PADDING = -2
"""`own` of a padding position (a prompt token has -1, a completion token its item index >= 0)."""
FLEX_BLOCK = 128
"""FlexAttention's sparse block (torch's default): the unit of work a block mask skips or computes. Rows on the
flex path are at least this wide (`min_row_tokens`), so short sequences share a block instead of each padding one."""


def resolve_attention(kind: str, device: torch.device) -> str:
    """'dense' or 'flex' for a `trainer.attention` value on this device."""
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {kind!r}")
    if kind == "auto":
        return "flex" if device.type == "cuda" else "dense"
    return kind


def min_row_tokens(kind: str) -> int:
    """The narrowest packed row for an attention kernel: 32 tokens on the dense path (the CPU twin's rows), one
    FlexAttention block on the flex path (a row narrower than a block still costs a whole block)."""
    return FLEX_BLOCK if kind == "flex" else 32


def sees(q_index, kv_index, prompt_q, prompt_kv, own_q, own_kv):
    """The visibility rule, elementwise: True where query position q attends to key position kv of its row."""
    same_sequence = (prompt_q == prompt_kv) & ((own_kv == -1) | (own_kv == own_q))
    real = (kv_index <= q_index) & same_sequence & (own_q != PADDING)
    return real | ((own_q == PADDING) & (kv_index == q_index))


def dense_mask(prompt_of: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """[rows, 1, s, s] bool, True = masked out (megatron's convention), on the ids' device."""
    index = torch.arange(prompt_of.shape[1], device=prompt_of.device)
    visible = sees(index.view(1, -1, 1), index.view(1, 1, -1), prompt_of.unsqueeze(2), prompt_of.unsqueeze(1),
                   own.unsqueeze(2), own.unsqueeze(1))
    return (~visible).unsqueeze(1)


def flex_block_mask(prompt_of: torch.Tensor, own: torch.Tensor):
    """FlexAttention BlockMask of the rows (one for every head), on the ids' device. Building it evaluates the
    rule once per (row, q, kv) as bools (transient, rows x s x s bytes); what it keeps is per block."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_index, kv_index):
        return sees(q_index, kv_index, prompt_of[b, q_index], prompt_of[b, kv_index], own[b, q_index],
                    own[b, kv_index])

    rows, width = prompt_of.shape
    return create_block_mask(mask_mod, rows, None, width, width, device=prompt_of.device, BLOCK_SIZE=FLEX_BLOCK)


@functools.cache
def flex_kernel(device_type: str):
    """flex_attention, compiled once per process on CUDA (eager elsewhere: torch.compile is off on CPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    if device_type != "cuda":
        return flex_attention
    return torch.compile(flex_attention, dynamic=True, fullgraph=True)


class FlexCoreAttention(torch.nn.Module):
    """Drop-in for megatron's DotProductAttention (same arguments, same [sq, b, heads x head_dim] output) that
    attends through FlexAttention with the block mask its `RowAttention` holds for the current forward."""

    def __init__(self, replaced: torch.nn.Module, rows: "RowAttention"):
        super().__init__()
        self.softmax_scale = float(replaced.softmax_scale)
        self.heads = replaced.num_attention_heads_per_partition
        self.groups = replaced.num_query_groups_per_partition
        self._rows = [rows]  # a list: not a submodule of the model

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None or packed_seq_params is not None:
            raise NotImplementedError("FlexCoreAttention takes neither an attention bias nor packed_seq_params")
        block_mask = self._rows[0].block_mask
        if block_mask is None:
            raise RuntimeError("no block mask: run the model inside RowAttention.use")
        # megatron: [s, b, heads, head_dim]; FlexAttention: [b, heads, s, head_dim]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        with warnings.catch_warnings():  # eager on CPU by design (forward-only twin): not a performance bug
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            out = flex_kernel(q.device.type)(q, k, v, block_mask=block_mask, scale=self.softmax_scale,
                                             enable_gqa=self.heads != self.groups)
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)


class RowAttention:
    """The attention kernel of one trainer's model and the mask of its current forward.

    `mask(prompt_of, own)` builds a micro-batch's mask once; `use(mask)` holds it over a forward and, when
    training, its backward (activation recompute re-runs the attention inside backward) and yields what the
    model's `attention_mask` argument gets: the dense mask, or None on the flex path (the layers read it here).
    """

    def __init__(self, model: torch.nn.Module, kind: str):
        if kind not in ("dense", "flex"):
            raise ValueError(f"kernel must be 'dense' or 'flex', got {kind!r}")
        self.kind = kind
        self.block_mask = None
        if kind == "flex":
            for layer in model.decoder.layers:
                attention = layer.self_attention
                attention.core_attention = FlexCoreAttention(attention.core_attention, self)

    def mask(self, prompt_of: torch.Tensor, own: torch.Tensor):
        return flex_block_mask(prompt_of, own) if self.kind == "flex" else dense_mask(prompt_of, own)

    @contextmanager
    def use(self, mask) -> Iterator[torch.Tensor | None]:
        if self.kind == "dense":
            yield mask
            return
        previous, self.block_mask = self.block_mask, mask
        try:
            yield None
        finally:
            self.block_mask = previous


def causal_segments(rows: int, width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt_of, own) of unpacked rows: one sequence per row, every position a 'prompt' token (plain causal)."""
    return (torch.zeros(rows, width, dtype=torch.long, device=device),
            torch.full((rows, width), -1, dtype=torch.long, device=device))
