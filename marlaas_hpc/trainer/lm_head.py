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

Memory: the trainer needs log softmax(logits / T) at each token's target only. `LmHead.logprobs` computes it a
chunk of tokens at a time (`LOGITS_CHUNK_BYTES` of float32 logits) and keeps for backward only the hidden states
and one float32 logsumexp per token; backward recomputes each chunk's logits. A whole micro-batch's float32
logits would be n x V/TP x 4 bytes, kept once more by the cross entropy for backward: 8.6 GB for 14k trained
tokens of Qwen3's vocabulary at TP=2. The price is one more head GEMM in backward.
"""
from __future__ import annotations

import torch


LOGITS_CHUNK_BYTES = 256 << 20
"""float32 logits `LmHead.logprobs` holds at once per TP rank (~880 tokens of Qwen3's vocabulary at TP=2); a few
such buffers live at a time."""


def _float32_logits(hidden: torch.Tensor, weight: torch.Tensor, padding: torch.Tensor | None) -> torch.Tensor:
    if hidden.dtype == torch.float32:
        logits = hidden @ weight.t()
    elif hidden.is_cuda:
        logits = torch.mm(hidden, weight.t(), out_dtype=torch.float32)
    else:
        logits = hidden.float() @ weight.float().t()
    if padding is not None:
        logits.masked_fill_(padding, float("-inf"))
    return logits


class _Float32Logits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, padding: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return _float32_logits(hidden, weight, padding)

    @staticmethod
    def backward(ctx, grad_logits: torch.Tensor):
        (weight,) = ctx.saved_tensors
        # softmax puts no mass on the -inf columns: their gradient is exactly 0, nothing to mask
        return grad_logits.to(weight.dtype) @ weight, None, None


class _ChunkedLogprobs(torch.autograd.Function):
    """log softmax(hidden @ W.T / T)[label] over a vocabulary split by rows over TP, a chunk of tokens at a time.
    Returns this rank's part of d/d hidden: the caller's copy_to_tensor_model_parallel_region sums it over TP."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, head: "LmHead", temperature: float, chunk: int):
        import torch.distributed as dist

        logp = torch.empty(len(hidden), dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logp)
        for start in range(0, len(hidden), chunk):
            part = slice(start, start + chunk)
            scaled = _float32_logits(hidden[part], weight, head.padding).div_(temperature)
            top = scaled.max(dim=-1).values
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=head.tp_group)
            total = (scaled - top.unsqueeze(1)).exp_().sum(dim=-1)
            dist.all_reduce(total, group=head.tp_group)
            local, inside = head.local_labels(labels[part])
            target = torch.where(inside, scaled.gather(1, local.unsqueeze(1)).squeeze(1), 0.0)
            dist.all_reduce(target, group=head.tp_group)  # the one rank holding each label's column adds it
            lse[part] = top + total.log()
            logp[part] = target - lse[part]
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.head, ctx.temperature, ctx.chunk = head, temperature, chunk
        return logp

    @staticmethod
    def backward(ctx, grad_logp):
        hidden, weight, labels, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        for start in range(0, len(hidden), ctx.chunk):
            part = slice(start, start + ctx.chunk)
            scaled = _float32_logits(hidden[part], weight, ctx.head.padding).div_(ctx.temperature)
            grad = grad_logp[part].unsqueeze(1)
            # d logp / d scaled = onehot(label) - softmax; the -inf padding columns get exactly 0
            grad_scaled = scaled.sub_(lse[part].unsqueeze(1)).exp_().mul_(-grad)
            local, inside = ctx.head.local_labels(labels[part])
            grad_scaled.scatter_add_(1, local.unsqueeze(1), torch.where(inside.unsqueeze(1), grad, 0.0))
            grad_hidden[part] = grad_scaled.div_(ctx.temperature).to(weight.dtype) @ weight
        return grad_hidden, None, None, None, None, None


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
        self.local_vocab = self.weight.shape[0]
        self.first = dist.get_rank(tp_group) * self.local_vocab
        self.padding = None
        if self.first + self.local_vocab > vocab_size:  # this rank holds megatron's padding rows
            self.padding = torch.arange(self.first, self.first + self.local_vocab,
                                        device=self.weight.device) >= vocab_size

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] (base dtype) -> [n, V_padded / TP] float32 logits, padding columns -inf."""
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        hidden = copy_to_tensor_model_parallel_region(hidden, group=self.tp_group)
        return _Float32Logits.apply(hidden, self.weight, self.padding)

    def logprobs(self, hidden: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
        """[n, hidden] (base dtype), labels [n] -> float32 log softmax(logits / temperature)[label], [n], with no
        [n, V] tensor kept for backward (see the module docstring). Collective over TP."""
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        hidden = copy_to_tensor_model_parallel_region(hidden, group=self.tp_group)
        chunk = max(1, LOGITS_CHUNK_BYTES // (4 * self.local_vocab))
        return _ChunkedLogprobs.apply(hidden, self.weight, labels, self, float(temperature), chunk)

    def local_labels(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(column in this rank's shard, clamped into it; whether the label is in this rank's shard)."""
        local = labels - self.first
        inside = (local >= 0) & (local < self.local_vocab)
        return local.clamp(0, self.local_vocab - 1), inside
