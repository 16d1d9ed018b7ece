"""Routing replay (`algo.routing_replay`): the trainer's MoE layers route chosen tokens to the experts the rollout
engine recorded, instead of their own top k (docs/architecture.md, Routing replay).

A rollout engine in bf16 and the fp32 trainer compute slightly different router logits; where two experts' logits
are close, the two pick different experts for a token, and that token's hidden state (and every later token's,
through attention) then differs by far more than rounding: the logprob the trainer computes is not the one the
rollout sampled from. Replay removes that part of the mismatch: the recorded experts are used, and only the gate
weights (softmax probabilities at those experts, renormalised over them when `norm_topk_prob`) come from the
trainer's own router logits, so the loss's gradient through them has the form it has without replay.

`RouteReplay` holds, for the current forward, each position's recorded experts ([s, rows, MoE layers, k], the
activation layout megatron flattens to [s * rows] tokens) and which positions replay (a fused batch mixes tasks
with and without it, and a row's last completion token has no record). Every `FrozenRouter` of the model
(trainer/moe.py) reads its layer's slice from it. It also keeps, per MoE layer, which replayed positions' own top k
differs from the recorded set (`mismatch`): the trainer's `route_mismatch` metric.

Imports megatron at import (through trainer/moe.py): the trainer imports it after the CPU shims.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from marlaas_hpc.trainer.moe import FrozenRouter


class RouteReplay:
    """The recorded routes of the current forward, read by every router of `model` (each learns its MoE layer
    index here: routers in layer order)."""

    def __init__(self, model: torch.nn.Module):
        self.routers = [module for module in model.modules() if isinstance(module, FrozenRouter)]
        for index, router in enumerate(self.routers):
            router.replay, router.moe_index = self, index
        self._routes: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        self._mismatch: dict[int, torch.Tensor] = {}

    @property
    def moe_layers(self) -> int:
        return len(self.routers)

    @contextmanager
    def use(self, routes: torch.Tensor | None, mask: torch.Tensor | None) -> Iterator[None]:
        """Replays `routes` [rows, s, MoE layers, k] at the positions where `mask` [rows, s] is True in the
        forwards (and recomputing backwards) inside the block; None: every router computes its own top k."""
        previous = (self._routes, self._mask, self._mismatch)
        if routes is not None:
            if routes.shape[2] != self.moe_layers or routes.shape[:2] != mask.shape:
                raise ValueError(f"routes of shape {tuple(routes.shape)} (mask {tuple(mask.shape)}) for a model of "
                                 f"{self.moe_layers} MoE layers")
            # megatron's activations are [s, rows]: a router sees token s * rows + row
            # int16 until a router takes its layer's slice: int64 [s, rows, layers, k] is 4x the bytes
            routes, mask = routes.transpose(0, 1), mask.t().contiguous()
            if not mask.any():
                routes = mask = None
        self._routes, self._mask, self._mismatch = routes, mask, {}
        try:
            yield
        finally:
            self._routes, self._mask, self._mismatch = previous

    def route(self, router: FrozenRouter, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(probs [tokens, E], routing map [tokens, E]) of this forward's tokens with the recorded experts where
        they replay, or None (no replay in this forward: megatron's own routing)."""
        if self._routes is None:
            return None
        routes = self._routes[:, :, router.moe_index].reshape(-1, router.topk).long()
        mask = self._mask.reshape(-1)
        logits = logits.view(-1, router.config.num_moe_experts)
        probs, routing_map, own = replayed_routing(logits, routes, mask, router.topk,
                                                   router.config.moe_router_pre_softmax)
        with torch.no_grad():
            same = torch.sort(own, dim=-1).values == torch.sort(routes, dim=-1).values
            # overwritten, not accumulated: activation recompute runs the layer's forward again in backward
            self._mismatch[router.moe_index] = mask & ~same.all(dim=-1)
        return probs, routing_map

    def mismatch(self) -> torch.Tensor | None:
        """[s, rows] bool: replayed positions whose own top k differs from the recorded experts in some MoE
        layer, in the last forward inside `use` (None: none replayed)."""
        if not self._mismatch:
            return None
        flags = torch.stack(list(self._mismatch.values())).any(dim=0)
        return flags.view(self._mask.shape)


def replayed_routing(logits: torch.Tensor, routes: torch.Tensor, mask: torch.Tensor, top_k: int,
                     pre_softmax: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HF Qwen3-MoE's routing (Qwen3MoeTopKRouter) with each masked token's k experts given by `routes` [tokens, k]:
    (probs [tokens, E] float32, routing map [tokens, E] bool, the router's own top k [tokens, k]).

    The weights are the softmax over all experts at the chosen ones (`pre_softmax`: HF's norm_topk_prob false), or
    the softmax over the chosen logits (norm_topk_prob: equal to HF's renormalised top-k probabilities); megatron's
    `topk_routing_with_score_function` computes the same two for its own top k."""
    own = torch.topk(logits, top_k, dim=-1).indices  # softmax is monotonic: the same top k as over probabilities
    chosen = torch.where(mask[:, None], routes, own)
    if pre_softmax:
        weights = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(1, chosen)
    else:
        weights = torch.softmax(logits.gather(1, chosen), dim=-1, dtype=torch.float32)
    weights = weights.type_as(logits)
    probs = torch.zeros_like(logits).scatter(1, chosen, weights)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, chosen, True)
    return probs, routing_map, own
