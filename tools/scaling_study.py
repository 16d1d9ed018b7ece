"""Scaling study on the simulator: the three modes from 1 to 1024 tasks and from 8 to 512 GPUs.

    python tools/scaling_study.py [--quick] [--out runs/scaling]

Sweeps (every run is `marlaas simulate` of configs/sim-paper.yaml with configs/workloads/h100-qwen3-0.6b.yaml,
whose H100 figures are assumptions, see that file):
    paper      the MARLaaS paper's setting: GSM8K-like + search-like tasks, 1..32 tasks, 8 GPUs, k=1
    tasks      1..1024 tasks on 64 GPUs (48 rollout engines, 8 trainer groups of TP=2), shorter tasks
    gpus       256 tasks on 8..512 GPUs, rollout:trainer GPU splits 1:1 and 3:1
    staleness  k = 0..4, 32 paper tasks on 8 GPUs
    groups     trainer groups G = 1, 2, 4, 8 (TP=2 each) beside a fixed rollout side: the paper's 32 tasks with
               6 rollout engines, and 1024 tasks (as `tasks`) with 48; tasks placed by the scheduler
Writes scaling.csv and one PNG per sweep (utilisation, e2e time, TTFS, TPTS vs tasks, GPUs or groups, one line
per mode). --quick runs a few small points of every sweep (smoke test, well under a minute).
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from marlaas_hpc.config import JobConfig  # noqa: E402
from marlaas_hpc.scheduler import MODES  # noqa: E402
from marlaas_hpc.sim.engine import Simulation  # noqa: E402
from marlaas_hpc.sim.report import summarize  # noqa: E402
from marlaas_hpc.sim.setup import copies_to, setup_from_job  # noqa: E402
from marlaas_hpc.sim.workload import load_workload  # noqa: E402

CONFIG = ROOT / "configs" / "sim-paper.yaml"
WORKLOAD = ROOT / "configs" / "workloads" / "h100-qwen3-0.6b.yaml"
TRAINER_TP = 2
FIELDS = ["sweep", "mode", "tasks", "gpus", "rollout_ranks", "trainer_gpus", "trainer_groups", "staleness", "steps",
          "e2e_s", "busy_rollout", "busy_trainer", "busy_trainer_min", "busy_trainer_max", "busy_env", "ttfs_s",
          "tpts_s", "fused_tasks", "moves", "sim_wall_s"]


@dataclasses.dataclass
class Point:
    sweep: str
    mode: str
    tasks: int
    gpus: int
    trainer_share: float
    """Fraction of the GPUs that train (the rest are rollout engines)."""
    staleness: int = 1
    steps: int | None = None
    """Shorter tasks (None: the config's steps) keep the large sweeps quick to simulate."""
    batch: int | None = None
    groups: int | None = None
    """Trainer groups beside `gpus` rollout engines (the groups sweep); None: `gpus` split by trainer_share."""


def layout(gpus: int, trainer_share: float) -> dict:
    trainer_gpus = max(TRAINER_TP, round(gpus * trainer_share / TRAINER_TP) * TRAINER_TP)
    rollout = max(1, gpus - trainer_gpus)
    return {"rollout_ranks": rollout, "env_ranks": rollout, "trainer_tp": TRAINER_TP,
            "trainer_groups": trainer_gpus // TRAINER_TP, "trainer_slots": 4}


def shape_of(point: Point) -> dict:
    if point.groups is None:
        return layout(point.gpus, point.trainer_share)
    return {"rollout_ranks": point.gpus, "env_ranks": point.gpus, "trainer_tp": TRAINER_TP,
            "trainer_groups": point.groups, "trainer_slots": 4}


def run_point(point: Point, job: JobConfig, workload) -> dict:
    tasks = [dataclasses.replace(t, max_staleness=point.staleness, total_steps=point.steps or t.total_steps,
                                 algo=dataclasses.replace(t.algo, batch_prompts=point.batch or t.algo.batch_prompts))
             for t in copies_to(job.tasks, point.tasks)]
    shape = shape_of(point)
    setup = setup_from_job(job, mode=point.mode, tasks=tasks, max_adapters=point.tasks, **shape)
    start = time.perf_counter()
    sim = Simulation(setup, workload, seed=0, trace=False)
    summary = summarize(sim, sim.run(), 0)
    busy = summary["busy_fraction"]
    return {"sweep": point.sweep, "mode": point.mode, "tasks": point.tasks, "gpus": setup.gpus,
            "rollout_ranks": shape["rollout_ranks"], "trainer_gpus": shape["trainer_groups"] * TRAINER_TP,
            "trainer_groups": shape["trainer_groups"], "staleness": point.staleness, "steps": tasks[0].total_steps,
            "e2e_s": summary["wall_time_s"], "busy_rollout": busy["rollout"], "busy_trainer": busy["trainer"],
            "busy_trainer_min": min(summary["trainer_busy_by_group"]),
            "busy_trainer_max": max(summary["trainer_busy_by_group"]), "busy_env": busy["env"],
            "ttfs_s": summary["ttfs_mean_s"], "tpts_s": summary["tpts_mean_s"],
            "fused_tasks": summary["fused_tasks_mean"], "moves": summary["moves"],
            "sim_wall_s": time.perf_counter() - start}


def points(quick: bool) -> list[Point]:
    paper_tasks = [1, 4] if quick else [1, 2, 4, 8, 16, 32]
    scale_tasks = [1, 8] if quick else [1, 8, 32, 128, 1024]
    gpus = [8, 64] if quick else [8, 64, 512]
    steps, batch = (2, 4) if quick else (4, 8)
    out = [Point("paper", m, n, 8, 0.25, steps=2 if quick else None) for n in paper_tasks for m in MODES]
    out += [Point("tasks", m, n, 64, 0.25, steps=steps, batch=batch) for n in scale_tasks for m in MODES]
    out += [Point("gpus", m, 16 if quick else 256, g, share, steps=steps, batch=batch)
            for g in gpus for share in (0.5, 0.25) for m in MODES]
    out += [Point("staleness", m, 4 if quick else 32, 8, 0.25, staleness=k, steps=2 if quick else None)
            for k in ([0, 2] if quick else [0, 1, 2, 3, 4]) for m in ("async", "sync")]
    groups = [1, 2] if quick else [1, 2, 4, 8]
    out += [Point("groups", m, 4 if quick else 32, 6, 0.0, steps=2 if quick else None, groups=g)
            for g in groups for m in ("async", "sync")]
    out += [Point("groups", m, 16 if quick else 1024, 48, 0.0, steps=steps, batch=batch, groups=g)
            for g in groups for m in ("async", "sync")]
    return out


def plot(rows: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for sweep, x in (("paper", "tasks"), ("tasks", "tasks"), ("gpus", "gpus"), ("staleness", "staleness"),
                     ("groups", "trainer_groups")):
        mine = [r for r in rows if r["sweep"] == sweep and (sweep != "gpus" or r["trainer_gpus"] * 4 == r["gpus"]
                                                             or r["gpus"] <= 8)]
        if not mine:
            continue
        fig, axes = plt.subplots(1, 4, figsize=(18, 4))
        # the groups sweep has one line per (mode, task count); the others one per mode
        lines = sorted({(r["mode"], r["tasks"] if sweep == "groups" else None) for r in mine},
                       key=lambda line: (MODES.index(line[0]), line[1] or 0))
        for mode, tasks in lines:
            series = sorted((r for r in mine if r["mode"] == mode and (tasks is None or r["tasks"] == tasks)),
                            key=lambda r: r[x])
            label = mode if tasks is None else f"{mode} {tasks} tasks"
            xs = [r[x] for r in series]
            axes[0].plot(xs, [r["busy_rollout"] for r in series], "o-", label=f"{label} rollout")
            axes[0].plot(xs, [r["busy_trainer"] for r in series], "x--", label=f"{label} trainer")
            for ax, key in zip(axes[1:], ("e2e_s", "ttfs_s", "tpts_s")):
                ax.plot(xs, [r[key] for r in series], "o-", label=label)
        for ax, title in zip(axes, ("GPU busy fraction", "e2e time (s)", "TTFS (s)", "TPTS (s)")):
            ax.set_title(title)
            ax.set_xlabel(x)
            if x != "staleness":
                ax.set_xscale("log", base=2)
            if title != "GPU busy fraction":
                ax.set_yscale("log")
            ax.legend(fontsize=7)
        fig.suptitle(f"sweep {sweep} (simulated; assumed H100 costs, configs/workloads/h100-qwen3-0.6b.yaml)")
        fig.tight_layout()
        path = out / f"scaling_{sweep}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written.append(path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few small points of every sweep (smoke test)")
    parser.add_argument("--out", default=str(ROOT / "runs" / "scaling"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    job, workload = JobConfig.load(CONFIG), load_workload(WORKLOAD)
    rows = []
    print(f"{'sweep':<10} {'mode':<10} {'tasks':>5} {'gpus':>5} {'roll':>4} {'G':>3} {'k':>2} {'e2e_s':>9} "
          f"{'rollout':>7} {'trainer':>7} {'TTFS_s':>8} {'TPTS_s':>8} {'sim_s':>6}", flush=True)
    with open(out / "scaling.csv", "w", newline="") as sink:
        writer = csv.DictWriter(sink, fieldnames=FIELDS)
        writer.writeheader()
        for point in points(args.quick):
            row = run_point(point, job, workload)
            rows.append(row)
            writer.writerow(row)
            sink.flush()
            print(f"{row['sweep']:<10} {row['mode']:<10} {row['tasks']:>5} {row['gpus']:>5} {row['rollout_ranks']:>4} "
                  f"{row['trainer_groups']:>3} {row['staleness']:>2} "
                  f"{row['e2e_s']:>9.1f} {row['busy_rollout']:>7.2f} {row['busy_trainer']:>7.2f} "
                  f"{row['ttfs_s']:>8.1f} {row['tpts_s'] or 0:>8.1f} {row['sim_wall_s']:>6.1f}", flush=True)
    for path in plot(rows, out):
        print(f"plot: {path}")
    print(f"csv: {out / 'scaling.csv'}")


if __name__ == "__main__":
    main()
