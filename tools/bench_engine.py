"""One rollout engine's decode speed with seeded and unseeded requests, and what a sleep and a wake cost it.

    python tools/bench_engine.py [--engine vllm|hf] [--model PATH|random:SHAPE] [--batch 64] [--new-tokens 128]
                                 [--gpu-memory-utilization 0.4] [--switches 3] [--cpu-kv-cache-gib 0.0625]
                                 [--json PATH]

The engine is the one member of an EngineSet (rollout/engine_set.py), built as a rollout rank of several models
builds it (vLLM with sleep mode on a GPU). It decodes `--batch` rows of exactly `--new-tokens` tokens
(ignore_stop, temperature 1) twice: each request with its own seed (what rollout ranks send: seeded groups) and
without (the engine's generator); vLLM samples seeded requests with a generator per request. Then `--switches`
times: sleep, wake, and a greedy batch that must equal the one before the first sleep (a wake that lost the
weights shows here). On a GPU the device's free memory is read asleep and awake. Prints the figures and writes
them with --json.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _requests(batch: int, new_tokens: int, tag: str, seeded: bool, temperature: float = 1.0):
    from marlaas_hpc.rollout import GenerationRequest

    return [GenerationRequest(f"{tag}-{i}", "base", None, [(11 * i + j) % 1000 + 10 for j in range(32)],
                              temperature=temperature, max_new_tokens=new_tokens, seed=i if seeded else None,
                              ignore_stop=True) for i in range(batch)]


def _engine_set(args, work_dir: str):
    import torch

    from marlaas_hpc.rollout import make_engine
    from marlaas_hpc.rollout.engine_set import SLEEP_MODE_KWARGS, EngineSet

    on_gpu = torch.cuda.is_available()
    if args.engine == "hf":
        factory = lambda: make_engine("hf", args.model, device="cuda" if on_gpu else "cpu",  # noqa: E731
                                      dtype=torch.bfloat16 if on_gpu else torch.float32)
    else:
        kwargs = dict(dtype="bfloat16" if on_gpu else "float32", max_num_seqs=args.batch,
                      max_model_len=32 + args.new_tokens + 16, gpu_memory_utilization=args.gpu_memory_utilization,
                      **(SLEEP_MODE_KWARGS if on_gpu else {"kv_cache_gib": args.cpu_kv_cache_gib}))
        factory = lambda: make_engine("vllm", args.model, work_dir=Path(work_dir) / "engine", **kwargs)  # noqa: E731
    return EngineSet({"model": factory})


def _decode(engine, args, seeded: bool) -> dict:
    start = time.perf_counter()
    gens = engine.generate(_requests(args.batch, args.new_tokens, f"{'seeded' if seeded else 'unseeded'}", seeded))
    seconds = time.perf_counter() - start
    tokens = sum(len(g.completion_ids) for g in gens)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}


def _free_gib():
    import torch

    return torch.cuda.mem_get_info()[0] / 2**30 if torch.cuda.is_available() else None


def measure(args) -> dict:
    with tempfile.TemporaryDirectory() as work_dir:
        start = time.perf_counter()
        engines = _engine_set(args, work_dir)
        try:
            started = time.perf_counter() - start
            engine = engines.engine("model")
            engine.generate(_requests(2, 4, "warm", seeded=True))
            figures = {"engine": args.engine, "model": args.model, "start_s": started, "batch": args.batch,
                       "new_tokens": args.new_tokens, "seeded": _decode(engine, args, True),
                       "unseeded": _decode(engine, args, False)}
            figures.update(_sleep_wake(engines, args))
        finally:
            engines.close()
    return figures


def _sleep_wake(engines, args) -> dict:
    greedy = _requests(4, 8, "greedy", seeded=False, temperature=0.0)
    before = [g.completion_ids for g in engines.engine("model").generate(greedy)]
    sleeps, wakes, same, awake_free, asleep_free = [], [], True, _free_gib(), None
    for switch in range(args.switches):
        sleeps.append(engines.sleep("model"))
        asleep_free = _free_gib()
        wakes.append(engines.wake("model"))
        again = engines.engine("model").generate([_with_id(r, f"{r.request_id}-{switch}") for r in greedy])
        same = same and [g.completion_ids for g in again] == before
    return {"sleep_s": sleeps, "wake_s": wakes, "greedy_same_after_wake": same,
            "gpu_free_gib_awake": awake_free, "gpu_free_gib_asleep": asleep_free}


def _with_id(request, request_id: str):
    from dataclasses import replace

    return replace(request, request_id=request_id)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("vllm", "hf"), default="vllm")
    parser.add_argument("--model", default=None, help="checkpoint dir or random:SHAPE (default: the tiny model on "
                                                      "CPU, random:qwen3-0.6b on a GPU)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4, help="vllm on a GPU")
    parser.add_argument("--switches", type=int, default=3, help="sleep + wake rounds")
    parser.add_argument("--cpu-kv-cache-gib", type=float, default=0.0625, help="vllm on CPU: its fixed KV cache "
                                                                               "(a wake zeroes all of it)")
    parser.add_argument("--json", type=Path, help="write the figures there too")
    args = parser.parse_args()
    from bench_coresident import _quiet, resolve_model

    _quiet()
    args.model = resolve_model(args.model)
    figures = measure(args)
    seeded, unseeded = figures["seeded"], figures["unseeded"]
    print(f"[bench_engine] {args.engine} on {args.model}: start {figures['start_s']:.1f} s; {args.batch} rows x "
          f"{args.new_tokens} tokens: seeded {seeded['tokens_per_s']:.0f} tokens/s, unseeded "
          f"{unseeded['tokens_per_s']:.0f} tokens/s ({seeded['seconds'] / unseeded['seconds'] - 1:+.0%} time seeded)")
    print(f"[bench_engine] sleep {_ms(figures['sleep_s'])} ms, wake {_ms(figures['wake_s'])} ms; greedy output "
          f"{'unchanged' if figures['greedy_same_after_wake'] else 'CHANGED'} after wake; GPU free GiB awake "
          f"{figures['gpu_free_gib_awake']}, asleep {figures['gpu_free_gib_asleep']}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0 if figures["greedy_same_after_wake"] else 1


def _ms(seconds: list[float]) -> str:
    return "/".join(f"{s * 1000:.0f}" for s in seconds)


if __name__ == "__main__":
    sys.exit(main())
