"""Issue #29 (Laminar) in the simulator: today's lockstep delta broadcast against a relay tier, what long tails
cost, and Laminar's repack, on a heavy-tailed length workload at the paper's 32 tasks / 8 rollout GPUs and at
1024 tasks / 256 rollout GPUs.

    python tools/bench_laminar.py [--scales 32:8 1024:256] [--steps 6] [--seeds 2] [--max-in-flight 16]
                                  [--push-bandwidth 25e9] [--relay-bandwidth 25e9] [--pull-bandwidth 25e9]
                                  [--fanout 2] [--ranks-per-tail 32] [--twin] [--twin-ranks 1 3]
                                  [--tail-ranks 3] [--tail-steps 8] [--tail-runs 1] [--skip-sim] [--skip-delta-twin]

Per scale and plane: the leader's blocked time per published version, the rollout ranks' decode-busy fraction
and their share of time on the delta plane (waiting in broadcasts, transfers, installs), groups dropped at the
staleness bound (and their share of groups issued), the share of decode time with under a quarter of an engine's
sequence slots running, trained groups per second and end-to-end time; then the same mean length with a thin
tail, and the broadcast with repack (tools/studies/repack.py: one tail rank per --ranks-per-tail rollout ranks,
taken from them). The last line is the issue's summary: measured figures filled in, the rest marked "not measured".

--twin also runs the CPU twin (local jobs under mpirun: tiny model, HF engine, 2 single-turn tasks) under each
delta transport (`delta.transport`: broadcast, relay) at each of --twin-ranks rollout ranks, and prints per run
the trainer leader's blocked time per published version (seconds inside its delta plane's send, over versions
sent), the seconds of its final flush (once, at the end: until every posted broadcast completed, or the root relay
took every push), the median time from a version's publish to its install on the last rollout rank that
installed it, and the rollout ranks' median install time; the last line then carries the relay/broadcast ratio
of the leader's blocked time at each rank count. It then runs jobs of the heavy-tailed `long_tail` kind (2 tasks,
log-normal completion lengths, p99 10x the median) at each of --tail-ranks rollout ranks, without and with repack
(`repack.enabled`, runtime/repack.py: the last rollout rank becomes the tail rank), and prints per job the groups
handed over, groups dropped at the staleness bound, the rollout ranks' busy fraction, the share of decode steps
under a quarter of a rank's sequence slots, the batches' padding and trained tokens per second; the last line's
repack/none throughput is the twin's trained tokens per second with repack over without, at the largest count.

Every cost is an assumption of configs/workloads/h100-heavy-tail.yaml (not measured on a GPU); bandwidths are
the flags above. Tasks: sim-paper.yaml's GSM8K-like single-turn task copied, max_new_tokens 8192 so the tail is
not cut, B 16 groups of G 8, staleness bound 1.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from marlaas_hpc.config import JobConfig  # noqa: E402
from marlaas_hpc.sim.engine import Simulation  # noqa: E402
from marlaas_hpc.sim.setup import copies_to, setup_from_job  # noqa: E402
from marlaas_hpc.sim.weight_sync import DeltaPlaneModel  # noqa: E402
from marlaas_hpc.sim.workload import load_workload  # noqa: E402
from studies.repack import RepackingRolloutSim, with_tail_ranks  # noqa: E402
from studies.tails import OccupancyRolloutSim, tail_costs  # noqa: E402

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


PLANES = {"broadcast": ("broadcast", None, "eager"), "broadcast-wait": ("broadcast", 0, "eager"),
          "relay": ("relay", None, "eager"), "relay-on-demand": ("relay", None, "on_demand")}
"""Rows: today's lockstep (leader posts, max_in_flight outstanding), the same with a leader that waits for each
broadcast (the delta plane before it posted asynchronously), the relay tier with every rank pulling every
version, and with ranks pulling only the versions their work asks for."""


def light_tail(workload):
    """The same mean completion length with a thin tail (sigma 0.25): what the tail alone costs."""
    profile = workload.profiles["default"]
    heavy = profile.response_tokens
    median = heavy.expected() / math.exp(0.25 ** 2 / 2)
    light = dataclasses.replace(heavy, median=median, sigma=0.25)
    return dataclasses.replace(workload, profiles={"default": dataclasses.replace(profile, response_tokens=light)})


def measure(n_tasks: int, rollout_ranks: int, steps: int, plane: DeltaPlaneModel, workload, seed: int,
            tail_ranks: int = 0) -> dict:
    """One run; `tail_ranks` > 0: that many of the rollout ranks are set aside as repack tail ranks."""
    sim = Simulation(heavy_tail_setup(n_tasks, rollout_ranks, steps), workload, seed=seed, trace=False,
                     delta_plane=plane, rollout_engine=RepackingRolloutSim if tail_ranks else OccupancyRolloutSim)
    if tail_ranks:
        with_tail_ranks(sim, tail_ranks)
    outcome = sim.run()
    end, tails = outcome.end_time, tail_costs(sim)
    assert set(outcome.ended.values()) == {"done"}, outcome.ended
    return {"blocked_ms": 1e3 * sim.delta_plane.meter.blocked_per_update(),
            "decode_busy": tails.decode_seconds / (rollout_ranks * end),
            "plane_share": sum(sim.delta_plane.meter.rank_seconds.values()) / (rollout_ranks * end),
            "dropped": tails.dropped_groups, "dropped_share": tails.dropped_groups / tails.issued_groups,
            "sparse": tails.sparse_fraction, "groups_per_s": tails.trained_groups / end, "e2e_s": end}


def averaged(n_tasks, ranks, steps, plane, workload, seeds, tail_ranks=0) -> dict:
    runs = [measure(n_tasks, ranks, steps, plane, workload, seed, tail_ranks) for seed in range(seeds)]
    return {key: sum(run[key] for run in runs) / len(runs) for key in runs[0]}


HEADER = (f"{'tasks':>5} {'GPUs':>4} {'plane':<18} {'tail':<5} {'blocked ms/upd':>14} {'decode busy':>11} "
          f"{'on plane':>8} {'dropped':>8} {'drop %':>6} {'sparse %':>8} {'groups/s':>8} {'e2e s':>8}")


def row(n_tasks, ranks, name, tail, r) -> str:
    return (f"{n_tasks:>5} {ranks:>4} {name:<18} {tail:<5} {r['blocked_ms']:>14.1f} {r['decode_busy']:>11.3f} "
            f"{r['plane_share']:>8.3f} {r['dropped']:>8.0f} {100 * r['dropped_share']:>6.2f} "
            f"{100 * r['sparse']:>8.1f} {r['groups_per_s']:>8.1f} {r['e2e_s']:>8.1f}")


def twin_job(transport: str, rollout_ranks: int, steps: int, long_tail: bool = False, repack: bool = False) -> dict:
    """The CPU twin's job: test-small's two single-turn tasks (bounds 0 and 2), `steps` steps each; `long_tail`:
    both tasks of the heavy-tailed `long_tail` kind instead (log-normal completion lengths, median 8 tokens, p99
    10x that, up to 128: tasks/synthetic.py), bounds 1 and 2."""
    import yaml

    job = yaml.safe_load((ROOT / "configs" / "test-small.yaml").read_text())
    job["layout"] = {"env_ranks": 1, "rollout_ranks": rollout_ranks, "trainer_tp": 1}
    job["delta"] = {"transport": transport}
    job["fault"] = {"on_rank_loss": "stop"}
    for index, task in enumerate(job["tasks"]):
        task["total_steps"] = steps
        if long_tail:
            task["dataset"].update(kind="long_tail", seed=index)
            task["algo"]["max_new_tokens"] = 128
            task["max_staleness"] = index + 1
    if repack:  # the last rollout rank becomes the tail rank (runtime/repack.py), the other settings defaults
        job["repack"] = {"enabled": True, "tail_ranks": 1}
    return job


def run_twin_job(job: dict, workdir: Path) -> Path:
    """Runs one local job (marlaas run) in `workdir`; returns its run dir."""
    import os
    import subprocess

    import yaml

    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "job.yaml").write_text(yaml.safe_dump(job))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    run_dir = workdir / "run"
    proc = subprocess.run([sys.executable, "-m", "marlaas_hpc.cli", "run", str(workdir / "job.yaml"), "--run-dir",
                           str(run_dir)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(f"twin job in {workdir} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return run_dir


def twin_run(transport: str, rollout_ranks: int, steps: int, workdir: Path) -> dict:
    """One local job; the leader's delta figures from summary.json, delivery and install times from timelines."""
    import json
    import statistics

    run_dir = run_twin_job(twin_job(transport, rollout_ranks, steps), workdir)
    summary = json.loads((run_dir / "summary.json").read_text())
    delta = next(iter(summary["trainer_groups"].values()))["delta"]
    published, installed, install_s = {}, {}, []
    for path in (run_dir / "timeline").glob("rank*.jsonl"):
        for record in map(json.loads, path.read_text().splitlines()):
            key = (tuple(record["tasks"]), record.get("version"))
            if record["stage"] == "publish":
                published[key] = record["end"]
            elif record["stage"] == "load_delta":
                installed[key] = max(installed.get(key, 0.0), record["end"])
                install_s.append(record["end"] - record["start"])
    delivery = [installed[key] - end for key, end in published.items() if key in installed]
    return {"blocked_ms": 1e3 * delta["blocked_s"] / max(delta["sent"], 1), "sent": delta["sent"],
            "flush_ms": 1e3 * delta["flush_s"],
            "delivery_ms": 1e3 * statistics.median(delivery), "install_ms": 1e3 * statistics.median(install_s),
            "wall_s": summary["wall_time_s"]}


