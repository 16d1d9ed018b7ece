"""What a fault costs a live local job (issue 25's benchmark), with real `marlaas run` jobs on the ULFM Open MPI.

    python tools/bench_faults.py [--steps 60] [--faults rollout env trainer hang join join3 join_disk join3_disk]
                                 [--out runs/bench_faults]

For each fault the same job runs twice, without and with it (a rollout or env rank SIGKILLed out of two, one rank
of one of two trainer groups SIGKILLed, a rollout rank stopped with SIGSTOP and found by the hang watchdog), and
it prints: the groups issued again, per task the longest time without a step against its median time per step
(the goal: at most 2x for tasks outside a failed trainer group), and the job's wall time against the run without
the fault. `join` / `join3` scale a live job from 1 to 2 / 4 rollout ranks (`marlaas scale`) and print, per joined
rank, the seconds from its start (MPI_Comm_spawn) to joining and to its first generated group, with the base
weights from a live rollout rank (`layout.join_weights: peer`, a chain for 3 joiners; runtime/peer_weights.py);
`join_disk` / `join3_disk` read them from the disk. On one machine "disk" is the page cache (the model's files were
read by the job's own ranks at start), so the peer path pays a copy into $TMPDIR that a shared filesystem under
load would make worth it; the figure says what the transfer costs, not what a cluster's storage would. These
joins run the tiny model of configs/test-small.yaml; tools/bench_join_weights.py measures the same two paths at
a real model's shape (random:qwen3-0.6b) without a training job around them. Figures come from each run's
summary.json, metrics.jsonl and timeline/.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
FAULTS = {
    # name: (layout, the role whose last rank is hit, signal)
    "rollout": ({"rollout_ranks": 2}, "rollout", signal.SIGKILL),
    "env": ({"env_ranks": 2}, "env", signal.SIGKILL),
    "trainer": ({"trainer_tp": 2, "trainer_groups": 2}, "trainer follower of trainer group 1, TP rank 1",
                signal.SIGKILL),
    "hang": ({"rollout_ranks": 2}, "rollout", signal.SIGSTOP),
    # joins: the base weights from a live rollout rank (layout.join_weights: peer) or from the disk
    "join": ({"join_weights": "peer"}, None, 2),
    "join3": ({"join_weights": "peer"}, None, 4),
    "join_disk": ({"join_weights": "disk"}, None, 2),
    "join3_disk": ({"join_weights": "disk"}, None, 4),
}
HANG_TIMEOUT_S = 4


def job_config(steps: int, layout: dict, hang_timeout_s: float = 600) -> dict:
    config = yaml.safe_load((ROOT / "configs" / "test-small.yaml").read_text())
    config["layout"] = {"env_ranks": 1, "rollout_ranks": 1, "trainer_tp": 1, **layout}
    config["checkpoint"] = {"every_steps": 5, "every_minutes": 0}
    config["fault"] = {"hang_timeout_s": hang_timeout_s}
    if layout.get("trainer_groups", 1) > 1:  # a task for each group
        config["tasks"].append({**config["tasks"][0], "task_id": "add2", "tenant": "carol"})
    for task in config["tasks"]:
        task["total_steps"] = steps
    return config


class Run:
    """One `marlaas run`, its stdout read as it comes."""

    def __init__(self, config: dict, out: Path):
        out.mkdir(parents=True, exist_ok=True)
        (out / "job.yaml").write_text(yaml.safe_dump(config))
        self.run_dir, self.lines, self.tasks = out / "run", [], [t["task_id"] for t in config["tasks"]]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen([sys.executable, "-m", "marlaas_hpc.cli", "run", str(out / "job.yaml"),
                                      "--run-dir", str(self.run_dir)], cwd=ROOT, env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        threading.Thread(target=lambda: self.lines.extend(line.rstrip() for line in self.proc.stdout),
                         daemon=True).start()

    def wait(self, done, what: str, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the job ended or stalled before {what}:\n" + "\n".join(self.lines[-30:]))
            time.sleep(0.2)

    def steps(self) -> int:
        return min(sum(1 for line in list(self.lines) if line.startswith(f"[{t}] v")) for t in self.tasks)

    def rank(self, role: str) -> dict:
        ranks = [json.loads(p.read_text()) for p in (self.run_dir / "ranks").glob("rank*.json")]
        return max((r for r in ranks if r["role"] == role), key=lambda r: r["rank"])

    def finish(self) -> dict:
        code = self.proc.wait(timeout=600)
        if code != 0:
            raise SystemExit(f"the job ended with {code}:\n" + "\n".join(self.lines[-30:]))
        return json.loads((self.run_dir / "summary.json").read_text())


def step_gaps(run_dir: Path, summary: dict) -> dict[str, tuple[float, float]]:
    """Task -> (longest time without a step, median time per step), from its metrics.jsonl."""
    out = {}
    for task_id, info in summary["tasks"].items():
        path = run_dir / "tasks" / info["tenant"] / task_id / "metrics.jsonl"
        times = sorted(json.loads(line)["time"] for line in path.read_text().splitlines())
        gaps = [b - a for a, b in zip(times, times[1:])]
        out[task_id] = (max(gaps), statistics.median(gaps))
    return out


def bench_fault(name: str, steps: int, out: Path) -> dict:
    layout, role, sig = FAULTS[name]
    config = job_config(steps, layout, HANG_TIMEOUT_S if sig == signal.SIGSTOP else 600)
    base = Run(config, out / name / "baseline")
    base_summary = base.finish()
    run = Run(config, out / name / "fault")
    run.wait(lambda: run.steps() >= 6, "6 steps")
    victim = run.rank(role)
    os.kill(victim["pid"], sig)
    try:
        summary = run.finish()
    finally:
        if sig == signal.SIGSTOP:
            try:
                os.kill(victim["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
    (loss,) = summary["ranks_lost"]
    rolled = loss.get("tasks_rolled_back") or {}
    gaps, base_gaps = step_gaps(run.run_dir, summary), step_gaps(base.run_dir, base_summary)
    return {"fault": name, "rank": victim["rank"], "cause": loss["cause"],
            "groups_reissued": len(loss.get("groups_reissued") or []), "tasks_rolled_back": sorted(rolled),
            "gaps": {t: {"longest_s": g, "median_s": m, "ratio": g / m, "rolled_back": t in rolled,
                         "baseline_ratio": base_gaps[t][0] / base_gaps[t][1]} for t, (g, m) in gaps.items()},
            "wall_s": summary["wall_time_s"], "baseline_wall_s": base_summary["wall_time_s"]}


def bench_join(name: str, steps: int, out: Path) -> dict:
    layout, _, wanted = FAULTS[name]
    run = Run(job_config(steps, layout), out / name)
    run.wait(lambda: run.steps() >= 3, "3 steps")
    subprocess.run([sys.executable, "-m", "marlaas_hpc.cli", "scale", str(run.run_dir), "--rollout", str(wanted)],
                   cwd=ROOT, check=True, capture_output=True)
    run.wait(lambda: sum(line.startswith("[scale] rollout rank") and " joined " in line for line in run.lines)
             >= wanted - 1, f"{wanted - 1} ranks joined")
    summary = run.finish()
    joined = []
    for record in summary["ranks_joined"]:
        spawned = record["at"] - record["start_s"]
        timeline = run.run_dir / "timeline" / f"rank{record['rank']}.jsonl"
        groups = [r for r in map(json.loads, timeline.read_text().splitlines()) if r.get("stage") == "group"]
        spans = list(map(json.loads, timeline.read_text().splitlines()))
        groups = [r for r in spans if r.get("stage") == "group"]
        first = min((g["end"] for g in groups), default=None)
        weights = [r["end"] - r["start"] for r in spans if r.get("stage") == "base_weights"]
        plan = [r["end"] - r["start"] for r in spans if r.get("stage") == "weights_plan"]
        engine = [r["end"] - r["start"] for r in spans if r.get("stage") == "start_engine"]
        joined.append({"rank": record["rank"], "join_s": record["start_s"], "weights": layout["join_weights"],
                       "base_weights_s": weights[0] if weights else None, "plan_wait_s": plan[0] if plan else None,
                       "engine_s": engine[0] if engine else None,
                       "first_group_s": None if first is None else first - spawned, "groups": len(groups)})
    return {"fault": name, "joiners": wanted - 1, "joined": joined, "wall_s": summary["wall_time_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--faults", nargs="+", default=list(FAULTS), choices=list(FAULTS))
    parser.add_argument("--out", default="runs/bench_faults")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    results = []
    for name in args.faults:
        result = (bench_join if name.startswith("join") else bench_fault)(name, args.steps, out)
        results.append(result)
        if "joined" in result:
            for j in result["joined"]:
                first = "-" if j["first_group_s"] is None else f"{j['first_group_s']:.1f} s"
                weights = "" if j["base_weights_s"] is None else \
                    f" in {j['base_weights_s']:.2f} s after {j['plan_wait_s']:.2f} s waiting for its chain's plan"
                print(f"{name}: rank {j['rank']} joined {j['join_s']:.1f} s after its start, first group at "
                      f"{first} ({j['groups']} groups; base weights from {j['weights']}{weights}, engine "
                      f"{j['engine_s']:.1f} s)")
            continue
        print(f"{name}: rank {result['rank']} lost; groups issued again {result['groups_reissued']}; wall "
              f"{result['wall_s']:.1f} s vs {result['baseline_wall_s']:.1f} s without the fault; cause: "
              f"{result['cause']}")
        for task, g in result["gaps"].items():
            mark = " (rolled back)" if g["rolled_back"] else ""
            print(f"    {task}: longest {g['longest_s']:.2f} s without a step, median step {g['median_s']:.2f} s: "
                  f"{g['ratio']:.1f}x (without the fault {g['baseline_ratio']:.1f}x){mark}")
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"results: {out / 'results.json'}")


if __name__ == "__main__":
    main()
