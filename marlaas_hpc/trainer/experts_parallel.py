"""Expert parallelism in the trainer (`TrainerConfig.expert_parallel`, docs/architecture.md §MoE).

megatron-core 0.16.1 carves the expert-parallel (EP) groups out of the data-parallel ranks: with EP ranks per
group and TP=1 (the only combination built, trainer/model.py `check_expert_parallel`), the ranks of each of
[0, EP), [EP, 2 EP), ... hold 1/EP of every MoE layer's experts (global index = EP rank x local experts + local
index), and the ranks that hold the same experts form the expert-data-parallel group (DP / EP ranks). The DP
replicas of one EP group hold different tokens, so each MoE layer sends every token to the rank of each of its k
experts and back: megatron's all-to-all dispatcher (`ExpertParallelDispatcher`).

What the trainer adds to it:
- LoRA on the experts: an expert's tokens come from every rank of the EP group, each with its own batch rows and
  adapters, so each token's adapter code (its row's index into `MultiLora.adapters`, the same on every rank)
  travels with it through the all-to-all (`expert_codes`), and `ExpertLoraSite` picks each token's adapter by it;
- every MoE layer is a collective of the EP group, forward and backward: the ranks run the same forwards
  (trainer/lockstep.py: a replica short of micro-batches runs zero-weight ones) and the same
  backwards (`token_dispatch` makes the dispatched tokens require grad in a grad-enabled forward, so that each
  rank's backward runs every layer's two all-to-alls whatever its own adapters are);
- gradients: an expert's LoRA gradient is complete on its EP rank once the other ranks' tokens' gradients came
  back through the all-to-all; only the ranks holding the same experts (expert-data-parallel group) sum it
  (trainer/lockstep.py `split_expert_params`), the rest sums over DP as before;
- export: `gather_expert_tensors` gathers every EP rank's expert adapters, so the adapter equals the EP=1 one.
Routing replay needs nothing: a router routes the tokens of its own rank, whose recorded routes it holds.

Imports megatron at import (after the CPU shims, trainer/cpu_shims.py shim 5 for the dispatcher on CPU).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher


class _AllToAllPair(torch.autograd.Function):
    """Two tensors (tokens, routing weights) through one EP all-to-all each, forward and backward in one autograd
    node: their backward collectives then run in one order on every rank (two separate nodes could be reached
    in different orders by ranks whose graphs differ, e.g. by the adapters of their rows)."""

    @staticmethod
    def forward(ctx, tokens, probs, group, output_splits, input_splits):
        ctx.group, ctx.splits = group, (output_splits, input_splits)
        return _all_to_all(tokens, group, output_splits, input_splits), \
            _all_to_all(probs, group, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad_tokens, grad_probs):
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad_tokens, ctx.group, input_splits, output_splits), \
            _all_to_all(grad_probs, ctx.group, input_splits, output_splits), None, None, None


class _AllToAll(torch.autograd.Function):
    """One tensor through an EP all-to-all; backward sends its gradient back the same way."""

    @staticmethod
    def forward(ctx, tensor, group, output_splits, input_splits):
        ctx.group, ctx.splits = group, (output_splits, input_splits)
        return _all_to_all(tensor, group, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, ctx.group, input_splits, output_splits), None, None, None


def _all_to_all(tensor: torch.Tensor, group, output_splits: list[int], input_splits: list[int]) -> torch.Tensor:
    """all_to_all_single with uneven splits (gloo and nccl), the output on the input's device (megatron's own
    allocates on the current CUDA device)."""
    tensor = tensor.contiguous()
    out = tensor.new_empty((sum(output_splits), *tensor.shape[1:]))
    dist.all_to_all_single(out, tensor, output_split_sizes=list(output_splits),
                           input_split_sizes=list(input_splits), group=group)
    return out


class ExpertParallelDispatcher(MoEAlltoAllTokenDispatcher):
    """megatron's all-to-all dispatcher over the EP group (TP=1), carrying each token's adapter code and keeping
    the EP ranks' backward collectives in step (module doc)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.tp_size > 1:
            raise ValueError("expert parallelism runs at tensor parallel 1 (expert_parallel)")
        self.row_codes = None
        """Set by MultiLora (trainer/lora.py): () -> (adapter names, each batch row's index into them or -1)."""
        self.code_names: list[str] = []
        self.expert_codes: tuple[torch.Tensor, ...] = ()
        """Per local expert, the adapter code of each token it receives (in the order the expert sees them)."""

    def token_dispatch(self, permutated_local_input_tokens, permuted_probs):
        self.tokens_per_expert = self._maybe_dtoh_and_synchronize("before_ep_alltoall", self.tokens_per_expert)
        tokens, probs = permutated_local_input_tokens, permuted_probs
        if torch.is_grad_enabled():
            # the frozen base gives hidden states without grad where no adapter acts before this layer; a leaf that
            # requires grad (no upstream gradient is cut: there is none) makes every rank's backward run this
            # layer's all-to-alls, which the other EP ranks' backwards wait on
            tokens = tokens if tokens.requires_grad else tokens.detach().requires_grad_()
            probs = probs if probs.requires_grad else probs.detach().requires_grad_()
        self._dispatch_codes()
        return _AllToAllPair.apply(tokens, probs, self.ep_group, self.output_splits, self.input_splits)

    def _dispatch_codes(self) -> None:
        """Each permuted token's adapter code (its batch row's), sent with the token (no gradient)."""
        batch = self.hidden_shape[1]
        names, row_codes = self.row_codes() if self.row_codes is not None else ([], None)
        token_rows = self.reversed_local_input_permutation_mapping % batch
        codes = row_codes[token_rows] if row_codes is not None else torch.full_like(token_rows, -1)
        self.code_names = names
        self._received_codes = _all_to_all(codes, self.ep_group, self.output_splits, self.input_splits)

    def dispatch_postprocess(self, global_input_tokens, global_probs):
        tokens, tokens_per_expert, probs = super().dispatch_postprocess(global_input_tokens, global_probs)
        codes = self._received_codes
        if self.num_local_experts > 1:  # the same chunk sort megatron applies to the tokens
            codes, _ = sort_chunks_by_idxs(codes, self.num_global_tokens_per_local_expert.ravel(),
                                           self.sort_input_by_local_experts)
        self.expert_codes = torch.split(codes, torch.as_tensor(tokens_per_expert).tolist())
        return tokens, tokens_per_expert, probs

    def token_combine(self, hidden_states, async_finish: bool = True, allocate_on_comm_stream: bool = True):
        return _AllToAll.apply(hidden_states, self.ep_group, self.input_splits, self.output_splits)


def gather_expert_tensors(tensors: dict[str, torch.Tensor], ep_group) -> dict[str, torch.Tensor]:
    """Every EP rank's expert tensors {peft key: host tensor}, merged (collective over the EP group)."""
    if ep_group is None or dist.get_world_size(ep_group) == 1:
        return tensors
    gathered: list = [None] * dist.get_world_size(ep_group)
    dist.all_gather_object(gathered, tensors, group=ep_group)
    out: dict[str, torch.Tensor] = {}
    for part in gathered:
        out.update(part)
    return out
