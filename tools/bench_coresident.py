"""How much two rollout engines resident on one device slow each other: the `interference` of the simulator's
co-resident rows (tools/studies/coresident.py, issue #28), measured instead of assumed.

    python tools/bench_coresident.py [--engine vllm|hf] [--model PATH|random:SHAPE] [--batch 1 32 256]
                                     [--new-tokens 128] [--gpu-memory-utilization 0.35] [--cuda-graphs]
                                     [--json PATH]

Two processes each build one engine of the model (on a GPU each is a CUDA context of its own, as two models'
engine cores are under `vllm.engine_process: own`), then, per batch size, decode `--batch` rows of exactly
`--new-tokens` tokens (ignore_stop): engine A alone, engine B alone, then both at once (a barrier starts them
together). Printed per batch: each run's seconds and the interference s = (A's time beside B - A alone) / B alone,
the share of the other engine's work an engine waited for (0: perfect overlap; 1: none, the two ran one after
the other), and the same for B. The simulator's rows take one s for every batch; read the figure at the batch
sizes a job's engines hold. On this CPU machine the two engines compete for the same cores, so s is near 1 and
says nothing about a GPU: run it on one (tools/gpu_battery.sh, step coresident).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PHASES = ("A alone", "B alone", "both")


def _requests(batch: int, new_tokens: int, tag: str):
    from marlaas_hpc.rollout import GenerationRequest

    # distinct prompts of 32 tokens, fixed lengths: the two runs of a phase decode the same shapes
    return [GenerationRequest(f"{tag}-{i}", "base", None, [(7 * i + j) % 1000 + 10 for j in range(32)],
                              temperature=1.0, max_new_tokens=new_tokens, seed=i, ignore_stop=True)
            for i in range(batch)]


def _engine(args, name: str, work_dir: str):
    from marlaas_hpc.rollout import make_engine

    if args.engine == "hf":
        import torch

        return make_engine("hf", args.model, device="cuda" if torch.cuda.is_available() else "cpu")
    return make_engine("vllm", args.model, work_dir=Path(work_dir) / name, dtype=args.dtype,
                       gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=not args.cuda_graphs,
                       max_num_seqs=max(args.batch), max_model_len=32 + args.new_tokens + 16)


def _quiet() -> None:
    """A job's rollout rank hides these library notices (runtime/quiet.py, VLLM_LOGGING_LEVEL): so does the bench."""
    from marlaas_hpc.runtime.quiet import silence_library_notices

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    silence_library_notices()


def _worker(args, name: str, work_dir: str, barrier, results) -> None:
    """One engine: built, warmed up, then for each batch size the three phases (it runs in its own and in 'both')."""
    _quiet()
    engine = _engine(args, name, work_dir)
    engine.generate(_requests(2, 4, f"{name}-warm"))
    barrier.wait()
    for batch in args.batch:
        for phase in PHASES:
            barrier.wait()
            if phase in (f"{name} alone", "both"):
                start = time.perf_counter()
                engine.generate(_requests(batch, args.new_tokens, f"{name}-{batch}-{phase}"))
                results.put((batch, phase, name, time.perf_counter() - start))
            barrier.wait()


def measure(args) -> dict[tuple[int, str, str], float]:
    """{(batch, phase, engine): seconds}."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    with tempfile.TemporaryDirectory() as work_dir:
        workers = [ctx.Process(target=_worker, args=(args, name, work_dir, barrier, results)) for name in "AB"]
        for worker in workers:
            worker.start()
        out = {}
        expected = 4 * len(args.batch)  # per batch: A alone, B alone, and both in 'both'
        while len(out) < expected:
            if not all(w.is_alive() for w in workers) and results.empty():
                codes = [w.exitcode for w in workers]
                raise SystemExit(f"an engine process ended early (exit codes {codes})")
            try:
                batch, phase, name, seconds = results.get(timeout=1.0)
            except Exception:  # queue.Empty: look at the workers again
                continue
            out[(batch, phase, name)] = seconds
        for worker in workers:
            worker.join()
    return out


def interference(times: dict, batch: int) -> tuple[float, float]:
    """(s of A, s of B) at `batch`: the extra time beside the other, over the other's time alone."""
    a, b = times[(batch, "A alone", "A")], times[(batch, "B alone", "B")]
    return (times[(batch, "both", "A")] - a) / b, (times[(batch, "both", "B")] - b) / a


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("vllm", "hf"), default="vllm")
    parser.add_argument("--model", default=None, help="checkpoint dir or random:SHAPE (default: the tiny model on "
                                                      "CPU, random:qwen3-0.6b on a GPU)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32, 256], help="rows each engine decodes")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default=None, help="vllm: default bfloat16 on a GPU, float32 on CPU")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.35, help="vllm on a GPU: each engine's")
    parser.add_argument("--cuda-graphs", action="store_true", help="vllm on a GPU: CUDA graphs (enforce_eager off)")
    parser.add_argument("--json", type=Path, help="write the times and interference figures there too")
    args = parser.parse_args()
    _quiet()
    import torch

    on_gpu = torch.cuda.is_available()
    args.model = resolve_model(args.model)
    args.dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    device = torch.cuda.get_device_name() if on_gpu else "CPU"
    print(f"two {args.engine} engines of {args.model} on one {device}; {args.new_tokens} new tokens per row")
    start = time.perf_counter()
    times = measure(args)
    print(f"{'batch':>6} | {'A alone s':>9} | {'B alone s':>9} | {'A beside B':>10} | {'B beside A':>10} | "
          f"{'s (A)':>6} | {'s (B)':>6}")
    for batch in args.batch:
        s_a, s_b = interference(times, batch)
        print(f"{batch:>6} | {times[(batch, 'A alone', 'A')]:>9.3f} | {times[(batch, 'B alone', 'B')]:>9.3f} | "
              f"{times[(batch, 'both', 'A')]:>10.3f} | {times[(batch, 'both', 'B')]:>10.3f} | {s_a:>6.2f} | "
              f"{s_b:>6.2f}")
    print(f"({time.perf_counter() - start:.1f} s wall, engine starts included)")
    if args.json:
        rows = [{"batch": batch, **{f"{phase} {name}": times[(batch, phase, name)] for phase, name in
                                    (("A alone", "A"), ("B alone", "B"), ("both", "A"), ("both", "B"))},
                 "interference": dict(zip("AB", interference(times, batch)))} for batch in args.batch]
        args.json.write_text(json.dumps({"engine": args.engine, "model": args.model, "device": device,
                                         "new_tokens": args.new_tokens, "rows": rows}, indent=1))


def resolve_model(model: str | None) -> str:
    """A checkpoint directory for --model: random:SHAPE built once into the cache; by default the tiny model on
    CPU, random:qwen3-0.6b on a GPU."""
    import torch

    from marlaas_hpc.model.random_checkpoints import RANDOM_PREFIX, ensure_random_checkpoint
    from marlaas_hpc.tiny_model import ensure_tiny_model

    model = model or ("random:qwen3-0.6b" if torch.cuda.is_available() else None)
    if model is None:
        return str(ensure_tiny_model())
    if model.startswith(RANDOM_PREFIX):
        return str(ensure_random_checkpoint(model[len(RANDOM_PREFIX):]))
    return model


if __name__ == "__main__":
    main()
