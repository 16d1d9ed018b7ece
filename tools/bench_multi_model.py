"""The CPU twin of issue #28 item 6: one job of several base models sharing its rollout rank(s) against the same
tasks run as one job per model, one after the other, on this machine.

    python tools/bench_multi_model.py [configs/multi-model-demo.yaml] [--out /tmp/bench_multi_model]

The shared job is the config as it is (one rollout rank holding an engine per model, one trainer group per model).
Each dedicated job is the config cut to one model's tasks: `model:` that model, one trainer group, the same env and
rollout ranks. Printed per run: the command's wall time (start-up included), summary.json's wall_time_s (from the
moment every rank is ready), rollout engine switches, and per task the reward of its first and last step, the
mean reward of its first and last quarter of steps (metrics.jsonl: one step's reward is a few dozen samples, so
single steps are noisy), its greedy eval accuracy before -> after, and whether each rose ('rose': reward = the
last quarter's mean above the first's, eval = after above before).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def dedicated_configs(config: dict) -> dict[str, dict]:
    """One config per model of `config`: its tasks only, one trainer group."""
    out = {}
    first = next(iter(config["models"]))
    for name, path in config["models"].items():
        single = {k: v for k, v in config.items() if k != "models"}
        single["model"] = path
        single["layout"] = {k: v for k, v in config["layout"].items() if k != "trainer_group_models"}
        single["layout"]["trainer_groups"] = 1
        single["tasks"] = [{k: v for k, v in task.items() if k != "base_model"}
                           for task in config["tasks"] if task.get("base_model", first) == name]
        out[name] = single
    return out


def run(config: dict, out: Path, name: str) -> dict:
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    run_dir = out / name
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "marlaas_hpc.cli", "run", str(path), "--run-dir", str(run_dir)],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    command_s = time.time() - start
    if proc.returncode:
        raise SystemExit(f"{name} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"command_s": command_s, "summary": summary, "run_dir": run_dir}


def quarter_rewards(run_dir: Path, task: dict, task_id: str) -> tuple[float, float]:
    """Mean reward of the task's first and last quarter of steps (at least one step each), from metrics.jsonl."""
    path = run_dir / "tasks" / task["tenant"] / task_id / "metrics.jsonl"
    rewards = [json.loads(line)["reward_mean"] for line in path.read_text().splitlines()]
    n = max(1, len(rewards) // 4)
    return sum(rewards[:n]) / n, sum(rewards[-n:]) / n


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", default=str(ROOT / "configs" / "multi-model-demo.yaml"))
    parser.add_argument("--out", default="/tmp/bench_multi_model")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = yaml.safe_load(Path(args.config).read_text())
    runs = {"shared": run(config, out, "shared")}
    for name, single in dedicated_configs(config).items():
        runs[f"only-{name}"] = run(single, out, f"only-{name}")
    print(f"{'run':<14} {'command s':>10} {'wall_time_s':>12} {'switches':>9}")
    for name, result in runs.items():
        switches = sum(s["switches"] for s in result["summary"].get("model_switches", {}).values())
        print(f"{name:<14} {result['command_s']:>10.1f} {result['summary']['wall_time_s']:>12.1f} {switches:>9}")
    dedicated = [r for n, r in runs.items() if n != "shared"]
    print(f"{'one after other':<14} {sum(r['command_s'] for r in dedicated):>10.1f} "
          f"{sum(r['summary']['wall_time_s'] for r in dedicated):>12.1f}")
    print(f"\n{'run':<14} {'task':<12} {'model':<10} {'steps':>5} {'reward first->last':>19} "
          f"{'quarter mean first->last':>25} {'eval before->after':>19} rose: reward eval")
    for name, result in runs.items():
        for task_id, task in result["summary"]["tasks"].items():
            first, last = quarter_rewards(result["run_dir"], task, task_id)
            print(f"{name:<14} {task_id:<12} {task.get('base_model') or '-':<10} {task['steps_done']:>5} "
                  f"{task['reward_first']:>9.3f}->{task['reward_last']:<9.3f} "
                  f"{first:>12.3f}->{last:<12.3f} "
                  f"{task['eval_accuracy_before']:>9.3f}->{task['eval_accuracy_after']:<9.3f} "
                  f"{'yes' if last > first else 'NO':>12} "
                  f"{'yes' if task['eval_accuracy_after'] > task['eval_accuracy_before'] else 'NO':>4}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
