"""Fits a workload model to measured runs (their timeline/rank<N>.jsonl and config), so that `marlaas
simulate` of the same config predicts the run's e2e time, busy fractions, TTFS and TPTS.

What each parameter is fitted from (spans are the BusyClock records every rank writes):
    rollout.decode_step, batch_exponent  engine-step time vs running sequences: log t = log a + e log b, with b
                                         counted from the prompt groups open in the engine at the step
    rollout.step_overhead                median gap between consecutive engine steps (< 20 ms: host time)
    rollout.adapter_load                 median load_delta span minus the transfer
    rollout.join_wait_steps              publishes that met a busy engine vs those that did not
    env.group_overhead, reward_per_      env 'turn' spans (book-keeping) vs the group turns and episodes in them
      sample, rollout_ / trainer_        and the share of the span the rollout / trainer ranks were busy (least
      contention                         squares), plus the pool's step time over its workers per episode
    trainer.step_fixed, per_token,       train spans minus their publishes: least squares on tokens, fused
      per_task, overlap_cost             tasks and the share of the span the rollout ranks were busy (>= 0)
    trainer.admit, publish_fixed,        admit spans minus publish; lower quartile of publish spans minus
      broadcast_setup                    transfer (the wait for engines to join is simulated); the extra time
                                         of the first (warm-up) publishes
    network.adapter_bytes_per_rank       publish bytes / LoRA rank; message_latency: group end -> score start
    profiles[kind]                       prompt and completion lengths of each kind's groups (quantiles)
    control.per_event, admit,            rank 0's busy time per stage (summary.json 'scheduler_rank'): 'event'
      eval_result                        and 'status' time per event handled, 'admit' time per task submitted,
                                         'eval' time per eval result (totals over counts: the busy time is kept);
                                         runs from before issue 30 (no such figures) leave them at 0
Assumed, not fitted (one TP size and no tool calls in these runs): trainer.tp_exponent, delta_bandwidth,
prefill_per_token (folded into the step time), tool latencies.
"""
from __future__ import annotations

import bisect
import json
import math
import statistics
from pathlib import Path

import numpy as np
import yaml

from marlaas_hpc.config import JobConfig
from marlaas_hpc.sim.workload import (ControlModel, Distribution, EnvModel, NetworkModel, RolloutModel,
                                      TaskProfile, TrainerModel, Workload)

ASSUMED_DELTA_BANDWIDTH = 1e9
"""Bytes/s of the CPU (gloo, loopback) delta broadcast; the adapters here are < 1 MB, so it barely matters."""
ASSUMED_TP_EXPONENT = 0.8
QUANTILES = 32


class RunData:
    """One measured run: its config and timeline records."""

    def __init__(self, run_dir: str | Path, config: str | Path | None = None):
        self.dir = Path(run_dir)
        self.summary = json.loads((self.dir / "summary.json").read_text())
        config = config or self.dir / "config.yaml"
        self.job = JobConfig.load(config)
        self.records = [json.loads(line) for path in sorted((self.dir / "timeline").glob("rank*.jsonl*"))
                        for line in _text(path).splitlines() if line.strip()]

    def stage(self, role: str, stage: str) -> list[dict]:
        return [r for r in self.records if r["role"] == role and r["stage"] == stage]


def _text(path: Path) -> str:
    """A timeline file, plain or gzipped (fixtures keep them small)."""
    if path.suffix == ".gz":
        import gzip

        return gzip.decompress(path.read_bytes()).decode()
    return path.read_text()


def _median(values, default=0.0) -> float:
    values = list(values)
    return statistics.median(values) if values else default


