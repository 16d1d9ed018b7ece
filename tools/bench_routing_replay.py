"""Routing replay on the CPU twin (issue #38 item 5): how far the fp32 trainer's logprobs are from the rollout
engine's at equal version, with and without replaying the rollout's experts.

    python tools/bench_routing_replay.py [--model random:qwen3-30b-a3b-mini] [--prompts 8] [--samples 4]
                                         [--tokens 24] [--dtypes bfloat16,float32]

For each rollout dtype, the `hf` engine (transformers, that dtype, on CPU) samples `samples` completions of each of
`prompts` random prompts at temperature 1 with the base model (version 0), recording every fed position's experts.
The trainer (megatron-core, fp32, TP=1) then takes one step of two tasks on the same trajectories, both at version 0
(their adapters start as the base model), one with `algo.routing_replay` and one without. Printed per dtype, from
the step's metrics: `logp_diff_abs`, the mean |log pi_trainer - log pi_rollout| per trained token, of each task;
`route_mismatch` of the replaying task, the share of trained tokens (the positions their logits come from) whose
trainer top k, in some MoE layer, differs from the experts the rollout chose. The same share without replay
(`route_mismatch_own`) compares the rollout's experts with the trainer's own choice over its own hidden states,
taken from transformers in fp32 (which the trainer equals to ~1e-6: tests/test_trainer_moe.py).
"""
from __future__ import annotations

import argparse
import random
import time
from dataclasses import replace

import numpy
import torch

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def sample(path, dtype: torch.dtype, prompts: list[list[int]], samples: int, tokens: int) -> list:
    """Trajectories of the engine's samples (behaviour logprobs and routes), random rewards."""
    from marlaas_hpc.rollout.base import GenerationRequest
    from marlaas_hpc.rollout.hf_engine import HfEngine
    from marlaas_hpc.trajectory import Trajectory, assign_advantages

    engine = HfEngine(path, device="cpu", dtype=dtype)
    engine.submit([GenerationRequest(request_id=f"p{p}s{s}", task_id="plain", adapter_version=None, prompt_ids=ids,
                                     temperature=1.0, max_new_tokens=tokens, seed=100 * p + s, ignore_stop=True,
                                     return_routes=True)
                   for p, ids in enumerate(prompts) for s in range(samples)])
    rewards = random.Random(1)
    trajs = [Trajectory("plain", gen.request_id.split("s")[0], gen.prompt_ids, gen.completion_ids, gen.logprobs, 0,
                        reward=rewards.random(), routes=gen.routes) for gen in engine.step()]
    assign_advantages(trajs)
    return trajs


def own_route_mismatch(path, trajs: list) -> float:
    """Share of completion tokens whose logits' position the fp32 model routes, in some MoE layer, to other experts
    than the rollout recorded (no replay: each side over its own hidden states)."""
    from transformers import AutoModelForCausalLM

    from marlaas_hpc.rollout.routes import RouteRecorder

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    recorder = RouteRecorder(model)
    differ = total = 0
    for traj in trajs:
        with torch.no_grad(), recorder.recording():
            model(input_ids=torch.tensor([traj.prompt_ids + traj.completion_ids]))
        own = recorder.by_position(1)[0][0].numpy()[: len(traj.routes)]
        same = (numpy.sort(own, axis=-1) == numpy.sort(traj.routes, axis=-1)).all(axis=(-1, -2))
        sources = same[len(traj.prompt_ids) - 1:]  # where each completion token's logits come from
        differ, total = differ + int((~sources).sum()), total + len(sources)
    return differ / max(total, 1)


def measure(path, dtype_name: str, args) -> dict:
    from marlaas_hpc.tasks.spec import AlgoSpec, LoraSpec
    from marlaas_hpc.trainer.trainer import MultiLoraTrainer, TrainerConfig

    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 20000) for _ in range(rng.randrange(8, 16))] for _ in range(args.prompts)]
    start = time.perf_counter()
    trajs = sample(path, DTYPES[dtype_name], prompts, args.samples, args.tokens)
    sampled = time.perf_counter() - start
    trainer = MultiLoraTrainer(TrainerConfig(model_path=str(path), seed=0, dtype="float32", device="cpu"))
    lora = LoraSpec(rank=4, alpha=8.0)
    trainer.add_task("plain", lora, AlgoSpec(lr=1e-6))
    trainer.add_task("replay", lora, AlgoSpec(lr=1e-6, routing_replay=True))
    metrics = trainer.train_steps({"plain": trajs, "replay": [replace(t, task_id="replay") for t in trajs]})
    trainer.close()
    return {"dtype": dtype_name, "tokens": int(metrics["plain"]["tokens"]), "sample_s": sampled,
            "logp_diff_abs": metrics["plain"]["logp_diff_abs"],
            "logp_diff_abs_replay": metrics["replay"]["logp_diff_abs"],
            "route_mismatch": metrics["replay"]["route_mismatch"],
            "route_mismatch_own": own_route_mismatch(path, trajs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:qwen3-30b-a3b-mini")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    args = parser.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a "Loading weights" bar per model load
    from pathlib import Path

    from marlaas_hpc.model.random_checkpoints import ensure_random_checkpoint

    path = ensure_random_checkpoint(args.model.removeprefix("random:"), log=lambda *a: None) \
        if args.model.startswith("random:") else Path(args.model)
    print(f"model {args.model}: {args.prompts} prompts x {args.samples} samples x {args.tokens} tokens, hf engine "
          "on CPU (the rollout dtype below) vs the fp32 trainer (TP=1), version 0")
    print(f"{'rollout':>9} {'tokens':>6} {'experts differ':>14} {'  (replayed)':>12} "
          f"{'|dlogp| no replay':>17} {'|dlogp| replay':>14}")
    for dtype_name in args.dtypes.split(","):
        row = measure(path, dtype_name, args)
        print(f"{row['dtype']:>9} {row['tokens']:>6} {row['route_mismatch_own']:>14.4f} {row['route_mismatch']:>12.4f} "
              f"{row['logp_diff_abs']:>17.3e} {row['logp_diff_abs_replay']:>14.3e}")


if __name__ == "__main__":
    main()
