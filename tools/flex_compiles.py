"""How many graphs the trainer's compiled FlexAttention builds over varied packed micro-batches, and whether a call
ever fails: the count dynamo's recompile limit (torch._dynamo.config.recompile_limit, 8) bounds (issue #36 item 6/7).

    python tools/flex_compiles.py [--recipe new|old] [--steps 30] [--device cpu|cuda] [--backend aot_eager|inductor]
                                  [--heads H] [--kv-heads H] [--head-dim D] [--seed 0] [--check-every 1]
                                  [--json PATH]

Each step packs one micro-batch as the trainer does (trainer/packing.py: prompt groups of random lengths, 1 to 8
rows, a width that changes every step) and calls the kernel twice on it, as a training step does: once without
gradient (logprobs; the base model's and TIS's lagged logprobs; the first forward under activation recompute) and
once with (the training forward, and on CUDA its backward; FlexAttention has no backward on CPU, so there the
call runs in grad mode on inputs that need none: the same guard on grad mode).
- `--recipe new`: trainer/attention.py as the trainer runs it (micro-batches packed in `flex_shape`: whole blocks,
  at least two rows of two blocks; the chunked `flex_block_mask`; `FlexKernel`: dynamic sizes without duck
  sizing, SDPA for a call that cannot compile).
- `--recipe old`: what the trainer ran before: torch.compile(flex_attention, dynamic=True, fullgraph=True) over
  rows as wide as their longest item (at least one block) and torch's create_block_mask. Its first error ends
  the run.
Every output (every Nth: --check-every) is compared with uncompiled flex_attention on the same inputs. Prints the
graphs compiled, the calls that fell back, the error that ended the run (if any) and the largest difference from
the reference. The default
backend is inductor on CUDA, aot_eager on CPU (inductor's CPU FlexAttention template fails to build in C++ for a
dynamic row count under torch 2.13: such a call falls back). Needs torch only.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from marlaas_hpc.trainer import attention  # noqa: E402
from marlaas_hpc.trainer.packing import pack  # noqa: E402
from marlaas_hpc.trajectory import Trajectory  # noqa: E402


def micro_batches(steps: int, seed: int = 0, longest: int = 300) -> list[tuple[int, list]]:
    """Per step (seed, items): 1 to 6 prompt groups of 1 to 4 samples; completions of 1 to `longest` tokens, so rows
    (1 to ~10) and widths change from step to step, one row of one block now and then."""
    rng = random.Random(seed)
    out = []
    for step in range(steps):
        items = []
        for group in range(rng.randint(1, 6)):
            prompt = [rng.randrange(3, 100) for _ in range(rng.randint(2, 40))]
            longest_here = rng.choice([40, 120, longest])
            for _ in range(rng.randint(1, 4)):
                completion = [rng.randrange(3, 100) for _ in range(rng.randint(1, longest_here))]
                items.append(("t", Trajectory("t", f"s{step}/g{group}", prompt, completion, [0.0] * len(completion),
                                              0)))
        out.append((rng.randrange(1 << 30), items))
    return out


def _old_block_mask(prompt_of, own):
    """The trainer's block mask before: torch's create_block_mask over rows of any width (rows x width^2 bools)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_index, kv_index):
        return attention.sees(q_index, kv_index, prompt_of[b, q_index], prompt_of[b, kv_index], own[b, q_index],
                              own[b, kv_index])

    rows, width = prompt_of.shape
    return create_block_mask(mask_mod, rows, None, width, width, device=prompt_of.device,
                             BLOCK_SIZE=attention.FLEX_BLOCK)


class OldKernel:
    """The old recipe behind FlexKernel's interface, its graphs counted the same way."""

    def __init__(self, backend: str):
        from torch.nn.attention.flex_attention import flex_attention

        self.counter = attention.CompileCounter(backend)
        self.fallbacks = 0
        self._compiled = torch.compile(flex_attention, backend=self.counter, dynamic=True, fullgraph=True)

    @property
    def compiles(self) -> int:
        return self.counter.compiles

    def __call__(self, query, key, value, *, block_mask, scale, enable_gqa):
        return self._compiled(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)


def _inputs(args, rows: int, width: int, seed: int, grad: bool):
    generator = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    shapes = [(rows, args.heads, width, args.head_dim)] + [(rows, args.kv_heads, width, args.head_dim)] * 2
    return [torch.randn(shape, generator=generator).to(args.device, dtype).requires_grad_(grad) for shape in shapes]


