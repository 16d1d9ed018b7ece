"""Many tenants in one job on this machine: N tasks x 2 steps on the tiny model, one `marlaas run` per N.

    python tools/bench_scale.py [--tasks 64 256 1024] [--out runs/bench-scale] [--profile]

Each job is configs/local-demo.yaml (vLLM, one env, one rollout and one trainer rank) with N tasks of its four
synthetic kinds (addition, reverse, count, sort, in turn), G=4, B=2, 2 steps, eval_size 4 and
max_adapters = N: every task admitted at once. Prints one row per N:

    job wall time (summary.json, from every rank ready to the end), the process's wall time (start-up and the
    end included), rank 0's busy fraction (its BusyClock: events, admissions, records, status), rollout and
    trainer busy fractions, TTFS and TPTS medians over the tasks, the run dir's size on disk, the bytes rank 0
    appended to its records per event handled, and the wall time per task at the largest N over that at the
    one before it.

--profile samples rank 0 with py-spy (on PATH, or --py-spy) for the whole job and prints the functions that take
the largest share of its samples (inclusive), with the collapsed stacks in RUN_DIR/rank0.pyspy.txt.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
KINDS = {"addition": 6, "reverse": 8, "count": 4, "sort": 8}
"""Task kind -> max_new_tokens (as configs/local-demo.yaml)."""


def job_config(tasks: int, run_dir: Path) -> dict:
    config = yaml.safe_load((ROOT / "configs" / "local-demo.yaml").read_text())
    kinds = list(KINDS)
    config.update(run_dir=str(run_dir), max_adapters=tasks, tasks=[
        {"task_id": f"{kinds[i % 4]}{i}", "tenant": f"tenant{i % 16}",
         "dataset": {"kind": kinds[i % 4], "eval_size": 4, "seed": i},
         "lora": {"rank": 8, "alpha": 16},
         "algo": {"group_size": 4, "batch_prompts": 2, "lr": 0.003, "max_new_tokens": KINDS[kinds[i % 4]]},
         "total_steps": 2, "max_staleness": 1} for i in range(tasks)])
    return config


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))


def _rank0_pid(run_dir: Path, proc: subprocess.Popen) -> int | None:
    path = run_dir / "ranks" / "rank0.json"
    while proc.poll() is None:
        if path.is_file():
            try:
                return json.loads(path.read_text())["pid"]
            except (json.JSONDecodeError, KeyError):
                pass
        time.sleep(0.2)
    return None


def run_job(tasks: int, out: Path, py_spy: str | None) -> dict:
    run_dir = out / f"n{tasks}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    config = out / f"n{tasks}.yaml"
    config.write_text(yaml.safe_dump(job_config(tasks, run_dir)))
    start = time.perf_counter()
    with open(run_dir.parent / f"n{tasks}.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "marlaas_hpc.cli", "run", str(config), "--run-dir",
                                 str(run_dir)], cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT)
        spy = None
        if py_spy:
            pid = _rank0_pid(run_dir, proc)
            if pid is not None:
                spy = subprocess.Popen([py_spy, "record", "--pid", str(pid), "--format", "raw", "--rate", "50",
                                        "--output", str(run_dir / "rank0.pyspy.txt")],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        code = proc.wait()
        if spy is not None:
            spy.wait(timeout=60)
    process_s = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"the {tasks}-task job failed (exit {code}): see {run_dir.parent / f'n{tasks}.log'}")
    return {"tasks": tasks, "process_s": process_s, **figures(run_dir)}


def figures(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    tasks = summary["tasks"].values()
    busy = summary["busy_fraction"]

    def median(metric):
        values = [t[metric] for t in tasks if t[metric] is not None]
        return statistics.median(values) if values else float("nan")

    size = sum(p.stat().st_size for p in run_dir.rglob("*") if p.is_file() and p.name != "rank0.pyspy.txt")
    rank0 = summary.get("scheduler_rank", {})
    return {"wall_s": summary["wall_time_s"], "startup_s": summary["startup_s"],
            "rank0_events": rank0.get("events"), "record_bytes_per_event":
                rank0["record_bytes"] / max(rank0["events"], 1) if "record_bytes" in rank0 else float("nan"),
            "busy_rank0": busy.get("scheduler", float("nan")), "busy_rollout": busy.get("rollout", float("nan")),
            "busy_trainer": busy.get("trainer", float("nan")), "ttfs_median_s": median("ttfs_s"),
            "tpts_median_s": median("tpts_s"), "run_dir_mb": size / 1e6,
            "done": sum(1 for t in tasks if t["status"] == "done")}


def hot_functions(path: Path, top: int = 15) -> list[tuple[str, float]]:
    """Share of rank 0's samples in its loop (SchedulerRank.run; start-up left out) in which each function is on
    the stack (py-spy's raw collapsed stacks; py-spy leaves idle samples out by default)."""
    inclusive, total = Counter(), 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if "SchedulerRank.run " not in stack:
            continue
        total += int(count)
        for frame in {f.split(" (")[0] for f in stack.split(";")}:
            inclusive[frame] += int(count)
    return [(frame, count / max(total, 1)) for frame, count in inclusive.most_common(top)]


def table(rows: list[dict]) -> str:
    lines = ["| tasks | job wall s | process s | rank 0 busy | rollout busy | trainer busy | TTFS median s | "
             "TPTS median s | run dir MB | record B/event | done |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tasks']} | {r['wall_s']:.1f} | {r['process_s']:.1f} | {r['busy_rank0']:.2f} | "
                     f"{r['busy_rollout']:.2f} | {r['busy_trainer']:.2f} | {r['ttfs_median_s']:.1f} | "
                     f"{r['tpts_median_s']:.1f} | {r['run_dir_mb']:.1f} | {r['record_bytes_per_event']:.0f} | "
                     f"{r['done']}/{r['tasks']} |")
    if len(rows) > 1:
        a, b = rows[-2], rows[-1]
        ratio = (b["wall_s"] / b["tasks"]) / (a["wall_s"] / a["tasks"])
        lines.append(f"\nwall time per task at {b['tasks']} tasks / at {a['tasks']}: {ratio:.2f}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--out", default=str(ROOT / "runs" / "bench-scale"))
    parser.add_argument("--profile", action="store_true", help="sample rank 0 with py-spy")
    parser.add_argument("--py-spy", default=shutil.which("py-spy"), help="the py-spy binary (--profile)")
    args = parser.parse_args()
    if args.profile and not args.py_spy:
        parser.error("--profile needs py-spy (pip install py-spy, or --py-spy PATH)")
    out = Path(args.out)
    rows = []
    for tasks in sorted(args.tasks):
        rows.append(run_job(tasks, out, args.py_spy if args.profile else None))
        print(json.dumps(rows[-1]), flush=True)
        profile = out / f"n{tasks}" / "rank0.pyspy.txt"
        if args.profile and profile.is_file():
            print(f"rank 0 at {tasks} tasks (share of py-spy samples, inclusive):")
            for frame, share in hot_functions(profile):
                print(f"  {share:6.1%}  {frame}")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
