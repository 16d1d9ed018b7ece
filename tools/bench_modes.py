"""The same multi-task workload in the three modes (async / sync / sequential) at several task counts.

    python tools/bench_modes.py [--tasks 1 2 4 8] [--steps 6] [--engine vllm] [--out runs/bench_modes]

Each run is a real local-mode job (`marlaas run`, mpirun, all ranks); figures come from its summary.json.
Prints e2e time, busy fractions, mean TTFS / TPTS and mean final accuracy per mode, and the ratios
async/sequential and async/sync measured in this run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("addition", "reverse", "count", "sort")
MAX_TOKENS = {"addition": 6, "reverse": 8, "count": 4, "sort": 8}


def workload(n_tasks: int, steps: int, engine: str, staleness: int) -> dict:
    tasks = [{"task_id": f"t{i}", "tenant": f"tenant{i % 3}", "total_steps": steps, "max_staleness": staleness,
              "dataset": {"kind": KINDS[i % 4], "seed": i, "eval_size": 64},
              "lora": {"rank": 8, "alpha": 16},
              "algo": {"group_size": 8, "batch_prompts": 4, "lr": 0.003, "max_new_tokens": MAX_TOKENS[KINDS[i % 4]]}}
             for i in range(n_tasks)]
    return {"model": "tiny", "engine": engine, "max_adapters": max(8, n_tasks), "rollout_slots": 8,
            "layout": {"env_ranks": 1, "rollout_ranks": 2, "trainer_tp": 1}, "tasks": tasks}


def run(config: dict, mode: str, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "marlaas_hpc.cli", "run", str(path), "--run-dir", str(out / "run"),
                           "--mode", mode], cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads((out / "run" / "summary.json").read_text())


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else float("nan")


def row(summary: dict) -> dict:
    tasks = summary["tasks"].values()
    return {"e2e_s": summary["wall_time_s"], **{f"busy_{k}": v for k, v in summary["busy_fraction"].items()},
            "ttfs_s": _mean([t["ttfs_s"] for t in tasks]), "tpts_s": _mean([t["tpts_s"] for t in tasks]),
            "acc_before": _mean([t["eval_accuracy_before"] for t in tasks]),
            "acc_after": _mean([t["eval_accuracy_after"] for t in tasks])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tasks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--staleness", type=int, default=1)
    parser.add_argument("--engine", default="vllm", choices=["vllm", "hf"])
    parser.add_argument("--out", default=str(ROOT / "runs" / "bench_modes"))
    args = parser.parse_args()
    header = (f"{'tasks':>5} {'mode':>10} {'e2e_s':>7} {'rollout':>7} {'env':>6} {'trainer':>7} {'TTFS_s':>7} "
              f"{'TPTS_s':>7} {'acc0':>5} {'acc':>5}")
    print(header, flush=True)
    results = {}
    for n in args.tasks:
        config = workload(n, args.steps, args.engine, args.staleness)
        for mode in ("async", "sync", "sequential"):
            r = row(run(config, mode, Path(args.out) / f"{n}tasks" / mode))
            results[(n, mode)] = r
            print(f"{n:>5} {mode:>10} {r['e2e_s']:7.1f} {r.get('busy_rollout', 0):7.2f} {r.get('busy_env', 0):6.2f} "
                  f"{r.get('busy_trainer', 0):7.2f} {r['ttfs_s']:7.1f} {r['tpts_s']:7.2f} {r['acc_before']:5.2f} "
                  f"{r['acc_after']:5.2f}", flush=True)
        a, s, q = (results[(n, m)]["e2e_s"] for m in ("async", "sync", "sequential"))
        print(f"{n:>5} {'ratios':>10} async/sequential {a / q:.2f}  async/sync {a / s:.2f}", flush=True)


if __name__ == "__main__":
    main()