def _call(kernel, args, block_mask, seed: int, grad: bool, check: bool) -> float:
    """One call (and its backward on CUDA, in grad mode); with `check`, against the uncompiled reference: the
    largest |difference|."""
    from torch.nn.attention.flex_attention import flex_attention

    rows, width = block_mask.kv_num_blocks.shape[0], block_mask.seq_lengths[0]
    needs_grad = grad and args.device == "cuda"
    inputs = _inputs(args, rows, width, seed, needs_grad)
    call = {"block_mask": block_mask, "scale": args.head_dim ** -0.5, "enable_gqa": args.heads != args.kv_heads}
    with torch.set_grad_enabled(grad):
        out = kernel(*inputs, **call)
        if needs_grad:
            out.float().sum().backward()
    if not check:
        return 0.0
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        reference = flex_attention(*[t.detach() for t in inputs], **call)
    return float((out.detach().float() - reference.float()).abs().max())


@contextmanager
def dynamo_enabled() -> Iterator[None]:
    """torch.compile on inside: a trainer built on CPU in this process turned it off (trainer/cpu_shims.py
    `eager_on_cpu`: the variable torch.compile reads when it wraps a function, and dynamo's config)."""
    switch = os.environ.pop("TORCHDYNAMO_DISABLE", None)
    try:
        with torch._dynamo.config.patch(disable=False):
            yield
    finally:
        if switch is not None:
            os.environ["TORCHDYNAMO_DISABLE"] = switch


def run(args) -> dict:
    """The figures of one recipe over `args.steps` micro-batches (see the module docstring)."""
    with dynamo_enabled():
        return _run(args)


def _run(args) -> dict:
    torch._dynamo.reset()  # a count of this run's graphs alone
    new = args.recipe == "new"
    kernel = attention.FlexKernel(args.backend) if new else OldKernel(args.backend)
    calls, worst, error, start = 0, 0.0, None, time.perf_counter()
    for step, (seed, items) in enumerate(micro_batches(args.steps, args.seed)):
        batch = pack(items, attention.min_row_tokens("flex"), 0, width_multiple=attention.row_multiple("flex"),
                     min_rows=attention.min_rows("flex")) if new else pack(items, attention.FLEX_BLOCK, 0)
        ids = (batch.prompt_of.to(args.device), batch.own.to(args.device))
        block_mask = attention.flex_block_mask(*attention.pad_segments(*ids)) if new else _old_block_mask(*ids)
        try:
            for grad in (False, True):
                check = calls % args.check_every == 0
                worst = max(worst, _call(kernel, args, block_mask, seed + grad, grad, check))
                calls += 1
        except Exception as exc:  # the old recipe's FailOnRecompileLimitHit: what the trainer leader saw
            error = {"step": step, "grad": grad, "type": type(exc).__name__, "message": str(exc).splitlines()[0]}
            break
    return {"recipe": args.recipe, "backend": args.backend, "device": args.device, "steps": args.steps,
            "calls": calls, "checked": -(-calls // args.check_every), "compiles": kernel.compiles,
            "fallbacks": kernel.fallbacks, "error": error, "max_abs_diff": worst,
            "recompile_limit": torch._dynamo.config.recompile_limit,
            "dims": [args.heads, args.kv_heads, args.head_dim], "seconds": time.perf_counter() - start}


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", choices=("new", "old"), default="new")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    parser.add_argument("--backend", default=None, help="default: inductor on CUDA, aot_eager on CPU")
    parser.add_argument("--heads", type=int, default=None, help="query heads (default: Qwen3-0.6B's 16 on CUDA, the "
                                                                  "tiny model's 4 on CPU)")
    parser.add_argument("--kv-heads", type=int, default=None, help="default: 8 on CUDA, 2 on CPU")
    parser.add_argument("--head-dim", type=int, default=None, help="default: 128 on CUDA, 32 on CPU")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check-every", type=int, default=1, help="compare every Nth call with the reference")
    parser.add_argument("--json", type=Path, help="write the figures there too")
    args = parser.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.backend = args.backend or ("inductor" if args.device == "cuda" else "aot_eager")
    dims = (16, 8, 128) if args.device == "cuda" else (4, 2, 32)
    args.heads, args.kv_heads, args.head_dim = (given or default for given, default in
                                                zip((args.heads, args.kv_heads, args.head_dim), dims))
    return args


def main(argv=None) -> int:
    args = parse(argv)
    figures = run(args)
    ended = "no error" if figures["error"] is None else \
        f"{figures['error']['type']} at step {figures['error']['step']}: {figures['error']['message']}"
    print(f"[flex_compiles] recipe {args.recipe}, {args.backend} on {args.device}: {figures['compiles']} graphs "
          f"compiled over {figures['calls']} calls of {args.steps} micro-batches (recompile limit "
          f"{figures['recompile_limit']}), {figures['fallbacks']} fell back to SDPA, {ended}; max |out - eager| "
          f"{figures['max_abs_diff']:.2e} ({figures['seconds']:.1f} s)")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
