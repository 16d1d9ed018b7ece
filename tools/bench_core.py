"""Learning-core benchmark: rollout tokens/s (vLLM vs HF engine) and GRPO train-step time at TP=1 and TP=2.

    python tools/bench_core.py [--prompts 64] [--tokens 16] [--steps 5]

Figures are measured in this run on this machine (2 CPU cores here); ratios are within the run.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _trajectories(codec, n: int, tokens: int, task_id: str, seed: int = 0):
    from marlaas_hpc.trajectory import Trajectory

    rng = random.Random(seed)
    out = []
    for i in range(n):
        completion = [rng.randint(4, 99) for _ in range(tokens - 1)] + [codec.eos_id]
        out.append(Trajectory(task_id, f"g{i // 8}", codec.encode_prompt(f"{i}+{i}="), completion,
                              [-1.0] * tokens, 0, reward=float(i % 2), advantage=float(i % 2) - 0.5))
    return out


def rollout_tokens_per_s(kind: str, model_path, prompts: int, tokens: int, work_dir: str) -> dict:
    from marlaas_hpc.model import TextCodec
    from marlaas_hpc.rollout import GenerationRequest, make_engine

    codec = TextCodec.from_pretrained(model_path)
    from marlaas_hpc.model.cache import default_cache_dir

    kwargs = {"work_dir": work_dir, "cache_dir": default_cache_dir() / "vllm", "max_loras": 2,
              "max_lora_rank": 8} if kind == "vllm" else {}
    start = time.perf_counter()
    engine = make_engine(kind, model_path, seed=0, **kwargs)
    startup = time.perf_counter() - start
    rates = []
    for round_index in range(3):
        requests = [GenerationRequest(f"{kind}-{round_index}-{i}", "bench", None, codec.encode_prompt(f"{i % 90 + 10}+{i % 7 + 2}="),
                                      1.0, tokens, seed=i) for i in range(prompts)]
        t0 = time.perf_counter()
        gens = engine.generate(requests)
        elapsed = time.perf_counter() - t0
        rates.append(sum(len(g.completion_ids) for g in gens) / elapsed)
    engine.close()
    return {"engine": kind, "startup_s": startup, "tokens_per_s": statistics.median(rates)}


def _train_worker(rank: int, model_path: str, tp: int, n: int, tokens: int, steps: int):
    from marlaas_hpc.model import TextCodec
    from marlaas_hpc.tasks import AlgoSpec, LoraSpec
    from marlaas_hpc.trainer.trainer import MultiLoraTrainer, TrainerConfig

    trainer = MultiLoraTrainer(TrainerConfig(model_path=model_path, tensor_parallel=tp))
    trainer.add_task("bench", LoraSpec(rank=8, alpha=16), AlgoSpec())
    trajs = _trajectories(TextCodec.from_pretrained(model_path), n, tokens, "bench")
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        trainer.train_step("bench", trajs)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])  # the first step pays one-off allocations


def train_step_s(model_path, tp: int, n: int, tokens: int, steps: int) -> float:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/support/
    from support.local_group import run_local

    return run_local(_train_worker, tp, str(model_path), tp, n, tokens, steps, timeout=900)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    from marlaas_hpc.tiny_model import ensure_tiny_model

    model_path = ensure_tiny_model()
    print(f"model {model_path.name}: {args.prompts} prompts x <= {args.tokens} tokens, sampling T=1")
    for kind in ("hf", "vllm"):
        with tempfile.TemporaryDirectory() as work:
            r = rollout_tokens_per_s(kind, model_path, args.prompts, args.tokens, work)
        print(f"rollout {r['engine']:>5}: {r['tokens_per_s']:8.0f} tokens/s (engine start {r['startup_s']:.1f} s)")
    step = {tp: train_step_s(model_path, tp, args.prompts, args.tokens, args.steps) for tp in (1, 2)}
    for tp, seconds in step.items():
        print(f"train step TP={tp}: {seconds * 1000:7.1f} ms ({args.prompts} trajectories x {args.tokens} tokens)")
    print(f"TP=2 / TP=1 step time: {step[2] / step[1]:.2f}x (gloo on CPU: communication, no speed-up expected)")


if __name__ == "__main__":
    main()