def twin(ranks: list[int], steps: int) -> str:
    """Runs the CPU twin's table; returns the last line's CPU-twin part."""
    import tempfile

    print(f"\nCPU twin (local jobs, tiny model, HF engine, gloo; 2 tasks x {steps} steps):")
    print(f"{'transport':<10} {'rollout':>7} {'versions':>8} {'blocked ms/upd':>14} {'end flush ms':>12} "
          f"{'delivery ms':>11} {'install ms':>10} {'wall s':>7}", flush=True)
    blocked = {}
    with tempfile.TemporaryDirectory(prefix="bench_laminar_twin_") as tmp:
        for n in ranks:
            for transport in ("broadcast", "relay"):
                r = twin_run(transport, n, steps, Path(tmp) / f"{transport}{n}")
                blocked[transport, n] = r["blocked_ms"]
                print(f"{transport:<10} {n:>7} {r['sent']:>8} {r['blocked_ms']:>14.2f} {r['flush_ms']:>12.1f} "
                      f"{r['delivery_ms']:>11.1f} {r['install_ms']:>10.1f} {r['wall_s']:>7.1f}", flush=True)
    ratios = ", ".join(f"{n} rollout {blocked['relay', n]:.2f}/{blocked['broadcast', n]:.2f} ms" for n in ranks)
    return f"CPU twin leader blocked per update relay/broadcast: {ratios} (2 single-turn tasks, not heavy-tailed)"


