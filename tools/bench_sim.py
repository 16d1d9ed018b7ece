"""Throughput of the simulator and of the scheduler inside it, at 8, 128 and 1024 tasks.

    python tools/bench_sim.py [--tasks 8 128 1024] [--mode async] [--steps 4]

The scheduler's own rate is events handled per second of time spent in `Scheduler.handle` (dispatch
included) during the simulation, and again ("replay") when a fresh scheduler is fed the recorded event
stream alone; the simulator's rate is scheduler events per wall second of the whole run (simulated ranks,
event queue, trace hashing), and "all sim ev/s" counts every event the simulation steps through (engine
wake-ups, tool returns, scoring, trainer steps, broadcasts, and the scheduler's). Rollout ranks grow with
the tasks (one per 8 tasks), so the load per rank is the same at every scale and a flat scheduler rate means
its cost per event does not grow with task count.
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
from marlaas_hpc.sim.engine import Simulation  # noqa: E402
from marlaas_hpc.sim.setup import copies_to, setup_from_job  # noqa: E402
from marlaas_hpc.sim.workload import load_workload  # noqa: E402


def simulation(n_tasks: int, mode: str, steps: int, workload) -> Simulation:
    """calib-small's tasks copied to n_tasks, with one rollout rank per 8 tasks (the same load per rank at
    every scale), one env rank and one trainer group per 4 rollout ranks."""
    job = JobConfig.load(ROOT / "configs" / "calib-small.yaml")
    tasks = [dataclasses.replace(t, total_steps=steps) for t in copies_to(job.tasks, n_tasks)]
    ranks = max(1, n_tasks // 8)
    setup = setup_from_job(job, mode=mode, tasks=tasks, max_adapters=n_tasks, rollout_ranks=ranks,
                           env_ranks=max(1, ranks // 4), trainer_groups=max(1, ranks // 4), trainer_slots=4)
    return Simulation(setup, workload, seed=0, trace=False)


def measure(n_tasks: int, mode: str, steps: int, workload) -> dict:
    sim = simulation(n_tasks, mode, steps, workload)
    setup = sim.setup
    handle, spent = sim.scheduler.handle, [0.0]

    def timed(event):
        start = time.perf_counter()
        out = handle(event)
        spent[0] += time.perf_counter() - start
        return out

    recorded = []

    def timed_and_recorded(event):
        recorded.append((sim.queue.now, event))
        return timed(event)

    sim.scheduler.handle = timed_and_recorded
    start = time.perf_counter()
    outcome = sim.run()
    wall = time.perf_counter() - start
    return {"tasks": n_tasks, "events": outcome.scheduler_events, "scheduler_s": spent[0], "wall_s": wall,
            "scheduler_eps": outcome.scheduler_events / spent[0], "sim_eps": outcome.scheduler_events / wall,
            "queue_eps": sim.queue.handled / wall,
            "us_per_event": 1e6 * spent[0] / outcome.scheduler_events,
            "replay_eps": replay(setup, recorded)}


def replay(setup, recorded: list, repeats: int = 5) -> float:
    """Events/s of a fresh scheduler fed the recorded event stream alone (same clock readings, so the same
    commands): the scheduler's cost without the simulated ranks in between. The best of `repeats` passes,
    as timeit does: this VM's speed drifts by up to 2x, and a slow spell says nothing about the code."""
    from marlaas_hpc.scheduler import Scheduler

    best = float("inf")
    for _ in range(repeats):
        now = [0.0]
        scheduler = Scheduler(setup.scheduler_config(), clock=lambda: now[0])
        start = time.perf_counter()
        for when, event in recorded:
            now[0] = when
            scheduler.handle(event)
        best = min(best, time.perf_counter() - start)
    return len(recorded) / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, nargs="+", default=[8, 128, 1024])
    parser.add_argument("--mode", default="async", choices=MODES)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--workload", default=str(ROOT / "configs" / "workloads" / "tiny-cpu.yaml"))
    args = parser.parse_args()
    workload = load_workload(args.workload)
    print(f"{'tasks':>6} {'events':>8} {'sched_s':>8} {'sched ev/s':>11} {'us/event':>9} {'replay ev/s':>12} "
          f"{'sim_s':>7} {'sim ev/s':>9} {'all sim ev/s':>13}")
    for n in args.tasks:
        r = measure(n, args.mode, args.steps, workload)
        print(f"{r['tasks']:>6} {r['events']:>8} {r['scheduler_s']:>8.2f} {r['scheduler_eps']:>11,.0f} "
              f"{r['us_per_event']:>9.1f} {r['replay_eps']:>12,.0f} {r['wall_s']:>7.2f} {r['sim_eps']:>9,.0f} "
              f"{r['queue_eps']:>13,.0f}",
              flush=True)


if __name__ == "__main__":
    main()
