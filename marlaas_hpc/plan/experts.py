"""Mixture-of-experts terms of the memory plan (model/families.py `qwen3_moe`), as the trainer (trainer/moe.py,
trainer/lora.py `ExpertLoraSite`) and vLLM hold them. No torch here: estimate.py calls these for the layers
`ModelShape.is_expert_layer` names; a dense model has none and its figures do not move.

Layout planned: tensor parallelism over every expert (each TP rank holds 1/TP of every expert's gate/up/down, as
a dense MLP is split), the router replicated; or, on a trainer at TP 1, expert parallelism (layout.trainer_ep:
trainer/experts_parallel.py): each rank of an EP group holds num_experts / EP whole experts of every MoE layer,
their LoRA and its optimizer state, and the router whole. With EP 1 every rank holds every expert.

Trainer rank, per MoE layer:

    base weights   each local expert's (num_experts / EP of them) fc1 [2 x expert_intermediate / TP, h] and fc2
                   [h, expert_intermediate / TP] in the base dtype, and the router [experts, h] whole on every rank
                   (megatron's TopKRouter casts its weight to params_dtype: the base dtype; `FrozenRouter` computes
                   its logits in float32)
    LoRA           one fc1 and one fc2 site per local expert (ExpertLoraSite: fc1 column, A [r, h] whole, B
                   [2 x expert_intermediate / TP, r] split; fc2 row, A [r, expert_intermediate / TP] split, B [h, r]
                   whole), float32. A dense layer of an MoE model takes no MLP adapter (trainer/lora.py `MultiLora`)
    activations    per token, its top k experts' share: the dispatcher's permuted copy (k x h, the fc1 sites'
                   input), fc2's input and the SwiGLU's (k x expert_intermediate / TP), the experts' joined output
                   (k x h, kept for the routing weights' gradient), the fc1/fc2 sites' float32 [r] hiddens, and the
                   router's float32 logits, softmax and routing map (tokens x experts); per layer the float32 copy
                   of the router's weight autograd keeps for the input's gradient, and each fused task's B x alpha / r
                   of every local expert site. An estimate after the code, unchecked: the GPU dry run cannot route
                   tokens on fake tensors (megatron's permute uses masked_select, sized by the routing).
                   With EP a rank computes the tokens that every rank of its EP group routed to its experts; the
                   plan assumes tokens spread evenly over the EP ranks (the dispatcher uses no capacity factor, so
                   an uneven routing can send a rank more), so a rank still computes k expert slots per local token.
    dispatch       with EP only: the all-to-all's buffers of one MoE layer, its routed tokens' hidden states (k
                   copies per token) sent and received, with their float32 routing weights and int64 adapter codes
                   (`expert_dispatch_bytes`)

Rollout rank: vLLM holds every expert at its TP (no `enable_expert_parallel`), the router replicated; its LoRA slots
(vllm/lora/layers/fused_moe.py `FusedMoEWithLoRA`) are per expert w1/w3 A [r, h], B [expert_intermediate / TP, r]
and w2 A [r, expert_intermediate / TP], B [h, r].
"""
from __future__ import annotations

from marlaas_hpc.model.shape import ModelShape


def moe_layers(dims: ModelShape) -> int:
    """Layers whose MLP is routed experts (0 in a dense model)."""
    return sum(dims.is_expert_layer(layer) for layer in range(dims.num_layers))


def router_elements(dims: ModelShape) -> int:
    """Every router's weight [experts, h]: replicated on every TP rank, trainer and vLLM alike."""
    return moe_layers(dims) * dims.num_experts * dims.hidden_size


def expert_shard(dims: ModelShape, tp: int) -> int:
    """One expert's SwiGLU width on a TP rank."""
    return dims.expert_intermediate_size // tp


def local_experts(dims: ModelShape, ep: int = 1) -> int:
    """Experts of each MoE layer a trainer rank holds: all of them, or 1/EP under expert parallelism (EP divides
    them: `check_expert_layout` in command.py)."""
    return dims.num_experts // ep


def expert_weight_elements(dims: ModelShape) -> int:
    """Every expert's gate, up and down of every MoE layer, unsharded (the router apart)."""
    return moe_layers(dims) * dims.num_experts * 3 * dims.expert_intermediate_size * dims.hidden_size