def fit_rollout(runs: list[RunData]) -> RolloutModel:
    batches, times, gaps, loads = [], [], [], []
    for run in runs:
        groups = run.stage("rollout", "group")
        for rank in {r["rank"] for r in groups}:
            steps = sorted((r for r in run.stage("rollout", "generate") if r["rank"] == rank), key=lambda r: r["start"])
            mine = [g for g in groups if g["rank"] == rank]
            for span in steps:
                mid = (span["start"] + span["end"]) / 2
                running = sum(len(g["completion_tokens"]) for g in mine if g["start"] <= mid <= g["end"])
                batches.append(max(1, running))
                times.append((span["end"] - span["start"]) / span["steps"])
            gaps += [b["start"] - a["end"] for a, b in zip(steps, steps[1:]) if 0 <= b["start"] - a["end"] < 0.02]
        loads += [r["end"] - r["start"] for r in run.stage("rollout", "load_delta")]
    slope, intercept = np.polyfit(np.log(batches), np.log(times), 1) if len(set(batches)) > 1 else (0.0, math.log(_median(times)))
    exponent = float(min(1.0, max(0.0, slope)))
    # the scale keeps the total engine time (busy fractions are sums; a median would drop slow steps)
    decode = float(np.sum(times) / np.sum(np.power(batches, exponent)))
    transfer = _median(_publish_bytes(runs)) / ASSUMED_DELTA_BANDWIDTH
    return RolloutModel(batching="continuous", decode_step=decode, batch_exponent=exponent,
                        step_overhead=_median(gaps), prefill_per_token=0.0,
                        join_wait_steps=0.5,  # set by calibrate() once the publish cost is known
                        adapter_load=max(0.0, _median(loads) - transfer))


def _join_wait_steps(runs: list[RunData], publish_fixed: float) -> float:
    """Mean extra time of the publishes that met a busy engine (it was in a generate span when the publish
    began) over the fixed publish cost, in mean engine steps."""
    waits, steps_s = [], []
    for run in runs:
        steps = run.stage("rollout", "generate")
        steps_s += [(s["end"] - s["start"]) / s["steps"] for s in steps]
        pubs = sorted(run.stage("trainer", "publish"), key=lambda r: r["start"])
        for pub in pubs[_warm_up([p["end"] - p["start"] for p in pubs]):]:
            step = float(np.mean(steps_s)) if steps_s else 0.0
            # the engine was stepping around then (between two steps the rank is still busy handing out results)
            if any(s["start"] - step <= pub["start"] <= s["end"] + step for s in steps):
                waits.append(pub["end"] - pub["start"] - pub["bytes"] / ASSUMED_DELTA_BANDWIDTH - publish_fixed)
    if not waits or not steps_s:
        return 0.5
    return max(0.0, float(np.mean(waits)) / float(np.mean(steps_s)))


def _publish_bytes(runs: list[RunData]) -> list[float]:
    return [r["bytes"] for run in runs for r in run.stage("trainer", "publish")]


def fit_env(runs: list[RunData]) -> EnvModel:
    """The env rank is busy with its own book-keeping of every group turn (opening the group, resetting its
    episodes' envs, handing their steps to the pool: the 'turn' spans) and with the env steps themselves, which
    its pool spreads over several workers. The group turn of an unmerged turn span is the 'score' record that
    starts in it (merged spans also cover the gaps between their turns), so

        turn span = group_overhead * groups + per_sample * episodes + contention with the rollout / trainer ranks

    (pro rata of the span they were busy; least squares, coefficients >= 0). The pool's mean step time over its
    workers (tools, verifier: summary.json env_ranks) is added to the per-sample time. The spread of the spans
    holding one eval group (one episode) sets the lognormal's sigma; its median keeps the fitted mean."""
    rows, durations, single = [], [], []
    for run in runs:
        generate, train = run.stage("rollout", "generate"), run.stage("trainer", "train")
        starts = sorted((s["start"], s["samples"]) for s in run.stage("env", "score"))
        for span in run.stage("env", "turn"):
            if span["steps"] != 1:
                continue  # merged back-to-back turns: the span also covers the (< 5 ms) gaps between them
            inside = starts[bisect.bisect_left(starts, (span["start"] - 1e-6,)):
                            bisect.bisect_right(starts, (span["end"] + 1e-6, math.inf))]
            episodes = sum(samples for _, samples in inside)
            rows.append([len(inside), episodes, _overlap(span, generate), _overlap(span, train)])
            durations.append(span["end"] - span["start"])
            if len(inside) == 1 and episodes == 1:
                single.append(durations[-1])
    overhead, per_sample, rollout, trainer = (_nonnegative_least_squares(np.array(rows), np.array(durations))
                                              if rows else (0.0, 0.0, 0.0, 0.0))
    per_sample += _mean([_pool_step_s(run) for run in runs])
    logs = [math.log(max(d, 1e-7)) for d in single]
    sigma = statistics.pstdev(logs) if len(logs) > 1 else 0.0
    return EnvModel(group_overhead=overhead, rollout_contention=rollout, trainer_contention=trainer,
                    reward_per_sample=Distribution(dist="lognormal", median=per_sample / math.exp(sigma ** 2 / 2),
                                                   sigma=sigma))


