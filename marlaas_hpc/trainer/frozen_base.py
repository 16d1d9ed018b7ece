"""No weight gradients for the frozen base: megatron-core's tensor-parallel linear computes them regardless.

megatron-core 0.16's `LinearWithGradAccumulationAndAsyncCommunication.backward` (every ColumnParallelLinear and
RowParallelLinear of the local layer spec, and the output layer that reads the shared embedding) always computes
`grad_weight = grad_output.t() @ input`, whether or not the weight requires a gradient. The base model is frozen
(only LoRA adapters train), so that GEMM is as costly as the input-gradient GEMM and thrown away: it doubles
the backward pass of every linear and, for the output layer, allocates a vocab x hidden buffer (600 MB for
Qwen3-0.6B in fp32) per micro-batch.

`skip_frozen_weight_grads()` wraps that backward: when autograd needs no gradient for the weight (and the call
uses none of the features that tie the weight gradient to other work: sequence parallelism, fused gradient
accumulation, deferred wgrad buffers), it computes only the input gradient, all-reduced over the TP group as the
original does; otherwise it calls the original. The result is identical (tests compare gradients with and
without it). It applies on CPU and GPU alike; idempotent.
"""
from __future__ import annotations

import torch

_APPLIED = False


def skip_frozen_weight_grads() -> None:
    global _APPLIED
    if _APPLIED:
        return
    from megatron.core.tensor_parallel import layers

    function = layers.LinearWithGradAccumulationAndAsyncCommunication
    original = function.backward

    def backward(ctx, grad_output):
        if ctx.needs_input_grad[1] or ctx.sequence_parallel or ctx.gradient_accumulation_fusion \
                or ctx.grad_output_buffer is not None or (ctx.use_bias and ctx.needs_input_grad[2]):
            return original(ctx, grad_output)
        _, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        if ctx.allreduce_dgrad:
            torch.distributed.all_reduce(grad_input, group=ctx.tp_group)
        return grad_input, None, None, None, None, None, None, None, None

    function.backward = staticmethod(backward)
    function.original_backward = staticmethod(original)
    _APPLIED = True
