"""The flex path's compiled kernel and block mask (trainer/attention.py) on CPU, forward only (FlexAttention has no
backward on CPU in torch 2.13): over 30 varied packed micro-batches the kernel compiles a few graphs where the old
recipe hit dynamo's recompile limit and raised; a call that cannot compile runs SDPA instead, logged once, with the
same output; the block mask equals torch's create_block_mask without its [rows, width, width] tensor. The
compiled kernel runs through dynamo's `aot_eager` backend here (the guards and graphs inductor gets on CUDA)."""
from __future__ import annotations

import logging
import random
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from marlaas_hpc.trainer import attention
from marlaas_hpc.trainer.packing import pack
from marlaas_hpc.trajectory import Trajectory

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import flex_compiles  # noqa: E402

TINY_DIMS = ["--heads", "4", "--kv-heads", "2", "--head-dim", "32"]
"""The tiny model's attention: 4 query heads, 2 KV heads, head_dim 32."""


def test_old_recipe_hits_the_recompile_limit_and_the_kernel_stays_under_it():
    """The same 30 micro-batches, two calls each (without and with grad mode, as a training step makes them)."""
    old = flex_compiles.run(flex_compiles.parse(["--recipe", "old", "--device", "cpu", *TINY_DIMS]))
    new = flex_compiles.run(flex_compiles.parse(["--recipe", "new", "--device", "cpu", *TINY_DIMS]))
    print(f"graphs compiled: old {old['compiles']} ({old['error']}), new {new['compiles']}")
    assert old["error"] is not None and old["error"]["type"] == "FailOnRecompileLimitHit", old
    assert old["compiles"] == torch._dynamo.config.recompile_limit
    assert new["error"] is None and new["calls"] == 60 and new["fallbacks"] == 0, new
    assert new["compiles"] <= torch._dynamo.config.recompile_limit // 2, new
    assert new["max_abs_diff"] < 1e-6, new


def _flex_inputs(rows: int, width: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, 4, width, 32, generator=generator)
    k, v = (torch.randn(rows, 2, width, 32, generator=generator) for _ in range(2))
    return q, k, v


def _eager(q, k, v, block_mask):
    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(q, k, v, block_mask=block_mask, scale=0.2, enable_gqa=True)


def test_a_call_that_cannot_compile_runs_sdpa_logged_once(caplog):
    """With a recompile limit of 1, grad mode on after a call without it is a second graph dynamo refuses: the
    kernel answers those calls through SDPA over the dense mask (same output), counts them, warns once."""
    torch._dynamo.reset()
    prompt_of, own = _segments(rows=3, seed=4)
    block_mask = attention.flex_block_mask(*attention.pad_segments(prompt_of, own))
    rows, width = block_mask.kv_num_blocks.shape[0], block_mask.seq_lengths[0]
    with flex_compiles.dynamo_enabled(), torch._dynamo.config.patch(recompile_limit=1), \
            caplog.at_level(logging.WARNING, attention.log.name):
        kernel = attention.FlexKernel("aot_eager")
        outputs = []
        for grad in (False, True, True):
            q, k, v = _flex_inputs(rows, width, seed=len(outputs))
            with torch.set_grad_enabled(grad):
                out = kernel(q, k, v, block_mask=block_mask, scale=0.2, enable_gqa=True)
            outputs.append((out, _eager(q, k, v, block_mask)))
    assert (kernel.compiles, kernel.fallbacks) == (1, 2)
    for out, reference in outputs:
        assert float((out - reference).abs().max()) < 1e-5
    warnings_logged = [r for r in caplog.records if r.name == attention.log.name]
    assert len(warnings_logged) == 1 and "FailOnRecompileLimitHit" in warnings_logged[0].getMessage()


def _segments(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed rows' ids (several prompts a row, shared prompts, padding) in whole blocks."""
    rng = random.Random(seed)
    items = []
    for group in range(rows * 2):
        prompt = [rng.randrange(3, 100) for _ in range(rng.randint(2, 30))]
        for sample in range(rng.randint(1, 3)):
            length = 300 if group == sample == 0 else rng.randint(1, 150)  # rows of 3 blocks at least
            completion = [rng.randrange(3, 100) for _ in range(length)]
            items.append(("t", Trajectory("t", f"g{group}", prompt, completion, [0.0] * len(completion), 0)))
    batch = pack(items, attention.FLEX_BLOCK, 0, width_multiple=attention.FLEX_BLOCK)
    return batch.prompt_of, batch.own


class _LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op returned inside the mode."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out


@pytest.mark.parametrize("rows,seed,chunk", [(2, 1, attention.MASK_CHUNK_ELEMENTS), (5, 2, 1), (3, 3, 200_000)])
def test_block_mask_is_torchs_without_a_dense_tensor(rows, seed, chunk):
    """Block by block the same partial and full blocks as create_block_mask, in the same order, whether built in
    one chunk or a query block at a time; no tensor larger than the chunk (or one query block's), so none of
    create_block_mask's rows x width x width once the rows outgrow a chunk."""
    from torch.nn.attention.flex_attention import create_block_mask

    prompt_of, own = attention.pad_segments(*_segments(rows, seed))
    rows, width = prompt_of.shape
    assert width >= 3 * attention.FLEX_BLOCK, "several query blocks"
    with _LargestTensor() as largest:
        ours = attention.flex_block_mask(prompt_of, own, chunk_elements=chunk)
    one_block = rows * attention.FLEX_BLOCK * width  # the rule's booleans for one query block
    assert largest.largest <= max(chunk, one_block)
    if chunk < rows * width * width:
        assert largest.largest < rows * width * width
    reference = create_block_mask(ours.mask_mod, rows, None, width, width, BLOCK_SIZE=attention.FLEX_BLOCK)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                 "q_indices", "full_q_num_blocks", "full_q_indices"):
        assert torch.equal(getattr(ours, name), getattr(reference, name)), name
    assert int(ours.full_kv_num_blocks.sum()) > 0 and int(ours.kv_num_blocks.sum()) > 0
    assert ours.seq_lengths == (width, width)


def test_kernel_shapes_leave_no_size_of_one():
    assert attention.flex_shape(1, 5) == (2, 2 * attention.FLEX_BLOCK)
    assert attention.flex_shape(3, 129) == (3, 2 * attention.FLEX_BLOCK)
    assert attention.flex_shape(7, 640) == (7, 640)
    prompt_of, own = attention.pad_segments(torch.zeros(1, 5, dtype=torch.long), torch.full((1, 5), -1))
    assert prompt_of.shape == own.shape == (2, 256)
    assert bool((own[1] == attention.PADDING).all()) and bool((own[0, 5:] == attention.PADDING).all())
    with pytest.raises(ValueError, match="multiple of 128"):
        attention.flex_block_mask(torch.zeros(2, 200, dtype=torch.long), torch.full((2, 200), -1))
