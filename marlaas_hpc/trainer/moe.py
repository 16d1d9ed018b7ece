"""Mixture-of-experts layers of the trainer's GPTModel (model/families.py `qwen3_moe`): megatron-core's MoELayer,
frozen, computing what transformers' Qwen3MoeSparseMoeBlock computes.

    HF (per MoE layer L)                                   megatron-core (local spec)
    model.layers.L.mlp.gate.weight [E, h]                  decoder.layers.L.mlp.router.weight
    model.layers.L.mlp.experts.N.{gate,up}_proj.weight     decoder.layers.L.mlp.experts.local_experts.N.linear_fc1
    model.layers.L.mlp.experts.N.down_proj.weight          decoder.layers.L.mlp.experts.local_experts.N.linear_fc2

Experts are megatron's `SequentialMLP` (one ColumnParallelLinear / RowParallelLinear pair per expert, split over
the TP ranks like a dense MLP); a layer listed in `mlp_only_layers` or off `decoder_sparse_step` keeps megatron's
dense MLP. The router (`FrozenRouter`) is megatron's TopKRouter with:

- its logits computed in float32 (`moe_router_dtype`), then HF's choice: softmax over every expert, top k, and the
  k weights renormalised when `norm_topk_prob` (megatron: softmax over the top-k logits, the same numbers) or
  kept as they are (megatron's `moe_router_pre_softmax`);
- no load-balancing or z-loss: the base model is frozen, and megatron's aux losses add their gradient to the
  router's input (the hidden states the LoRA adapters shape) through `MoEAuxLossAutoScaler`, a term the RL loss
  does not have. The config turns them off and the router refuses them (`check_frozen_routing`);
- no token dropping (capacity factor None): HF computes every token through its k experts.

GPU: the same SequentialMLP for now (a loop over experts). megatron-core's grouped-GEMM experts need the
`grouped_gemm` package (GroupedMLP) or Transformer Engine (TEGroupedMLP), neither installed; torch's own
`torch._grouped_mm` (CPU and CUDA in torch 2.13) is the candidate for a grouped module of this project's.

Expert parallelism (`TrainerConfig.expert_parallel`, TP=1): trainer/experts_parallel.py.

LoRA on the experts (trainer/lora.py `ExpertLoraSite`): one site per expert's fc1 / fc2, hooked like the dense
sites; the router stays frozen in float32 and takes no adapter.

Imports megatron at import: trainer/model.py imports it once the CPU shims are in (`apply_cpu_shims`).

Tensor parallelism without sequence parallelism (the trainer's layout): every TP rank holds every token, so
`ReplicatedTokenDispatcher` keeps them local and sums the ranks' partial expert outputs with one all-reduce, as a
dense MLP's row-parallel fc2 does. megatron's all-gather dispatcher would gather TP copies of the same tokens
(TP x the expert compute), and its MoELayer refuses TP without sequence parallelism in train mode.
"""
from __future__ import annotations

import logging
import re

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

from marlaas_hpc.model.families import ExpertsSpec

EXPERT_NAME = re.compile(r"decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight")
HF_EXPERT_NAME = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight")


