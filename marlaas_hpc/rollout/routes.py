"""The experts a transformers Qwen3-MoE chose for each token it fed (routing replay, `algo.routing_replay`): what the
`hf` engine records for the trainer to replay (trainer/route_replay.py).

transformers' Qwen3MoeSparseMoeBlock routes through its `mlp.gate` (Qwen3MoeTopKRouter), which returns (router
logits, top-k weights, top-k expert indices) for the block's tokens flattened batch-major ([batch * seq]). A
forward hook on every routed layer's gate keeps the indices of each forward (prefill, then one per decode step),
as int16, copied to the host after the generate call: k x MoE layers x 2 bytes per position (Qwen3-30B-A3B:
8 x 48 x 2 = 768 bytes).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

ROUTE_DTYPE = torch.int16
"""Expert indices on the wire: up to 32,767 experts (Qwen3-235B has 128)."""


def moe_gates(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The routers of a transformers MoE model's routed layers, in layer order (a dense layer, `mlp_only_layers`,
    has none)."""
    return [module.gate for module in model.modules() if hasattr(module, "gate") and hasattr(module, "experts")]


class RouteRecorder:
    """Records every routed layer's chosen experts of each forward of `model` while `recording`."""

    def __init__(self, model: torch.nn.Module):
        self.gates = moe_gates(model)
        if not self.gates:
            raise ValueError("routing replay needs a mixture-of-experts model: this one routes no layer")
        self.forwards: list[list[torch.Tensor]] = []
        """Per forward, per MoE layer: the top-k indices [tokens (batch-major), k] (int16, on the model's device)."""

    @contextmanager
    def recording(self) -> Iterator["RouteRecorder"]:
        self.forwards = []
        handles = [gate.register_forward_hook(self._hook(index)) for index, gate in enumerate(self.gates)]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _hook(self, index: int):
        def hook(module, inputs, output):
            indices = output[2].detach().to(ROUTE_DTYPE)  # kept on the device: no sync per layer and step
            if index == 0:
                self.forwards.append([])
            self.forwards[-1].append(indices)
        return hook

    def by_position(self, batch: int) -> list[torch.Tensor]:
        """Each forward's routes as [batch, seq, MoE layers, k] on the host (seq: the positions that forward fed)."""
        out = []
        for layers in self.forwards:
            stacked = torch.stack(layers, dim=1).cpu()  # [batch * seq, layers, k]
            out.append(stacked.view(batch, -1, *stacked.shape[1:]))
        return out


def generation_routes(forwards: list[torch.Tensor], row: int, context: int, width: int, new_tokens: int):
    """One row's routes of a left-padded generate call: its `context` positions from the prefill (the last
    `context` of `width`), then one per decode forward, for the `new_tokens` - 1 sampled tokens that were fed
    (the last one is sampled, never fed). An int16 numpy array [context + new_tokens - 1, MoE layers, k]."""
    parts = [forwards[0][row, width - context:]]
    parts += [step[row] for step in forwards[1:new_tokens]]
    return torch.cat(parts, dim=0).numpy()
