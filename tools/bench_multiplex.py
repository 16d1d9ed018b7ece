"""Two jobs of different base models on one shared rollout pool against dedicated pools (issue #28, PlexRL).

    python tools/bench_multiplex.py [--gsm-tasks 8] [--search-tasks 4] [--ranks 2] [--staleness 1] [--steps 10]
                                    [--mode async] [--pool 4 3 2] [--sleep 0.2] [--wake 0.5] [--seed 0]

Job A is compute-bound (GSM8K-like: one long-tailed answer per episode), job B tool-bound (search-like: four
turns with three retrieval calls); each is its own base model, so their engines cannot share a batch, only
take turns on a GPU (sleep / wake, sim/multiplex.py `EngineSwitch`). Tasks come from configs/sim-paper.yaml,
costs from configs/workloads/h100-qwen3-0.6b.yaml (assumed H100 costs, not measured; both models are priced as
Qwen3-0.6B). Each job has `--ranks` dedicated rollout GPUs and one TP=1 trainer GPU; the shared runs put both
jobs on one pool of each `--pool` size, trainers unchanged.

GPU-hours to finish every task: a job's GPUs count until it ends (dedicated), the shared pool's until the last
job ends. Slowdown: a job's end-to-end time against its dedicated run. 'idle roll': the GPU-time its rollout
ranks had nothing to run (no sequence, no adapter install, no switch), as a share of all its GPU-time: on the
dedicated row, about what time-slicing whole engines can save at most. 'idle train': the same for the trainer
GPUs (outside the pool: time-slicing rollout engines cannot take it). Goal (issue #28): >= 30% fewer GPU-hours
at <= 10% slower per job.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from marlaas_hpc.config import JobConfig  # noqa: E402
from marlaas_hpc.scheduler import MODES  # noqa: E402
from marlaas_hpc.sim.multiplex import EngineSwitch, PoolJob, run_dedicated, run_shared  # noqa: E402
from marlaas_hpc.sim.setup import copies_to, setup_from_job  # noqa: E402
from marlaas_hpc.sim.workload import load_workload  # noqa: E402


def jobs(gsm_tasks: int, search_tasks: int, ranks: int, staleness: int, steps: int, mode: str = "async"
         ) -> list[PoolJob]:
    job = JobConfig.load(ROOT / "configs" / "sim-paper.yaml")
    workload = load_workload(ROOT / "configs" / "workloads" / "h100-qwen3-0.6b.yaml")
    gsm, search = job.tasks

    def setup(task, count):
        tasks = [dataclasses.replace(t, total_steps=steps, max_staleness=staleness) for t in copies_to([task], count)]
        return setup_from_job(job, mode=mode, tasks=tasks, rollout_ranks=ranks, env_ranks=2, trainer_tp=1,
                              rollout_slots=32, max_adapters=count)

    return [PoolJob(model="A-gsm8k", setup=setup(gsm, gsm_tasks), workload=workload),
            PoolJob(model="B-search", setup=setup(search, search_tasks), workload=workload)]


def row(label: str, result, dedicated) -> str:
    cells = [f"{label:<18}", f"{result.gpus:>5}", f"{result.gpu_hours:>7.3f}",
             f"{result.gpu_hours / dedicated.gpu_hours - 1:>+7.1%}"]
    for job, alone in zip(result.jobs, dedicated.jobs):
        done = set(job.statuses.values()) == {"done"}
        cells.append(f"{job.end_time:>8.1f} {job.end_time / alone.end_time - 1:>+6.1%}{'' if done else ' !'}")
    violations = sum(job.staleness_violations for job in result.jobs)
    idle = result.rollout_idle_s / (3600 * result.gpu_hours)
    idle_train = result.trainer_idle_s / (3600 * result.gpu_hours)
    cells += [f"{idle:>9.1%}", f"{idle_train:>10.1%}", f"{result.switches:>8}", f"{violations:>5}"]
    return " | ".join(cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gsm-tasks", type=int, default=8)
    parser.add_argument("--search-tasks", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=2, help="dedicated rollout GPUs per job")
    parser.add_argument("--staleness", type=int, default=1, help="every task's max_staleness k")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--mode", default="async", choices=MODES, help="both jobs' scheduler mode")
    parser.add_argument("--pool", type=int, nargs="+", help="shared pool sizes (default: 2 x ranks down to ranks)")
    parser.add_argument("--sleep", type=float, default=EngineSwitch().sleep, help="engine sleep, seconds")
    parser.add_argument("--wake", type=float, default=EngineSwitch().wake, help="engine wake + warm-up, seconds")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    pair = jobs(args.gsm_tasks, args.search_tasks, args.ranks, args.staleness, args.steps, args.mode)
    switch = EngineSwitch(sleep=args.sleep, wake=args.wake)
    pools = args.pool or list(range(2 * args.ranks, args.ranks - 1, -1))
    start = time.perf_counter()
    dedicated = run_dedicated(pair, args.seed)
    print(f"A: {args.gsm_tasks} GSM8K-like tasks, B: {args.search_tasks} search-like tasks; {args.steps} steps, "
          f"k={args.staleness}, {args.mode}; switch {switch.seconds:.2f} s (sleep {switch.sleep} + wake {switch.wake})")
    print(" | ".join([f"{'rollout':<18}", "GPUs", "  GPU-h", "  vs ded", "    A e2e s  slow", "    B e2e s  slow",
                      "idle roll", "idle train", "switches", "viol."]))
    print(row(f"dedicated {args.ranks}+{args.ranks}", dedicated, dedicated))
    for size in pools:
        print(row(f"shared pool {size}", run_shared(pair, size, switch, args.seed), dedicated), flush=True)
    print(f"({time.perf_counter() - start:.1f} s wall; '!' marks a job that did not finish)")


if __name__ == "__main__":
    main()