class _KnownMoELayer(logging.Filter):
    """megatron's TransformerLayer logs "Unknown MLP type" for an MLP class outside its own list, once per layer:
    TensorParallelMoELayer (a MoELayer) then takes its process groups from parallel_state, the same ones."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Unknown MLP type")


logging.getLogger("megatron.core.transformer.transformer_layer").addFilter(_KnownMoELayer())


def moe_config_args(experts: ExpertsSpec, expert_parallel: int = 1) -> dict:
    """TransformerConfig fields of the experts (the dense layers' MLP keeps `ffn_hidden_size`); `expert_parallel`
    > 1: megatron's all-to-all dispatcher (trainer/experts_parallel.py)."""
    return dict(
        num_moe_experts=experts.num_experts, moe_ffn_hidden_size=experts.intermediate_size,
        moe_router_topk=experts.experts_per_token, moe_router_score_function="softmax",
        # norm_topk_prob: softmax over the k chosen logits (= HF's renormalised top-k of the full softmax);
        # else the full softmax's k values (pre-softmax)
        moe_router_pre_softmax=not experts.norm_topk_prob, moe_router_dtype="fp32",
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None,
        moe_input_jitter_eps=None, moe_router_enable_expert_bias=False, moe_router_topk_scaling_factor=None,
        moe_expert_capacity_factor=None, moe_pad_expert_input_to_capacity=False,
        moe_token_dispatcher_type="allgather" if expert_parallel == 1 else "alltoall", moe_grouped_gemm=False,
        moe_permute_fusion=False, moe_router_fusion=False, moe_shared_expert_intermediate_size=None)


def decoder_block_spec(dense_layer_spec, experts: ExpertsSpec, qk_norm: bool):
    """The decoder's layers: `dense_layer_spec` where the checkpoint keeps a dense MLP, else the same layer with
    this module's MoE layer as its MLP."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import LayerNormImpl, TransformerBlockSubmodules

    moe_spec = get_gpt_layer_local_spec(num_experts=experts.num_experts, moe_grouped_gemm=False,
                                        qk_layernorm=qk_norm, normalization="RMSNorm")
    mlp = moe_spec.submodules.mlp
    mlp.module = TensorParallelMoELayer
    mlp.submodules = MoESubmodules(experts=mlp.submodules.experts, shared_experts=None, router=FrozenRouter)
    layers = [moe_spec if routed else dense_layer_spec for routed in experts.expert_layers]
    # the final norm TransformerBlock gives a dense model's single layer spec (`_get_block_submodules`)
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=LayerNormImpl)


def moe_hf_names(mcore_name: str) -> list[str] | None:
    """HF names of an expert's or router's megatron weight (None: not an MoE weight)."""
    match = EXPERT_NAME.fullmatch(mcore_name)
    if match:
        layer, expert, fc = match.groups()
        prefix = f"model.layers.{layer}.mlp.experts.{expert}."
        parts = ("gate_proj", "up_proj") if fc == "1" else ("down_proj",)
        return [f"{prefix}{part}.weight" for part in parts]
    match = re.fullmatch(r"decoder\.layers\.(\d+)\.mlp\.router\.weight", mcore_name)
    if match:
        return [f"model.layers.{match.group(1)}.mlp.gate.weight"]
    return None


def global_expert_name(mcore_name: str, offset: int) -> str:
    """A local expert's megatron name with its index in the checkpoint (`offset` = EP rank x local experts)."""
    return re.sub(r"(\.mlp\.experts\.local_experts\.)(\d+)\.",
                  lambda match: f"{match.group(1)}{int(match.group(2)) + offset}.", mcore_name)


def fused_expert_slice(name: str, read) -> torch.Tensor | None:
    """An expert's weight `name` (model.layers.L.mlp.experts.N.{gate,up,down}_proj.weight) cut from the fused 3D
    tensors transformers 5 holds in memory (`mlp.experts.gate_up_proj` [E, 2f, h], gate rows first;
    `mlp.experts.down_proj` [E, h, f]), read with `read(key)`; None for any other name."""
    match = HF_EXPERT_NAME.fullmatch(name)
    if not match:
        return None
    prefix, expert, part = match.group(1), int(match.group(2)), match.group(3)
    if part == "down":
        return read(prefix + "down_proj")[expert]
    gate_up = read(prefix + "gate_up_proj")[expert]
    width = gate_up.shape[0] // 2
    return gate_up[:width] if part == "gate" else gate_up[width:]


class FrozenRouter(TopKRouter):
    """megatron's TopKRouter, frozen: float32 logits where the weight lives, no aux loss, no token dropping; the
    recorded experts of the tokens that replay their rollout's routing (trainer/route_replay.py)."""

    def __init__(self, config, pg_collection=None):
        super().__init__(config=config, pg_collection=pg_collection)
        check_frozen_routing(self)
        self.replay = None
        """The trainer's RouteReplay (set by it on every router); None: always its own top k."""
        self.moe_index = -1
        """This router's MoE layer among the model's (the index into recorded routes)."""

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        replayed = self.replay.route(self, logits) if self.replay is not None else None
        return replayed if replayed is not None else super().routing(logits, padding_mask=padding_mask)

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        """float32 router logits [tokens, experts]. megatron's own moves a CPU weight to the current CUDA device
        (the CPU twin has none), and its `router_gating_linear` names Transformer Engine's GEMM, which megatron-core
        0.16.1 leaves undefined without TE (NameError). The weight is frozen: autograd keeps its float32 copy
        (experts x hidden) for the input's gradient, not the input's."""
        bias = None if self.bias is None else self.bias.float()
        return torch.nn.functional.linear(input.float(), self.weight.float(), bias)


def check_frozen_routing(router) -> None:
    """Refuses a router config that would route unlike HF or add a loss to the frozen base."""
    config = router.config
    if router.is_aux_loss_enabled() or config.moe_z_loss_coeff is not None:
        raise ValueError("the frozen router takes no load-balancing or z-loss (moe_aux_loss_coeff, moe_z_loss_coeff)")
    if config.moe_expert_capacity_factor is not None or config.moe_input_jitter_eps is not None:
        raise ValueError("the frozen router drops no token and adds no jitter (moe_expert_capacity_factor, "
                         "moe_input_jitter_eps)")
    if router.enable_expert_bias or config.moe_router_dtype != "fp32":
        raise ValueError("the frozen router has no expert bias and computes in float32")


class SumGradOverTP(torch.autograd.Function):
    """Identity forward, gradient summed over the TP group backward. megatron's
    `copy_to_tensor_model_parallel_region` all-reduces `grad.contiguous()` and returns `grad`: a non-contiguous
    gradient (the routing weights' is a transpose, from the dispatcher's `probs.T.contiguous()`) comes back
    unreduced, each rank keeping its own shard's part. Also applied to the experts' replicated LoRA factors
    (trainer/lora.py `ExpertLoraSite`)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReplicatedTokenDispatcher(MoEAllGatherTokenDispatcher):
    """megatron's all-gather dispatcher for TP ranks that each hold every token (no sequence parallelism): no
    gather; each rank runs its TP shard of the experts on its tokens and the partial outputs are summed.

    Gradients: the experts' linears skip their own TP communication (megatron's `explicit_expert_comm`), so the
    hidden states and the routing weights enter through `SumGradOverTP` (identity forward, all-reduce backward:
    each rank's shard contributes to their gradient); the output leaves through
    `reduce_from_tensor_model_parallel_region` (all-reduce forward, identity backward)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.ep_size > 1:
            raise ValueError("the replicated-token dispatcher runs without expert parallelism (expert_parallel > 1 "
                             "takes trainer/experts_parallel.py's)")

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """megatron's permutation to expert order, and each local expert's token indices in it
        (`expert_token_ids`): the LoRA expert sites (trainer/lora.py) find each token's batch row from them."""
        permuted, tokens_per_expert, permuted_probs = super().dispatch_postprocess(hidden_states, probs)
        self.expert_token_ids = torch.split(self.reversed_local_input_permutation_mapping, tokens_per_expert.tolist())
        return permuted, tokens_per_expert, permuted_probs

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        if self.tp_size > 1:
            hidden_states = SumGradOverTP.apply(hidden_states, self.tp_group)
            probs = SumGradOverTP.apply(probs, self.tp_group)
        return hidden_states, probs

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            hidden_states = reduce_from_tensor_model_parallel_region(hidden_states, group=self.tp_group)
        return hidden_states


class TensorParallelMoELayer(MoELayer):
    """megatron's MoELayer with `ReplicatedTokenDispatcher` (the trainer's TP runs without sequence parallelism), or
    with expert parallelism trainer/experts_parallel.py's all-to-all `ExpertParallelDispatcher`."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None):
        pg_collection = pg_collection or get_default_pg_collection()
        super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                         pg_collection=pg_collection)
        if config.moe_token_dispatcher_type == "alltoall":
            from marlaas_hpc.trainer.experts_parallel import ExpertParallelDispatcher

            dispatcher = ExpertParallelDispatcher
        else:
            dispatcher = ReplicatedTokenDispatcher
        self.token_dispatcher = dispatcher(self.num_local_experts, self.local_expert_indices, config=self.config,
                                           pg_collection=pg_collection)

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors=None, padding_mask=None):
        # megatron raises in train mode at TP > 1 without sequence parallelism ("performance may degrade"): its
        # dispatchers would gather TP copies of the same tokens, which ReplicatedTokenDispatcher does not. Its
        # forward reads `self.training` for that check only (the router and experts read their own).
        training, self.training = self.training, False
        try:
            return super().forward(hidden_states, intermediate_tensors, padding_mask)
        finally:
            self.training = training
