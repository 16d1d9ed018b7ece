"""Two jobs of different base models on one shared rollout pool against dedicated pools (issue #28, PlexRL).

    python tools/bench_multiplex.py [--gsm-tasks 8] [--search-tasks 4] [--ranks 2] [--staleness 1] [--steps 10]
                                    [--mode async] [--pool 4 3 2] [--sleep 0.2] [--wake 0.5] [--seed 0]

Job A is compute-bound (GSM8K-like: one long-tailed answer per episode), job B tool-bound (search-like: four
turns with three retrieval calls); each is its own base model, so their engines cannot share a batch, only
take turns on a GPU (sleep / wake, tools/studies/multiplex.py `EngineSwitch`). Tasks come from configs/sim-paper.yaml,
costs from configs/workloads/h100-qwen3-0.6b.yaml (assumed H100 costs, not measured; both models are priced as
Qwen3-0.6B). Each job has `--ranks` dedicated rollout GPUs and one TP=1 trainer GPU; the shared runs put both
jobs on one pool of each `--pool` size, trainers unchanged.

GPU-hours to finish every task: a job's GPUs count until it ends (dedicated), the shared pool's until the last
job ends. Slowdown: a job's end-to-end time against its dedicated run. 'idle roll': the GPU-time its rollout
ranks had nothing to run (no sequence, no adapter install, no switch), as a share of all its GPU-time: on the
dedicated row, about what time-slicing whole engines can save at most. 'idle train': the same for the trainer
GPUs (outside the pool: time-slicing rollout engines cannot take it). 're-pf': context tokens prefilled again
after a sleep freed them (gap switches). Goal (issue #28): >= 30% fewer GPU-hours at <= 10% slower per job.

The second table is the workload the issue describes (PlexRL, arXiv 2605.20863: RLVR jobs whose rollout GPUs
idle through their own trainer phases and tool waits), every figure stated:
- both jobs on-policy: `--mode sync` rounds, max_staleness 0, `--gap-tasks` tasks each (default 1: one tenant's
  RLVR run); their rollout GPUs idle while their trainer steps, their trainer while they roll out.
- job A: GSM8K (configs/sim-paper.yaml's gsm8k task: 16 prompts x 8 samples a step, answers up to 1024
  tokens, lognormal median 250); compute-bound, single turn, no tool.
- job B: a live web-search agent (the sim-paper search task: 4 turns, 3 search calls, 200-400 tokens of passages
  per call as Search-R1's top-3 passages) whose search goes to a web API instead of a local index: each call
  lognormal, median `--tool-latency` (default 2.0 s), sigma 0.8 (a tail to ~7 s at p95). Figures for such a
  call: ~1.5 s for a reranked retrieval alone (contextual.ai "Making search agents faster and smarter"), SERP
  APIs "several seconds" and 5-10 s with a page fetch (codeables.dev "Why is web browsing so slow inside my agent
  tool-calling loop"); a code sandbox call (SandboxFusion-style execution) is of the same order.
- costs for both: configs/workloads/h100-qwen3-0.6b.yaml (assumed H100 costs, not measured), both priced as
  Qwen3-0.6B; each job `--gap-ranks` dedicated rollout GPUs (default 1: a round of 16 groups fills half of one
  rank's 32 slots) and one TP=1 trainer GPU.
Rows: the pool as in the first table ('shared'); '+release' (ModelPool.release: when a job ends the pool gives
back the ranks the other job would not have had alone, and a given-back GPU counts only until then); and
'+gaps+release' (also ModelPool `fill_gaps`: a rank whose model's groups all wait on tool calls switches to the
other model; the parked contexts are prefilled again on return, column 're-pf').

`--trainer-scale K` multiplies every trainer step's cost by K in both tables (rollout costs unchanged): longer
LoRA steps, as a larger model's, against the same generation; sync rounds then leave the rollout GPUs idle longer.

Both tables also show 'dedicated coloc' (each job alone, its trainer rank on its own rollout GPU as
layout.share_gpus places it: tools/studies/multiplex.py `run_colocated`) and the rows '+trainers...' (the same policies
with every job's trainer ranks on the pool's GPUs, one per GPU from the front, `trainers_in_pool`; a pool with
fewer GPUs than trainer ranks is refused, and the row says so); the last column 'vs coloc' compares each row's
GPU-hours with the colocated jobs': what time-slicing across models adds to colocating each job's trainer.

Rows 'cores s=S' (the gap table always, the first with `--fill-gaps`): every model's engine resident and awake on
every pool GPU, decoding side by side (tools/studies/coresident.py `run_coresident`, ranks given back as jobs end), each
engine step also waiting for S x the other engines' steps on its GPU (`--interference`, default 1: no overlap;
not measured); '+trainers cores' puts the trainer ranks in the pool as above.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from marlaas_hpc.config import JobConfig  # noqa: E402
from marlaas_hpc.scheduler import MODES  # noqa: E402
from marlaas_hpc.sim.setup import copies_to, setup_from_job  # noqa: E402
from marlaas_hpc.sim.workload import Distribution, load_workload  # noqa: E402
from marlaas_hpc.tasks.spec import SpecError  # noqa: E402
from studies.coresident import run_coresident  # noqa: E402
from studies.multiplex import EngineSwitch, PoolJob, run_colocated, run_dedicated, run_shared  # noqa: E402


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


def gap_jobs(tasks: int, ranks: int, steps: int, tool_latency_s: float) -> list[PoolJob]:
    """The issue's workload: two on-policy (sync, k=0) jobs of `tasks` tasks each, a compute-bound GSM8K job
    and a web-search agent whose search calls take `tool_latency_s` (median; see the module doc)."""
    job = JobConfig.load(ROOT / "configs" / "sim-paper.yaml")
    workload = load_workload(ROOT / "configs" / "workloads" / "h100-qwen3-0.6b.yaml")
    search_profile = dataclasses.replace(workload.profiles["hotpotqa"],
                                         tool_latency=Distribution(dist="lognormal", median=tool_latency_s, sigma=0.8))
    web = dataclasses.replace(workload, profiles={**workload.profiles, "hotpotqa": search_profile})
    gsm, search = job.tasks

    def setup(task, count):
        specs = [dataclasses.replace(t, total_steps=steps, max_staleness=0) for t in copies_to([task], count)]
        return setup_from_job(job, mode="sync", tasks=specs, rollout_ranks=ranks, env_ranks=2, trainer_tp=1,
                              rollout_slots=32, max_adapters=count)

    return [PoolJob(model="A-gsm8k", setup=setup(gsm, tasks), workload=workload),
            PoolJob(model="B-websearch", setup=setup(search, tasks), workload=web)]


HEADER = " | ".join([f"{'rollout':<28}", "GPUs", "  GPU-h", "  vs ded", "    A e2e s  slow", "    B e2e s  slow",
                     "idle roll", "idle train", "switches", "  re-pf", "viol.", "vs coloc"])


POLICIES = {"shared": {}, "+release": {"release": True}, "+gaps+release": {"fill_gaps": True, "release": True},
            "+trainers+release": {"release": True, "trainers_in_pool": True},
            "+trainers+gaps+rel": {"fill_gaps": True, "release": True, "trainers_in_pool": True}}
"""Row label -> run_shared's policy options: the pool as before, releasing ranks when a job ends, also
switching ranks in tool-call gaps, and the same two with every job's trainer ranks on the pool's GPUs
(layout.share_gpus) instead of GPUs of their own."""

CORESIDENT = {"coresident": {"release": True}, "+trainers coresident": {"release": True, "trainers_in_pool": True}}
"""Row label -> run_coresident's options: every model's engine awake on every pool GPU (tools/studies/coresident.py),
ranks given back as jobs end, trainers on GPUs of their own or in the pool."""


def heavier_training(pair: list[PoolJob], scale: float) -> list[PoolJob]:
    """Each job's trainer step costs (fixed, per token, per task) times `scale`, rollout costs unchanged: the
    longer LoRA steps of a larger model, or of more tokens per step, against the same generation."""
    def heavier(job: PoolJob) -> PoolJob:
        t = job.workload.trainer
        trainer = dataclasses.replace(t, step_fixed=t.step_fixed * scale, per_token=t.per_token * scale,
                                      per_task=t.per_task * scale)
        return dataclasses.replace(job, workload=dataclasses.replace(job.workload, trainer=trainer))

    return [heavier(job) for job in pair]


def table(pair: list[PoolJob], ranks: int, pools: list[int], switch: EngineSwitch, seed: int,
          policies: tuple[str, ...], interferences: tuple[float, ...] = ()) -> None:
    """The dedicated row, then a shared row per policy and pool size."""
    dedicated = run_dedicated(pair, seed)
    colocated = run_colocated(pair, seed, switch)
    print(HEADER)
    print(row(f"dedicated {ranks}+{ranks}", dedicated, dedicated, colocated), flush=True)
    print(row(f"dedicated coloc {ranks}", colocated, dedicated, colocated), flush=True)
    for policy in policies:
        for size in pools:
            try:
                result = run_shared(pair, size, switch, seed, **POLICIES[policy])
            except SpecError as error:  # trainers in a pool smaller than their ranks
                print(f"{policy + ' pool ' + str(size):<28} | {error}")
                continue
            print(row(f"{policy} pool {size}", result, dedicated, colocated), flush=True)
    for policy, interference in itertools.product(CORESIDENT, interferences):
        for size in pools:
            label = f"{policy.replace('coresident', 'cores')} s={interference:g} pool {size}"
            try:
                result = run_coresident(pair, size, seed, interference, **CORESIDENT[policy])
            except SpecError as error:
                print(f"{label:<28} | {error}")
                continue
            print(row(label, result, dedicated, colocated), flush=True)


def row(label: str, result, dedicated, colocated) -> str:
    cells = [f"{label:<28}", f"{result.gpus:>5}", f"{result.gpu_hours:>7.3f}",
             f"{result.gpu_hours / dedicated.gpu_hours - 1:>+7.1%}"]
    for job, alone in zip(result.jobs, dedicated.jobs):
        done = set(job.statuses.values()) == {"done"}
        cells.append(f"{job.end_time:>8.1f} {job.end_time / alone.end_time - 1:>+6.1%}{'' if done else ' !'}")
    violations = sum(job.staleness_violations for job in result.jobs)
    idle = result.rollout_idle_s / (3600 * result.gpu_hours)
    idle_train = result.trainer_idle_s / (3600 * result.gpu_hours)
    cells += [f"{idle:>9.1%}", f"{idle_train:>10.1%}", f"{result.switches:>8}", f"{result.reprefill_tokens:>7}",
              f"{violations:>5}", f"{result.gpu_hours / colocated.gpu_hours - 1:>+8.1%}"]
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
    parser.add_argument("--fill-gaps", action="store_true",
                        help="first table: also the other policies' rows (gaps, release, trainers, co-resident)")
    parser.add_argument("--interference", type=float, nargs="*", default=[1.0],
                        help="co-resident rows (tools/studies/coresident.py), one set per value: how much of the other "
                             "engines' decode step an engine step waits for on a shared GPU (1: none overlaps)")
    parser.add_argument("--gap-tasks", type=int, default=1, help="second table: tasks per job")
    parser.add_argument("--gap-ranks", type=int, default=1, help="second table: dedicated rollout GPUs per job")
    parser.add_argument("--gap-steps", type=int, default=10, help="second table: steps per task")
    parser.add_argument("--tool-latency", type=float, default=2.0, help="second table: median web-search call, s")
    parser.add_argument("--gap-pool", type=int, nargs="+", help="second table's pool sizes (default 2 x down to 1 x)")
    parser.add_argument("--table", choices=("both", "first", "gaps"), default="both")
    parser.add_argument("--trainer-scale", type=float, default=1.0,
                        help="both tables: every trainer step's cost times this (rollout costs unchanged)")
    args = parser.parse_args()
    switch = EngineSwitch(sleep=args.sleep, wake=args.wake)
    start = time.perf_counter()
    if args.table in ("both", "first"):
        pair = heavier_training(jobs(args.gsm_tasks, args.search_tasks, args.ranks, args.staleness, args.steps,
                                     args.mode), args.trainer_scale)
        print(f"A: {args.gsm_tasks} GSM8K-like tasks, B: {args.search_tasks} search-like tasks; {args.steps} steps, "
              f"k={args.staleness}, {args.mode}; switch {switch.seconds:.2f} s (sleep {switch.sleep} + wake "
              f"{switch.wake}); trainer steps x{args.trainer_scale:g}")
        table(pair, args.ranks, args.pool or list(range(2 * args.ranks, args.ranks - 1, -1)), switch, args.seed,
              tuple(POLICIES) if args.fill_gaps else ("shared",), tuple(args.interference) if args.fill_gaps else ())
    if args.table in ("both", "gaps"):
        pair = heavier_training(gap_jobs(args.gap_tasks, args.gap_ranks, args.gap_steps, args.tool_latency),
                                args.trainer_scale)
        print(f"\ngap workload: A: {args.gap_tasks} GSM8K task(s), B: {args.gap_tasks} web-search agent task(s) "
              f"(3 calls, median {args.tool_latency} s); {args.gap_steps} steps, k=0, sync; switch "
              f"{switch.seconds:.2f} s")
        table(pair, args.gap_ranks, args.gap_pool or list(range(2 * args.gap_ranks, args.gap_ranks - 1, -1)), switch,
              args.seed, tuple(POLICIES), tuple(args.interference))
    print(f"({time.perf_counter() - start:.1f} s wall; '!' marks a job that did not finish)")


if __name__ == "__main__":
    main()