def tail_run(rollout_ranks: int, steps: int, workdir: Path, repack: bool) -> dict:
    """One heavy-tailed twin job (broadcast), with or without repack: what its long tails cost, from summary.json,
    metrics.jsonl and the rollout ranks' timelines (groups handed over)."""
    import json

    run_dir = run_twin_job(twin_job("broadcast", rollout_ranks, steps, long_tail=True, repack=repack), workdir)
    summary = json.loads((run_dir / "summary.json").read_text())
    tasks = summary["tasks"].values()
    assert {task["status"] for task in tasks} == {"done"}, summary["tasks"]
    dropped = sum(task["dropped_groups"] for task in tasks)
    trained = sum(task["trained_samples"] for task in tasks) // 4  # G = 4
    occupancy = [o for o in summary["decode_occupancy"].values() if o]
    decode = sum(o["decode_steps"] for o in occupancy)
    slots = 4 * 4  # rollout_slots x G: a rank's sequence slots
    tokens = sum(json.loads(line)["tokens"] for path in run_dir.glob("tasks/**/metrics.jsonl")
                 for line in path.read_text().splitlines() if line.strip())
    return {"dropped": dropped, "drop_share": dropped / max(dropped + trained, 1),
            "busy": summary["busy_fraction"].get("rollout", 0.0),
            "sparse": sum(steps for o in occupancy for rows, steps in o["running"].items()
                          if 4 * int(rows) < slots) / max(decode, 1),
            "padding": 1 - sum(o["token_steps"] for o in occupancy) / max(sum(o["row_steps"] for o in occupancy), 1),
            "tokens_per_s": tokens / summary["wall_time_s"], "wall_s": summary["wall_time_s"],
            "handed": sum(line.count('"stage": "repack_out"') for path in (run_dir / "timeline").glob("rank*.jsonl")
                          for line in path.read_text().splitlines())}