def _pool_step_s(run: RunData) -> float:
    """Busy seconds of the env pool per env step (mean step time over the pool's workers), over the env ranks.
    Steps that wait on a service ran on the pool's I/O lane ('step:io'), hold no worker and are not counted."""
    figures = [(stats["pool"]["stages"]["step"], stats["pool"]["workers"])
               for stats in (run.summary.get("env_ranks") or {}).values()
               if "step" in stats.get("pool", {}).get("stages", {})]
    return _mean([step["mean"] / workers for step, workers in figures])


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else 0.0


def _inside(span: dict, records: list[dict]) -> list[dict]:
    return [r for r in records if r["rank"] == span["rank"] and span["start"] <= r["start"] and r["end"] <= span["end"] + 1e-6]


def fit_trainer(runs: list[RunData]) -> TrainerModel:
    rows, compute, admits, publishes, setups, warm_ups = [], [], [], [], [], []
    for run in runs:
        tp = run.job.layout.trainer_tp ** ASSUMED_TP_EXPONENT  # back to TP=1 figures
        pubs = sorted(run.stage("trainer", "publish"), key=lambda r: r["start"])
        publish_s = [p["end"] - p["start"] - p["bytes"] / ASSUMED_DELTA_BANDWIDTH for p in pubs]
        warm = _warm_up(publish_s)
        warm_ups.append(warm)
        setups += [p - _median(publish_s) for p in publish_s[:warm]]
        publishes += publish_s[warm:]
        generate = run.stage("rollout", "generate")
        for span in run.stage("trainer", "train"):
            inner = sum(p["end"] - p["start"] for p in _inside(span, pubs))
            rows.append([1.0, span["tokens"], len(span["tasks"]), _overlap(span, generate)])
            compute.append((span["end"] - span["start"] - inner) * tp)
        admit_spans = sorted(run.stage("trainer", "admit"), key=lambda r: r["start"])
        for span in admit_spans[1:]:  # the first carries the one-off broadcast set-up
            admits.append((span["end"] - span["start"] - sum(p["end"] - p["start"] for p in _inside(span, pubs))) * tp)
    fixed, per_token, per_task, overlap = _nonnegative_least_squares(np.array(rows), np.array(compute))
    return TrainerModel(step_fixed=fixed, per_token=per_token, per_task=per_task, overlap_cost=overlap,
                        tp_exponent=ASSUMED_TP_EXPONENT,
                        admit=max(0.0, _median(admits)), publish_fixed=_lower_quartile(publishes),
                        broadcast_setup=_mean(setups),
                        warm_up_broadcasts=max(1, round(_median(warm_ups, 1))))


def _warm_up(publish_s: list[float]) -> int:
    """The first broadcasts are slow (communicator and transfer set-up, seen on the first one or two):
    how many leading publishes take over 5x the median."""
    typical = _median(publish_s)
    count = 0
    while count < len(publish_s) and publish_s[count] > 5 * typical:
        count += 1
    return count


