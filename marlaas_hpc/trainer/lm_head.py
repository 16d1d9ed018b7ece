"""The LM head in float32, over the hidden states of the trained tokens only (vocab-parallel, as megatron's).

megatron's output layer computes the logits of every position in the base dtype. In bf16 a logit of 20-40 is
rounded to a multiple of 0.125-0.25: the "float32 logprobs" upcast from them carry 0.05-0.1 nats of noise per
token, straight into the importance ratio exp(logp - behaviour). And the trainer reads only the trained tokens'
logits, yet a 16k-token micro-batch's logits at Qwen3's 152k vocabulary are 2.5 GB per TP rank in bf16.

`LmHead` takes the final hidden states (after the final norm, in the base dtype) of the chosen positions and
returns float32 logits [n, V_padded / TP] of this rank's vocabulary shard: the head weight is the embedding
(tied: Qwen3-0.6B..4B) or the output layer's (untied: 8B and up), both split by vocabulary rows over TP. The
hidden states enter through `copy_to_tensor_model_parallel_region` (identity forward, all-reduce of their
gradient over TP in backward), as megatron's ColumnParallelLinear does. Columns past the real vocabulary
(megatron's padding rows) are -inf, so no softmax gives them mass.

Precision: on CUDA the bf16 GEMM writes float32 (`torch.mm(..., out_dtype=float32)`: bf16 products are exact in
float32 and cuBLAS accumulates in float32), so the logits equal a float32 GEMM of the same bf16 values, at bf16
tensor-core speed and without a float32 copy of the weight. Elsewhere the operands are upcast. The backward (the
hidden states' gradient only: the head is frozen) runs in the base dtype, as megatron's does.
"""
from __future__ import annotations

import torch


class _Float32Logits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, padding: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(weight)
        if hidden.dtype == torch.float32:
            logits = hidden @ weight.t()
        elif hidden.is_cuda:
            logits = torch.mm(hidden, weight.t(), out_dtype=torch.float32)
        else:
            logits = hidden.float() @ weight.float().t()
        if padding is not None:
            logits.masked_fill_(padding, float("-inf"))
        return logits

    @staticmethod
    def backward(ctx, grad_logits: torch.Tensor):
        (weight,) = ctx.saved_tensors
        # softmax puts no mass on the -inf columns: their gradient is exactly 0, nothing to mask
        return grad_logits.to(weight.dtype) @ weight, None, None


class LmHead:
    """float32 vocab-parallel logits of chosen final hidden states (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, tp_group, vocab_size: int):
        import torch.distributed as dist

        if model.share_embeddings_and_output_weights:
            self.weight = model.shared_embedding_or_output_weight()
        else:
            self.weight = model.output_layer.weight
        if self.weight.requires_grad:
            raise ValueError("LmHead computes no weight gradient: the head must be frozen")
        self.tp_group = tp_group
        local = self.weight.shape[0]
        first = dist.get_rank(tp_group) * local
        self.padding = None
        if first + local > vocab_size:  # this rank holds megatron's padding rows
            self.padding = torch.arange(first, first + local, device=self.weight.device) >= vocab_size

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] (base dtype) -> [n, V_padded / TP] float32, padding columns -inf."""
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        hidden = copy_to_tensor_model_parallel_region(hidden, group=self.tp_group)
        return _Float32Logits.apply(hidden, self.weight, self.padding)
