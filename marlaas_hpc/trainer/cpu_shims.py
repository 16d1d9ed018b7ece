"""CPU redirections of the CUDA-only call sites megatron-core 0.16.1 hits on a GPTModel forward/backward.

On a machine with CUDA every function here is left untouched (`apply_cpu_shims` is a no-op). On CPU:

1. `tensor_parallel.random`: the CUDA RNG get/set used by `CudaRNGStatesTracker.fork` (always entered by
   DotProductAttention) and `.add` (model_parallel_cuda_manual_seed) work on CPU generator states instead;
2. `RotaryEmbedding.get_emb` no longer moves `inv_freq` to `torch.cuda.current_device()`;
3. `utils.GlobalMemoryBuffer.get_tensor` allocates on the CPU;
4. `transformer.utils.get_default_causal_mask` (also imported into `fusions.fused_softmax`) builds the mask on
   the CPU (the trainer passes an explicit mask anyway);
5. expert parallelism (trainer/experts_parallel.py), megatron's all-to-all token dispatcher: its constructor makes a
   `torch.cuda.Stream()` for its device-to-host copies of the split sizes (class attribute `cuda_dtoh_stream`;
   set to a placeholder), and `_maybe_dtoh_and_synchronize` enters that stream (on CPU the counts are host
   tensors already: it only turns the split sizes into lists, which `all_to_all_single` takes); and
   `tensor_parallel.mappings._gather_along_first_dim`, with which the dispatcher gathers the EP ranks' token
   counts, allocates its output on `torch.cuda.current_device()` (here: on the input's device).
"""
from __future__ import annotations

import operator
import os
import sys
from contextlib import nullcontext
from functools import reduce

import torch

_APPLIED = False


def eager_on_cpu() -> None:
    """Turns torch.compile off where there is no GPU; call it before megatron or vLLM is imported. Both wrap ops
    in torch.compile at import and vLLM compiles its logprob gather at first use even with enforce_eager: on
    CPU that cost 0.7 s of a trainer rank's start (megatron's fused ops, which the trainer never runs: every
    fusion is off) and 2.6 s of a rollout rank's (dynamo tracing), and made generation no faster (0.45 s vs
    0.47 s for 3 x 256 sequences on the tiny model). The variable is read when torch._dynamo is first imported
    (setting the config after that import saved nothing); a process that already imported it gets the config."""
    if torch.cuda.is_available():
        return
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].config.disable = True


def apply_cpu_shims() -> bool:
    """Redirects megatron-core's CUDA-only calls to the CPU; returns True when shims are (now) active.

    Idempotent; a no-op returning False when `torch.cuda.is_available()`.
    """
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    eager_on_cpu()

    from megatron.core import utils as mcore_utils
    from megatron.core.fusions import fused_softmax
    from megatron.core.models.common.embeddings import rotary_pos_embedding
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer import utils as transformer_utils

    # 1. RNG tracker: CPU generator states stand in for CUDA ones.
    def _get_rng_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def _set_rng_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    def _tracker_add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        generator = torch.Generator()
        generator.manual_seed(seed)
        self.states_[name] = generator.get_state()

    mcore_random._get_cuda_rng_state = _get_rng_state
    mcore_random._set_cuda_rng_state = _set_rng_state
    mcore_random.CudaRNGStatesTracker.add = _tracker_add

    # 2. RoPE: keep inv_freq where the model lives.
    rotary_cls = rotary_pos_embedding.RotaryEmbedding

    def _get_emb(self, max_seq_len: int, offset: int = 0):
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        return emb[:, None, None, :]

    rotary_cls.get_emb = _get_emb
    # `forward` is lru_cached over get_emb's result; clear anything computed before the shim.
    if hasattr(rotary_cls.forward, "cache_clear"):
        rotary_cls.forward.cache_clear()

    # 3. Global memory buffer on the CPU.
    def _get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        required_len = reduce(operator.mul, tensor_shape, 1)
        if self.buffer.get((name, dtype), None) is None or self.buffer[(name, dtype)].numel() < required_len:
            with (mem_alloc_context or nullcontext)():
                self.buffer[(name, dtype)] = torch.empty(required_len, dtype=dtype, device="cpu",
                                                         requires_grad=False)
        return self.buffer[(name, dtype)][0:required_len].view(*tensor_shape)

    mcore_utils.GlobalMemoryBuffer.get_tensor = _get_tensor

    # 4. Default causal mask on the CPU (True = masked out, as megatron expects).
    def _get_default_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    transformer_utils.get_default_causal_mask = _get_default_causal_mask
    fused_softmax.get_default_causal_mask = _get_default_causal_mask

    _all_to_all_dispatcher_on_cpu()

    _APPLIED = True
    return True


def _all_to_all_dispatcher_on_cpu() -> None:
    """Shim 5 (module doc): megatron's all-to-all token dispatcher and the gather it counts tokens with, on CPU."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = "cpu"  # not None: its constructor then makes no CUDA stream

    def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, name)
                if torch.is_tensor(value):
                    setattr(self, name, value.tolist())
        return tokens_per_expert

    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _maybe_dtoh_and_synchronize

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        world_size = group.size()
        if world_size == 1:
            return input_
        sizes = output_split_sizes or [input_.shape[0]] * world_size
        pieces = [input_.new_empty((size, *input_.shape[1:])) for size in sizes]
        dist.all_gather(pieces, input_.contiguous(), group=group)
        return torch.cat(pieces, dim=0)

    mappings._gather_along_first_dim = _gather_along_first_dim
