"""How packed rows attend (trainer/packing.py): one visibility rule over the rows' segment ids, two kernels.

A packed row holds several sequences; per position it carries the prompt occurrence it belongs to (`prompt_of`)
and the item whose completion it is (`own`, -1 for a prompt token, PADDING for padding). A position sees the
earlier positions of its prompt occurrence that are the prompt or its own completion (`sees`); padding sees
only itself (a softmax needs one visible key, and nothing more keeps the padding tail's blocks empty).

    kind    kernel                                            memory kept for backward, per layer
    dense   megatron's DotProductAttention over a [rows, 1,   ~6 bytes per score: the fp32 softmax and its
            s, s] bool mask built from the ids on the device  low-precision copy ([rows, heads, s, s])
    flex    torch FlexAttention with a BlockMask built from   q, k, v, the output and one fp32 logsumexp per
            the same ids (`flex_block_mask`)                  query and head: no score matrix

'dense' is the CPU twin's kernel (FlexAttention has no backward on CPU in torch 2.13); 'flex' replaces each
layer's `core_attention` (`FlexCoreAttention`) and is the default on CUDA.

The flex path on CUDA runs flex_attention compiled (`FlexKernel`): uncompiled, FlexAttention materialises the
scores. Packed micro-batches change rows and width every step, and dynamo compiles a graph per shape class it
cannot generalise, up to its recompile limit (8 per function); with fullgraph, one more raises. So:
- the kernel sees few shape classes: micro-batches are packed in whole blocks, at least two rows of at least two
  blocks (`flex_shape`: dynamo specialises any size of 1, one row or a one-block row, into a graph of its own);
  every size is dynamic, duck sizing off (a row count equal to the head count would be specialised with it);
- the block mask is built from the ids a chunk of query blocks at a time (`flex_block_mask`): no
  [rows, width, width] tensor, no compile;
- a call whose compile fails (recompile limit, a backend error) runs SDPA over the dense mask instead, logged
  once per kind of failure and counted (`FlexKernel.fallbacks`): a slower call, never a failed task.
On CPU the kernel runs eagerly (forward only), which is what the tests compare with the dense path; the tests
and tools/flex_compiles.py compile it on CPU through the `aot_eager` backend to count its graphs.
"""
from __future__ import annotations

import functools
import logging
import warnings
from contextlib import contextmanager
from typing import Iterator

import torch

ATTENTION_KINDS = ("auto", "dense", "flex")
"""`trainer.attention`: 'auto' = flex on CUDA, dense on CPU."""
PADDING = -2
"""`own` of a padding position (a prompt token has -1, a completion token its item index >= 0)."""
FLEX_BLOCK = 128
"""FlexAttention's sparse block (torch's default): the unit of work a block mask skips or computes. Rows on the
flex path are at least this wide (`min_row_tokens`), so short sequences share a block instead of each padding one."""
MASK_CHUNK_ELEMENTS = 1 << 24
"""Booleans of the visibility rule evaluated at once while building a block mask (16 MiB, ~5x that transient)."""
log = logging.getLogger(__name__)


def resolve_attention(kind: str, device: torch.device) -> str:
    """'dense' or 'flex' for a `trainer.attention` value on this device."""
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {kind!r}")
    if kind == "auto":
        return "flex" if device.type == "cuda" else "dense"
    return kind


def min_row_tokens(kind: str) -> int:
    """The narrowest packed row for an attention kernel: 32 tokens on the dense path (the CPU twin's rows), two
    FlexAttention blocks on the flex path (a row narrower than a block still costs a whole block, and dynamo
    specialises a block count of 1 into a graph of its own)."""
    return 2 * FLEX_BLOCK if kind == "flex" else 32


def row_multiple(kind: str) -> int:
    """Packed rows' widths are a multiple of this: whole blocks on the flex path (the kernel's shape, `flex_shape`,
    without a padding copy), any width on the dense path."""
    return FLEX_BLOCK if kind == "flex" else 1


def min_rows(kind: str) -> int:
    """The fewest rows of a packed micro-batch: two on the flex path (dynamo specialises a row count of 1; the
    second row is padding, which attends to itself only), one on the dense path."""
    return 2 if kind == "flex" else 1