def _lower_quartile(values: list[float]) -> float:
    """A publish waits for every rollout rank to finish its engine step before the broadcast; the simulator
    adds that wait itself, so the fixed part is a publish that found the engines idle: the lower quartile."""
    values = sorted(values)
    return max(0.0, values[len(values) // 4]) if values else 0.0


def _overlap(span: dict, busy: list[dict]) -> float:
    """Fraction of the span during which the rollout ranks were busy (averaged over the ranks)."""
    ranks = {b["rank"] for b in busy} or {None}
    covered = sum(max(0.0, min(span["end"], b["end"]) - max(span["start"], b["start"])) for b in busy)
    return covered / max(span["end"] - span["start"], 1e-9) / len(ranks)


def _nonnegative_least_squares(a: np.ndarray, b: np.ndarray) -> tuple[float, ...]:
    """Least squares over every subset of the columns, keeping the best fit with no negative coefficient
    (at most four columns: 15 subsets)."""
    best, best_err = np.zeros(a.shape[1]), float("inf")
    for mask in range(1, 2 ** a.shape[1]):
        cols = [i for i in range(a.shape[1]) if mask >> i & 1]
        coef, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
        if (coef < 0).any():
            continue
        err = float(((a[:, cols] @ coef - b) ** 2).sum())
        if err < best_err:
            best, best_err = np.zeros(a.shape[1]), err
            best[cols] = coef
    return tuple(float(x) for x in best)


def fit_network(runs: list[RunData]) -> NetworkModel:
    per_rank, latency = [], []
    for run in runs:
        ranks = {t.task_id: t.lora.rank for t in run.job.tasks}
        per_rank += [r["bytes"] / ranks[r["tasks"][0]] for r in run.stage("trainer", "publish") if r["tasks"][0] in ranks]
        latency += _group_to_score_gaps(run)
    return NetworkModel(adapter_bytes_per_rank=_median(per_rank), delta_bandwidth=ASSUMED_DELTA_BANDWIDTH,
                        delta_latency=0.0, message_latency=_median(latency))


def _group_to_score_gaps(run: RunData) -> list[float]:
    """Time from a prompt group leaving the engine to the next score span of its task starting (one hop,
    plus any wait in the env rank's queue: the median keeps the hop)."""
    scores: dict[str, list[float]] = {}
    for r in run.stage("env", "score"):
        scores.setdefault(r["tasks"][0], []).append(r["start"])
    for starts in scores.values():
        starts.sort()
    gaps = []
    for g in run.stage("rollout", "group"):
        starts = scores.get(g["tasks"][0], [])
        i = bisect.bisect_left(starts, g["end"])
        if i < len(starts):
            gaps.append(starts[i] - g["end"])
    return gaps


def fit_control(runs: list[RunData]) -> ControlModel:
    """Rank 0's time per thing it handles, from the exact busy time and count of each of its stages (summary.json
    'scheduler_rank', its BusyClock; its merged timeline records also cover the gaps between events). The
    time-driven status.json rewrites are charged to the events, whose rate drives them in a busy job."""
    totals: dict[str, list[float]] = {}
    for run in runs:
        for stage, figures in (run.summary.get("scheduler_rank") or {}).get("stages", {}).items():
            total = totals.setdefault(stage, [0.0, 0])
            total[0] += figures["busy_s"]
            total[1] += figures["count"]

    def per(stage: str, extra: float = 0.0) -> float:
        busy, count = totals.get(stage, (0.0, 0))
        return (busy + extra) / count if count else 0.0

    return ControlModel(per_event=per("event", totals.get("status", (0.0, 0))[0]), admit=per("admit"),
                        eval_result=per("eval"))


def _quantiles(values: list[float]) -> Distribution:
    values = sorted(values)
    if len(set(values)) == 1:
        return Distribution(value=float(values[0]))
    picks = [values[min(len(values) - 1, int((i + 0.5) / QUANTILES * len(values)))] for i in range(QUANTILES)]
    return Distribution(dist="empirical", values=tuple(float(v) for v in picks))


def fit_profiles(runs: list[RunData]) -> dict[str, TaskProfile]:
    prompts: dict[str, list[float]] = {}
    completions: dict[str, list[float]] = {}
    for run in runs:
        kinds = {t.task_id: t.dataset.kind for t in run.job.tasks}
        for g in run.stage("rollout", "group"):
            kind = kinds.get(g["tasks"][0], "default")
            prompts.setdefault(kind, []).append(g["prompt_tokens"])
            completions.setdefault(kind, []).extend(g["completion_tokens"])
    profiles = {kind: TaskProfile(prompt_tokens=_quantiles(prompts[kind]),
                                  response_tokens=_quantiles(completions[kind])) for kind in prompts}
    all_prompts = [p for values in prompts.values() for p in values]
    all_completions = [c for values in completions.values() for c in values]
    profiles["default"] = TaskProfile(prompt_tokens=_quantiles(all_prompts),
                                      response_tokens=_quantiles(all_completions))
    return profiles


def calibrate(run_dirs: list[str | Path], config: str | Path | None = None) -> Workload:
    runs = [RunData(d, config) for d in run_dirs]
    names = ", ".join(f"{r.dir.name} ({r.summary['mode']}, {r.summary['wall_time_s']:.1f} s)" for r in runs)
    rollout, trainer = fit_rollout(runs), fit_trainer(runs)
    rollout.join_wait_steps = _join_wait_steps(runs, trainer.publish_fixed)
    return Workload(description=f"Fitted by tools/calibrate.py from measured runs: {names}. Assumed: "
                                f"tp_exponent {ASSUMED_TP_EXPONENT}, delta bandwidth 1 GB/s, prefill inside the "
                                "step time, no tool calls.",
                    rollout=rollout, env=fit_env(runs), trainer=trainer,
                    network=fit_network(runs), control=fit_control(runs), profiles=fit_profiles(runs), evals=True)


def dump_workload(workload: Workload) -> str:
    return yaml.safe_dump(workload.to_dict(), sort_keys=False, width=110)


# ---------------------------------------------------------------- checking a fit
def compare(run_dirs, workload: Workload, config: str | Path | None = None, seed: int = 0) -> dict:
    """Simulated vs measured figures of repeated runs of one config and mode (one run dir, or several: the
    measured value is their mean): {metric: (simulated, measured mean, [measured per run])}."""
    from marlaas_hpc.sim.engine import Simulation
    from marlaas_hpc.sim.report import summarize
    from marlaas_hpc.sim.setup import setup_from_job

    runs = [RunData(d, config) for d in ([run_dirs] if isinstance(run_dirs, (str, Path)) else run_dirs)]
    sim = Simulation(setup_from_job(runs[0].job, mode=runs[0].summary["mode"]), workload, seed=seed)
    predicted = summarize(sim, sim.run(), seed)
    measured = [_measured(run.summary) for run in runs]
    out = {}
    for metric, simulated in (("e2e_s", predicted["wall_time_s"]), ("ttfs_s", predicted["ttfs_mean_s"]),
                              ("tpts_s", predicted["tpts_mean_s"]),
                              *((f"busy_{role}", value) for role, value in predicted["busy_fraction"].items())):
        values = [m[metric] for m in measured if metric in m]
        if values:  # rank 0's busy fraction is measured only since issue 30
            out[metric] = (simulated, sum(values) / len(values), values)
    return out


def _measured(summary: dict) -> dict:
    tasks = summary["tasks"].values()
    out = {"e2e_s": summary["wall_time_s"], **{f"busy_{k}": v for k, v in summary["busy_fraction"].items()}}
    for metric in ("ttfs_s", "tpts_s"):
        values = [t[metric] for t in tasks if t[metric] is not None]
        out[metric] = sum(values) / len(values)
    return out


def predict_vs_measured(run_dirs, workload: Workload, config: str | Path | None = None) -> list[str]:
    dirs = [run_dirs] if isinstance(run_dirs, (str, Path)) else list(run_dirs)
    mode = json.loads((Path(dirs[0]) / "summary.json").read_text())["mode"]
    rows = []
    for metric, (sim, real, each) in compare(dirs, workload, config).items():
        error = (sim - real) / real if real else float("nan")
        spread = f"  (runs: {', '.join(f'{v:.3f}' for v in each)})" if len(each) > 1 else ""
        rows.append(f"{mode:<10} {metric:<13} simulated {sim:8.3f}  measured {real:8.3f}  error {error:+7.1%}{spread}")
    return rows
