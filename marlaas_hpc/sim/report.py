"""What a simulation reports, in the runtime's own terms: summary.json with wall time, busy fraction per role,
per-task TTFS / TPTS / steps, and audit.jsonl (one line per trained group) for the staleness check."""
from __future__ import annotations

import json
from pathlib import Path

from marlaas_hpc.rundir import task_record
from marlaas_hpc.scheduler.staleness import within_bound
from marlaas_hpc.sim.engine import Simulation, SimOutcome


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def summarize(sim: Simulation, outcome: SimOutcome, seed: int) -> dict:
    tasks = {task_id: task_record(task) for task_id, task in sim.scheduler.tasks.items()}
    setup = sim.setup
    return {
        "simulated": True, "mode": setup.mode, "seed": seed, "wall_time_s": outcome.end_time,
        "busy_fraction": outcome.busy_fraction,
        "ttfs_mean_s": _mean(t["ttfs_s"] for t in tasks.values()),
        "tpts_mean_s": _mean(t["tpts_s"] for t in tasks.values()),
        "tasks_done": sum(t["status"] == "done" for t in tasks.values()),
        "fused_tasks_mean": _mean(sim.fused_steps),
        "scheduler_events": outcome.scheduler_events, "trace_sha256": outcome.trace_hash,
        "layout": {"env_ranks": setup.env_ranks, "rollout_ranks": setup.rollout_ranks,
                   "trainer_tp": setup.trainer_tp, "trainer_dp": setup.trainer_dp,
                   "trainer_groups": setup.trainer_groups, "gpus": setup.gpus},
        "trainer_busy_by_group": [min(t.meter.busy, outcome.end_time) / max(outcome.end_time, 1e-12)
                                  for t in sim.trainers],
        "moves": sum(t.moves for t in sim.scheduler.tasks.values()),
        "ranks_lost": sim.ranks_lost,
        "tasks": tasks,
    }


def write_outputs(out_dir: str | Path, summary: dict, sim: Simulation) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    with open(out / "audit.jsonl", "w") as sink:
        for r in sim.scheduler.audit:
            sink.write(json.dumps({"task_id": r.task_id, "group_id": r.group_id,
                                   "behaviour_version": r.behaviour_version, "trained_into": r.trained_into,
                                   "bound": r.bound}) + "\n")
    return out


def staleness_violations(sim: Simulation) -> list:
    """Audit records breaking the staleness rule (scheduler/staleness.py), as the runtime audits."""
    return [r for r in sim.scheduler.audit if not within_bound(r.behaviour_version, r.trained_into - 1, r.bound)]


def headline(summary: dict) -> str:
    busy = summary["busy_fraction"]
    ttfs, tpts = summary["ttfs_mean_s"], summary["tpts_mean_s"]
    return (f"{summary['mode']:<10} tasks {len(summary['tasks']):>5}  e2e {summary['wall_time_s']:9.2f} s  busy "
            f"rollout {busy['rollout']:.2f} env {busy['env']:.2f} trainer {busy['trainer']:.2f}  "
            f"TTFS {ttfs if ttfs is None else round(ttfs, 2)} s  TPTS {tpts if tpts is None else round(tpts, 2)} s")