def tail_twin(ranks: list[int], steps: int, runs: int) -> tuple[str, float | None]:
    """The heavy-tailed twin's table (`runs` jobs per rank count, without and with repack, alternating); returns
    the last line's part and the repack/none ratio of trained tokens per second at the largest rank count (the
    median over pairs of runs when there are several)."""
    import statistics
    import tempfile

    print(f"\nCPU twin, heavy-tailed kind (long_tail: log-normal lengths, median 8 tokens, p99 10x; tiny model, HF "
          f"engine, broadcast; 2 tasks, bounds 1 and 2, B 4 x G 4, {steps} steps each; sparse: decode steps under a "
          f"quarter of a rank's 16 sequence slots; padding: finished rows' share of the batches' row-steps; repack: "
          f"the last rollout rank is the tail rank):")
    print(f"{'rollout':>7} {'repack':<6} {'handed':>6} {'dropped':>7} {'drop %':>6} {'rollout busy':>12} "
          f"{'sparse %':>8} {'padding %':>9} {'tokens/s':>8} {'wall s':>7}", flush=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_laminar_tail_") as tmp:
        for n in ranks:
            for i in range(runs):
                for repack in (False, True) if n > 1 else (False,):
                    r = tail_run(n, steps, Path(tmp) / f"tail{n}-{i}-{repack}", repack)
                    results.setdefault((n, repack), []).append(r)
                    print(f"{n:>7} {'on' if repack else 'none':<6} {r['handed']:>6} {r['dropped']:>7} "
                          f"{100 * r['drop_share']:>6.1f} {r['busy']:>12.3f} {100 * r['sparse']:>8.1f} "
                          f"{100 * r['padding']:>9.1f} {r['tokens_per_s']:>8.1f} {r['wall_s']:>7.1f}", flush=True)

    def mean(n, repack, key):
        rs = results[n, repack]
        return sum(r[key] for r in rs) / len(rs)

    parts = []
    for n in ranks:
        part = f"{n} rollout: dropped {mean(n, False, 'dropped'):.1f} groups, sparse {100 * mean(n, False, 'sparse'):.0f}%"
        if (n, True) in results:
            part += (f" (repack: dropped {mean(n, True, 'dropped'):.1f}, sparse {100 * mean(n, True, 'sparse'):.0f}%, "
                     f"tokens/s {mean(n, True, 'tokens_per_s') / mean(n, False, 'tokens_per_s'):.2f}x)")
        parts.append(part)
    top = max(ranks)
    ratio = (mean(top, True, "tokens_per_s") / mean(top, False, "tokens_per_s")) if (top, True) in results else None
    if ratio is not None and runs > 1:  # runs alternate, so a pair shares the machine's load of the moment
        pairs = sorted(a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(results[top, True], results[top, False]))
        print(f"repack/none trained tokens/s per pair of runs at {top} rollout ranks: "
              + " ".join(f"{p:.2f}" for p in pairs), flush=True)
        ratio = statistics.median(pairs)  # a loaded machine's noise hits pairs alike
    return f"CPU twin heavy-tailed ({runs} run(s) each, means): " + ", ".join(parts), ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scales", nargs="+", default=["32:8", "1024:256"], help="tasks:rollout_ranks")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per task")
    parser.add_argument("--seeds", type=int, default=2, help="runs averaged per row (seeds 0..n-1)")
    parser.add_argument("--max-in-flight", type=int, default=16)
    parser.add_argument("--push-bandwidth", type=float, default=25e9, help="bytes/s, leader -> root relay")
    parser.add_argument("--relay-bandwidth", type=float, default=25e9, help="bytes/s, a relay's egress")
    parser.add_argument("--pull-bandwidth", type=float, default=25e9, help="bytes/s, node relay -> rollout rank")
    parser.add_argument("--fanout", type=int, default=2, help="relay tree fan-out (1: a chain)")
    parser.add_argument("--ranks-per-tail", type=int, default=32,
                        help="repack row: one tail rank per this many rollout ranks (at least one)")
    parser.add_argument("--twin", action="store_true", help="also run the CPU twin's delta-plane jobs (minutes)")
    parser.add_argument("--twin-ranks", type=int, nargs="+", default=[1, 3], help="rollout ranks per twin job")
    parser.add_argument("--twin-steps", type=int, default=6, help="optimizer steps per task in a twin job")
    parser.add_argument("--skip-sim", action="store_true", help="only the CPU twin (with --twin)")
    parser.add_argument("--tail-ranks", type=int, nargs="+", default=[3],
                        help="rollout ranks per heavy-tailed twin job (with --twin)")
    parser.add_argument("--tail-steps", type=int, default=8, help="optimizer steps per task, heavy-tailed twin")
    parser.add_argument("--tail-runs", type=int, default=1, help="heavy-tailed twin jobs per rank count")
    parser.add_argument("--skip-delta-twin", action="store_true",
                        help="with --twin: only the heavy-tailed jobs, not the delta-plane ones")
    args = parser.parse_args()
    heavy = load_workload(WORKLOAD)
    print(HEADER, flush=True)
    ratio = ratio_wait = repack_ratio = None
    for scale in [] if args.skip_sim else args.scales:
        n_tasks, ranks = (int(x) for x in scale.split(":"))
        results = {}
        for name, (plane, bound, pull) in PLANES.items():
            model = DeltaPlaneModel(plane=plane, max_in_flight=args.max_in_flight if bound is None else bound,
                                    push_bandwidth=args.push_bandwidth, relay_bandwidth=args.relay_bandwidth,
                                    pull_bandwidth=args.pull_bandwidth, relay_fanout=args.fanout,
                                    relay_pull=pull)
            results[name] = averaged(n_tasks, ranks, args.steps, model, heavy, args.seeds)
            print(row(n_tasks, ranks, name, "heavy", results[name]), flush=True)
        light = averaged(n_tasks, ranks, args.steps, DeltaPlaneModel(max_in_flight=args.max_in_flight),
                         light_tail(heavy), args.seeds)
        print(row(n_tasks, ranks, "broadcast", "light", light), flush=True)
        tails = max(1, ranks // args.ranks_per_tail)
        repack = averaged(n_tasks, ranks, args.steps, DeltaPlaneModel(max_in_flight=args.max_in_flight), heavy,
                          args.seeds, tail_ranks=tails)
        print(row(n_tasks, ranks, f"broadcast+repack{tails}", "heavy", repack), flush=True)
        if n_tasks == 1024:
            ratio = results["relay"]["blocked_ms"] / results["broadcast"]["blocked_ms"]
            ratio_wait = results["relay"]["blocked_ms"] / results["broadcast-wait"]["blocked_ms"]
            repack_ratio = repack["groups_per_s"] / results["broadcast"]["groups_per_s"]
    blocked = (f"{ratio:.2f} (against a leader waiting for each broadcast: {ratio_wait:.2f})" if ratio is not None
               else "not measured (no 1024-task scale run)")
    throughput = (f"{repack_ratio:.2f} in the simulator (trained groups/s at 1024 tasks)" if ratio is not None
                  else "not measured in the simulator (no 1024-task scale run)")
    twin_line, twin_ratio = "CPU twin not run (--twin)", None
    if args.twin:
        parts = [] if args.skip_delta_twin else [twin(args.twin_ranks, args.twin_steps)]
        tail_line, twin_ratio = tail_twin(args.tail_ranks, args.tail_steps, args.tail_runs)
        twin_line = "; ".join(parts + [tail_line])
    twin_throughput = (f"{twin_ratio:.2f} (CPU twin, trained tokens/s at {max(args.tail_ranks)} rollout ranks, "
                       f"median of {args.tail_runs} pair(s))"
                       if twin_ratio is not None else "not measured on the CPU twin (--twin)")
    print(f"relay/broadcast leader blocked {blocked}; repack/none throughput {twin_throughput}, {throughput}; "
          f"{twin_line}")


if __name__ == "__main__":
    main()