def expert_lora_elements(dims: ModelShape, tp: int, rank: int, ep: int = 1) -> int:
    """One task's expert adapters on a trainer rank: per local expert fc1 (A [r, h] whole, B [2 x shard, r]) and
    fc2 (A [r, shard], B [h, r] whole)."""
    h, f = dims.hidden_size, expert_shard(dims, tp)
    per_expert = rank * (h + 2 * f) + rank * (f + h)
    return moe_layers(dims) * local_experts(dims, ep) * per_expert


def expert_peft_elements(dims: ModelShape, rank: int) -> int:
    """One task's expert adapters in PEFT's form, TP gathered (what an export and a delta broadcast hold): per
    expert gate, up and down each A [r, in] and B [out, r] (gate and up write their shared A twice)."""
    return moe_layers(dims) * dims.num_experts * 3 * rank * (dims.hidden_size + dims.expert_intermediate_size)


def vllm_expert_slot_elements(dims: ModelShape, tp: int, rank: int) -> int:
    """One vLLM LoRA slot's expert part on a rollout TP rank: per expert w1 and w3 (A [r, h], B [shard, r]) and w2
    (A [r, shard], B [h, r])."""
    h, f = dims.hidden_size, expert_shard(dims, tp)
    return moe_layers(dims) * dims.num_experts * rank * (3 * h + 3 * f)


def expert_layer_bytes_per_token(dims: ModelShape, tp: int, b: int, rank: int) -> int:
    """What an MoE layer's MLP keeps for backward per token (module docstring): `b` the base dtype's bytes."""
    k, h, f, experts = dims.experts_per_token, dims.hidden_size, expert_shard(dims, tp), dims.num_experts
    permuted = k * h * b  # the fc1 sites' input
    fc2_input = k * f * b
    swiglu = 4 * k * f * b  # fc1's output [2 x shard], the SiLU output and the product
    joined = k * h * b
    lora_hidden = 2 * 4 * rank * k
    # float32 logits, softmax and dense routing weights [experts], the bool routing map, the top k's float32
    # weights, int64 indices and permuted weights
    router = 3 * 4 * experts + experts + k * (4 + 8 + 4)
    return permuted + fc2_input + swiglu + joined + lora_hidden + router


def expert_layer_fixed_bytes(dims: ModelShape, tp: int, rank: int, tasks: int, ep: int = 1) -> int:
    """Per MoE layer, independent of tokens: the router weight's float32 copy autograd keeps (the router is whole),
    and each fused task's B x alpha / r (float32 [out, r]) of every local expert's fc1 and fc2 site."""
    h, f = dims.hidden_size, expert_shard(dims, tp)
    return 4 * dims.num_experts * h + tasks * local_experts(dims, ep) * 4 * rank * (2 * f + h)


def expert_dispatch_bytes(dims: ModelShape, tokens: int, b: int, ep: int = 1) -> int:
    """Expert parallelism's all-to-all buffers (trainer/experts_parallel.py), 0 without it: a rank sends its
    tokens' k routed copies (hidden states, their float32 routing weights, int64 adapter codes) and receives as
    many (tokens spread evenly over the EP ranks, no capacity factor: module doc); the combine and the backward's
    all-to-alls move as much the other way. One MoE layer's at a time, send and receive buffers both live."""
    if ep == 1 or not moe_layers(dims):
        return 0
    return 2 * tokens * dims.experts_per_token * (dims.hidden_size * b + 4 + 8)


def expert_backward_bytes_per_token(dims: ModelShape, tp: int, b: int) -> int:
    """An MoE layer's backward at its peak, on top of its activations: the float32 gradient of its tokens' fc1
    outputs (k x 2 x shard), a hidden-size gradient, and the permuted tokens' gradient (k x h)."""
    k = dims.experts_per_token
    return 8 * k * expert_shard(dims, tp) + dims.hidden_size + k * dims.hidden_size * b


def rollout_expert_bytes_per_token(dims: ModelShape, tp: int, b: int) -> int:
    """vLLM's fused-MoE intermediates per batched token (its intermediate caches: [k, 2 x shard], [k, shard],
    [k, h]) and the router's logits: what replaces the dense MLP's widths in the profiling forward."""
    k = dims.experts_per_token
    return b * (3 * k * expert_shard(dims, tp) + k * dims.hidden_size) + 4 * dims.num_experts
