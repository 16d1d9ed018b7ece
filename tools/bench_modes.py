"""The same multi-task workload in the three modes (async / sync / sequential) at several task counts.

    python tools/bench_modes.py [--tasks 1 2 4 8] [--steps 6] [--engine vllm] [--out runs/bench_modes]
    python tools/bench_modes.py --tool-workload [--steps 10] [--tool-latency 0.5 2.0] [--rollout-slots 32]

Each run is a real local-mode job (`marlaas run`, mpirun, all ranks); figures come from its summary.json.
Prints e2e time, busy fractions, mean TTFS / TPTS and mean final accuracy per mode, and the ratios
async/sequential and async/sync measured in this run.

--tool-workload runs instead a workload shaped like the paper's agentic search (issue #15): 2 lookup tasks whose
tool waits `tool_latency_s` on a service (one latency per lookup task) next to 2 single-turn addition tasks, in
async and sequential modes, and prints async/sequential, the single-turn tasks' time per step (TPTS) in both
(a tool wait must not slow another tenant's cheap reward), and the env rank's figures: the most lookup calls in
flight at once and the workers' queue wait. A group holds a rollout slot for the turns it spends in the engine,
not through its tool waits; the workload samples 32 groups at once on its one rollout rank, as local-demo does.
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


def tool_workload(steps: int, latencies_s: list[float], engine: str = "vllm", rollout_slots: int = 32) -> dict:
    """Agentic-search shape: 2 lookup tasks whose tool waits on a service (lookup i: latencies_s[i % n]) next to
    2 single-turn addition tasks (tool-demo's layout and env pool)."""
    def lookup(i):
        return {"task_id": f"lookup{i}", "tenant": "alice", "total_steps": steps, "max_staleness": 1,
                "dataset": {"kind": "lookup", "eval_size": 32, "seed": i,
                            "tool_latency_s": latencies_s[i % len(latencies_s)]},
                "lora": {"rank": 8, "alpha": 16},
                "algo": {"group_size": 8, "batch_prompts": 8, "lr": 0.003, "max_new_tokens": 6, "max_turns": 3,
                         "max_episode_tokens": 40}}

    def addition(i):
        return {"task_id": f"add{i}", "tenant": "bob", "dataset": {"kind": "addition", "eval_size": 32, "seed": i},
                "lora": {"rank": 8, "alpha": 16}, "total_steps": steps, "max_staleness": 1,
                "algo": {"group_size": 8, "batch_prompts": 8, "lr": 0.003, "max_new_tokens": 6}}

    return {"model": "tiny", "engine": engine, "mode": "async", "max_adapters": 4, "max_lora_rank": 8,
            "rollout_slots": rollout_slots, "layout": {"env_ranks": 1, "rollout_ranks": 1, "trainer_tp": 1},
            "env_pool": {"mode": "thread", "workers": 4, "step_timeout_s": 30},
            "tasks": [lookup(0), lookup(1), addition(0), addition(1)]}


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


def env_figures(summary: dict) -> dict:
    """The env rank's view: most lookup calls in flight at once, the workers' queue wait (p50) and busy."""
    pool = next(iter(summary.get("env_ranks", {}).values()), {}).get("pool", {})
    stages = pool.get("stages", {})
    return {"lookup_in_flight_max": pool.get("io_in_flight_max", {}).get("lookup", 0),
            "worker_queue_p50_s": stages.get("queue", {}).get("p50", float("nan")),
            "tool_p50_s": stages.get("tool:lookup", {}).get("p50", float("nan")),
            "workers_busy": pool.get("busy_fraction", float("nan"))}


def tool_bench(args) -> None:
    config = tool_workload(args.steps, args.tool_latency, args.engine, args.rollout_slots)
    latencies = ", ".join(f"lookup{i} {args.tool_latency[i % len(args.tool_latency)]:g} s" for i in range(2))
    print(f"[bench] agentic-search shape: 2 lookup tasks ({latencies}) + 2 addition tasks, {args.steps} steps each, "
          f"rollout_slots {args.rollout_slots}", flush=True)
    summaries = {}
    for mode in ("async", "sequential"):
        summaries[mode] = summary = run(config, mode, Path(args.out) / f"tool-slots{args.rollout_slots}" / mode)
        r, env, tasks = row(summary), env_figures(summary), summary["tasks"]
        tpts = " ".join(f"{t} {tasks[t]['tpts_s']:.2f}" for t in sorted(tasks) if tasks[t]["tpts_s"] is not None)
        print(f"  {mode:>10} e2e {r['e2e_s']:6.1f} s; busy rollout {r.get('busy_rollout', 0):.2f} env "
              f"{r.get('busy_env', 0):.2f} trainer {r.get('busy_trainer', 0):.2f}; TPTS s: {tpts}; lookup calls in "
              f"flight max {env['lookup_in_flight_max']}, tool p50 {env['tool_p50_s']:.2f} s, worker queue p50 "
              f"{env['worker_queue_p50_s'] * 1e3:.1f} ms; acc {r['acc_before']:.2f} -> {r['acc_after']:.2f}",
              flush=True)
    a, q = summaries["async"], summaries["sequential"]

    def single_turn_tpts(summary):
        return _mean([t["tpts_s"] for task_id, t in summary["tasks"].items() if task_id.startswith("add")])

    print(f"[bench] async / sequential e2e {a['wall_time_s'] / q['wall_time_s']:.2f} (goal <= 0.3); single-turn "
          f"tasks' mean time per step: async {single_turn_tpts(a):.2f} s, sequential {single_turn_tpts(q):.2f} s",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tasks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--staleness", type=int, default=1)
    parser.add_argument("--engine", default="vllm", choices=["vllm", "hf"])
    parser.add_argument("--out", default=str(ROOT / "runs" / "bench_modes"))
    parser.add_argument("--tool-workload", action="store_true",
                        help="the agentic-search-shaped workload (lookup tools waiting on a service), async vs "
                             "sequential, instead of --tasks")
    parser.add_argument("--tool-latency", type=float, nargs="+", default=[0.5, 2.0],
                        help="tool_latency_s of each lookup task (cycled)")
    parser.add_argument("--rollout-slots", type=int, default=32, help="the tool workload's rollout_slots")
    args = parser.parse_args()
    if args.tool_workload:
        return tool_bench(args)
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