def row_width(kind: str, tokens: int) -> int:
    """What a sequence of `tokens` takes in a micro-batch's budget: on the flex path the width of its packed row
    (whole blocks, at least `min_row_tokens`); on the dense path its own length."""
    if kind != "flex":
        return tokens
    return max(min_row_tokens(kind), -(-tokens // FLEX_BLOCK) * FLEX_BLOCK)


def flex_shape(rows: int, width: int) -> tuple[int, int]:
    """(rows, width) the compiled kernel runs a call at: what the trainer packs on the flex path (`min_rows`,
    `row_width`), and what FlexCoreAttention pads other calls to (unpacked rows: `MultiLoraTrainer.logits`)."""
    return max(min_rows("flex"), rows), row_width("flex", width)


def sees(q_index, kv_index, prompt_q, prompt_kv, own_q, own_kv):
    """The visibility rule, elementwise: True where query position q attends to key position kv of its row."""
    same_sequence = (prompt_q == prompt_kv) & ((own_kv == -1) | (own_kv == own_q))
    real = (kv_index <= q_index) & same_sequence & (own_q != PADDING)
    return real | ((own_q == PADDING) & (kv_index == q_index))


def dense_mask(prompt_of: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """[rows, 1, s, s] bool, True = masked out (megatron's convention), on the ids' device."""
    index = torch.arange(prompt_of.shape[1], device=prompt_of.device)
    visible = sees(index.view(1, -1, 1), index.view(1, 1, -1), prompt_of.unsqueeze(2), prompt_of.unsqueeze(1),
                   own.unsqueeze(2), own.unsqueeze(1))
    return (~visible).unsqueeze(1)


def pad_segments(prompt_of: torch.Tensor, own: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids padded to `flex_shape`: the added positions and rows are padding (each sees only itself)."""
    rows, width = prompt_of.shape
    padded_rows, padded_width = flex_shape(rows, width)
    if (padded_rows, padded_width) == (rows, width):
        return prompt_of, own
    grow = (0, padded_width - width, 0, padded_rows - rows)
    return (torch.nn.functional.pad(prompt_of, grow, value=-1),
            torch.nn.functional.pad(own, grow, value=PADDING))


def flex_block_mask(prompt_of: torch.Tensor, own: torch.Tensor, chunk_elements: int = MASK_CHUNK_ELEMENTS):
    """FlexAttention BlockMask of rows whose width is a whole number of blocks (one mask for every head), on the
    ids' device: what torch's create_block_mask builds, without its [rows, width, width] bool tensor. The rule
    is evaluated for a chunk of query blocks at a time (at most `chunk_elements` booleans, at least one block)
    and reduced to each (row, query block, key block)'s partial or full state."""
    from torch.nn.attention.flex_attention import BlockMask

    rows, width = prompt_of.shape
    if width % FLEX_BLOCK:
        raise ValueError(f"rows of {width} tokens: a block mask needs a multiple of {FLEX_BLOCK} (pad_segments)")
    blocks = width // FLEX_BLOCK
    per_chunk = max(1, chunk_elements // (rows * FLEX_BLOCK * width))
    key = torch.arange(width, device=prompt_of.device)
    partial, full = [], []
    for first in range(0, blocks, per_chunk):
        query = key[first * FLEX_BLOCK: min(blocks, first + per_chunk) * FLEX_BLOCK]
        visible = sees(query.view(1, -1, 1), key.view(1, 1, -1), prompt_of[:, query].unsqueeze(2),
                       prompt_of.unsqueeze(1), own[:, query].unsqueeze(2), own.unsqueeze(1))
        tiles = visible.view(rows, -1, FLEX_BLOCK, blocks, FLEX_BLOCK)
        any_visible, all_visible = tiles.any(dim=4).any(dim=2), tiles.all(dim=4).all(dim=2)
        partial.append(any_visible & ~all_visible)
        full.append(all_visible)

    def mask_mod(b, h, q_index, kv_index):
        return sees(q_index, kv_index, prompt_of[b, q_index], prompt_of[b, kv_index], own[b, q_index],
                    own[b, kv_index])

    counts, indices = _ordered(torch.cat(partial, dim=1))
    full_counts, full_indices = _ordered(torch.cat(full, dim=1))
    return BlockMask.from_kv_blocks(counts, indices, full_counts, full_indices, BLOCK_SIZE=FLEX_BLOCK,
                                    mask_mod=mask_mod, seq_lengths=(width, width))


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, q blocks, kv blocks] bool -> BlockMask's (count, indices) per query block, the listed key blocks
    first in ascending order, with a head dimension of 1 (what create_block_mask stores)."""
    as_int = blocks.to(torch.int32).unsqueeze(1)
    indices = torch.argsort(as_int, dim=-1, descending=True, stable=True)
    return as_int.sum(dim=-1, dtype=torch.int32), indices.to(torch.int32)


def _attend(query, key, value, block_mask, scale, enable_gqa):
    """What FlexKernel compiles: a function of this module, so its graphs and its recompile count are the
    trainer's alone (dynamo keeps them per code object; torch's own flex_attention may be compiled by others)."""
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)


def _compile_failures() -> tuple[type[BaseException], ...]:
    """Errors of compiling a call (not of running it: an out-of-memory error still raises)."""
    from torch._dynamo import exc

    names = ("FailOnRecompileLimitHit", "FailOnCacheLimitHit")  # the second: older torch's name
    return (exc.TorchDynamoException, *(getattr(exc, n) for n in names if hasattr(exc, n)))


class CompileCounter:
    """A torch.compile backend that counts the graphs dynamo hands it (one per compile id: a frame dynamo
    restarts is one graph) and compiles each with `backend`."""

    def __init__(self, backend: str):
        self.backend = backend
        self.compile_ids: set[tuple[int, int]] = set()

    @property
    def compiles(self) -> int:
        return len(self.compile_ids)

    def __call__(self, graph, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend
        from torch._guards import CompileContext

        compile_id = CompileContext.current_compile_id()
        self.compile_ids.add((compile_id.frame_id, compile_id.frame_compile_id) if compile_id else
                             (-1, len(self.compile_ids)))
        return lookup_backend(self.backend)(graph, example_inputs)


class FlexKernel:
    """flex_attention for the flex path, called as flex_attention is (q, k, v [rows, heads, s, head_dim],
    `block_mask`, `scale`, `enable_gqa`); rows and width must be `flex_shape`'s (FlexCoreAttention pads them).

    `backend` None runs it eagerly; otherwise it is compiled (fullgraph: a graph break raises, nothing runs
    half-compiled) with every size dynamic and duck sizing off. `compiles` counts the graphs dynamo built;
    a call whose compile fails runs `sdpa_fallback` and adds one to `fallbacks`, logged once per kind of failure.
    """

    def __init__(self, backend: str | None):
        self.backend = backend
        self.counter = None if backend is None else CompileCounter(backend)
        self.fallbacks = 0
        self._logged: set[str] = set()
        self._compiled = None if backend is None else torch.compile(_attend, backend=self.counter, dynamic=True,
                                                                    fullgraph=True)

    @property
    def compiles(self) -> int:
        return 0 if self.counter is None else self.counter.compiles

    def stats(self) -> dict:
        return {"backend": self.backend, "compiles": self.compiles, "fallbacks": self.fallbacks}

    def __call__(self, query, key, value, *, block_mask, scale, enable_gqa):
        if self._compiled is None:
            with warnings.catch_warnings():  # eager on CPU by design (forward-only twin): not a performance bug
                warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
                return _attend(query, key, value, block_mask, scale, enable_gqa)
        from torch.fx.experimental import _config as shape_config

        try:
            with shape_config.patch(use_duck_shape=False):
                return self._compiled(query, key, value, block_mask, scale, enable_gqa)
        except _compile_failures() as error:
            self._note_fallback(error, tuple(query.shape))
            return sdpa_fallback(query, key, value, block_mask, scale, enable_gqa)

    def _note_fallback(self, error: BaseException, shape: tuple[int, ...]) -> None:
        self.fallbacks += 1
        kind = type(error).__name__
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("FlexAttention (%s) could not compile a call of shape %s (%s: %s); this call and any "
                        "other that fails so run SDPA over a dense [rows, 1, s, s] mask instead (%d graphs "
                        "compiled so far)", self.backend, list(shape), kind, str(error).splitlines()[0][:200],
                        self.compiles)


def sdpa_fallback(query, key, value, block_mask, scale, enable_gqa):
    """The same attention through torch's scaled_dot_product_attention over the dense mask of `block_mask`'s rule
    (rows x s x s booleans; the memory-efficient kernel takes it on CUDA, without a score matrix kept for
    backward). GQA heads are repeated for it: not every SDPA kernel takes enable_gqa with a mask."""
    from torch.nn.attention.flex_attention import create_mask

    rows, _, width, _ = query.shape
    visible = create_mask(block_mask.mask_mod, rows, None, width, width, device=query.device)
    if enable_gqa and key.shape[1] != query.shape[1]:
        repeat = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=visible, scale=scale)


@functools.cache
def flex_kernel(device_type: str) -> FlexKernel:
    """The process's FlexKernel for a device type: compiled by inductor on CUDA, eager elsewhere."""
    return FlexKernel("inductor" if device_type == "cuda" else None)


class FlexCoreAttention(torch.nn.Module):
    """Drop-in for megatron's DotProductAttention (same arguments, same [sq, b, heads x head_dim] output) that
    attends through FlexAttention with the block mask its `RowAttention` holds for the current forward."""

    def __init__(self, replaced: torch.nn.Module, rows: "RowAttention"):
        super().__init__()
        self.softmax_scale = float(replaced.softmax_scale)
        self.heads = replaced.num_attention_heads_per_partition
        self.groups = replaced.num_query_groups_per_partition
        self._rows = [rows]  # a list: not a submodule of the model

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None or packed_seq_params is not None:
            raise NotImplementedError("FlexCoreAttention takes neither an attention bias nor packed_seq_params")
        rows = self._rows[0]
        if rows.block_mask is None:
            raise RuntimeError("no block mask: run the model inside RowAttention.use")
        width, batch = query.shape[:2]
        padded_rows, padded_width = rows.block_mask.kv_num_blocks.shape[0], rows.block_mask.seq_lengths[0]
        # megatron's [s, b, heads, dim] -> FlexAttention's [b, heads, s, dim]; packed micro-batches come in the
        # kernel's shape already (the pad copies, and dynamo guards a view's base: a padded call is another graph)
        grow = (0, 0, 0, 0, 0, padded_rows - batch, 0, padded_width - width)
        q, k, v = ((torch.nn.functional.pad(t, grow) if any(grow) else t).permute(1, 2, 0, 3)
                   for t in (query, key, value))
        out = rows.kernel_for(q.device.type)(q, k, v, block_mask=rows.block_mask, scale=self.softmax_scale,
                                             enable_gqa=self.heads != self.groups)
        out = out[:batch, :, :width]
        return out.permute(2, 0, 1, 3).reshape(width, batch, -1)


class RowAttention:
    """The attention kernel of one trainer's model and the mask of its current forward.

    `mask(prompt_of, own)` builds a micro-batch's mask once; `use(mask)` holds it over a forward and, when
    training, its backward (activation recompute re-runs the attention inside backward) and yields what the
    model's `attention_mask` argument gets: the dense mask, or None on the flex path (the layers read it here).
    `kernel` is the flex path's FlexKernel (None: the process's, `flex_kernel`).
    """

    def __init__(self, model: torch.nn.Module, kind: str, kernel: FlexKernel | None = None):
        if kind not in ("dense", "flex"):
            raise ValueError(f"kernel must be 'dense' or 'flex', got {kind!r}")
        self.kind = kind
        self.kernel = kernel
        self.block_mask = None
        if kind == "flex":
            for layer in model.decoder.layers:
                attention = layer.self_attention
                attention.core_attention = FlexCoreAttention(attention.core_attention, self)

    def kernel_for(self, device_type: str):
        return self.kernel if self.kernel is not None else flex_kernel(device_type)

    def mask(self, prompt_of: torch.Tensor, own: torch.Tensor):
        if self.kind == "dense":
            return dense_mask(prompt_of, own)
        return flex_block_mask(*pad_segments(prompt_of, own))

    @contextmanager
    def use(self, mask) -> Iterator[torch.Tensor | None]:
        if self.kind == "dense":
            yield mask
            return
        previous, self.block_mask = self.block_mask, mask
        try:
            yield None
        finally:
            self.block_mask = previous


def causal_segments(rows: int, width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt_of, own) of unpacked rows: one sequence per row, every position a 'prompt' token (plain causal)."""
    return (torch.zeros(rows, width, dtype=torch.long, device=device),
            torch.full((rows, width), -1, dtype=torch.long, device=device))
