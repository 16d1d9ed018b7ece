"""The report's figures (matplotlib, Agg backend): reward curves, the utilisation Gantt chart, TTFS/TPTS per
task, and the comparison of several runs."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from marlaas_hpc.report.load import RunData  # noqa: E402

ROLE_ORDER = {"rollout": 0, "env": 1, "trainer": 2}


def task_colours(run: RunData) -> dict[str, tuple]:
    palette = plt.get_cmap("tab20")
    return {task_id: palette(i % 20) for i, task_id in enumerate(sorted(run.summary.get("tasks", {})))}


def reward_curves(run: RunData, out: Path) -> Path:
    """Left: each task's mean training reward per version. Right: greedy eval accuracy before -> after."""
    tasks = run.summary["tasks"]
    colours = task_colours(run)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    for task_id, records in run.metrics.items():
        if records:
            left.plot([r["version"] for r in records], [r["reward_mean"] for r in records], marker=".",
                      color=colours[task_id], label=f"{task_id} ({tasks[task_id]['status']})")
    left.set(xlabel="policy version (optimizer steps)", ylabel="mean reward of the step's samples",
             title="training reward per task")
    left.legend(fontsize=8)
    names = list(tasks)
    for i, task_id in enumerate(names):
        before, after = tasks[task_id]["eval_accuracy_before"], tasks[task_id]["eval_accuracy_after"]
        right.bar(i - 0.2, before or 0.0, 0.4, color="lightgrey", label="before" if i == 0 else None)
        right.bar(i + 0.2, after or 0.0, 0.4, color=colours[task_id], label="after" if i == 0 else None)
    right.set_xticks(range(len(names)), names, rotation=30, fontsize=8)
    right.set(ylim=(0, 1), ylabel="greedy eval accuracy", title="eval accuracy: base model vs final adapter")
    right.legend(fontsize=8)
    return _save(fig, out / "reward_curves.png")


def task_models(run: RunData) -> dict[str, str]:
    """Each task's base model (summary.json's `base_model`; tasks of a run dir from before it have none)."""
    return {task_id: info["base_model"] for task_id, info in run.summary.get("tasks", {}).items()
            if info.get("base_model")}


def model_colours(run: RunData) -> dict[str, tuple]:
    """A colour per base model when the job served several (the Gantt chart's rollout rows), else none."""
    models = sorted(set(task_models(run).values()))
    if len(models) < 2:
        return {}
    palette = plt.get_cmap("Set1")
    return {f"model {model}": palette(i % 9) for i, model in enumerate(models)}


def span_keys(span: dict, model_of: dict[str, str], by_model: bool) -> list[str]:
    """What a busy span's stripes stand for: its tasks, or on a rollout rank of a several-model job the
    models of its tasks (which engine the rank was running)."""
    tasks = span["tasks"] or ["(none)"]
    if not (by_model and span["role"] == "rollout"):
        return tasks
    return sorted({f"model {model_of[t]}" for t in tasks if t in model_of}) or tasks


def utilisation_gantt(run: RunData, out: Path) -> Path:
    """One row per worker rank; each busy span coloured by the task(s) it served (stripes when it served
    several at once: a continuous batch, a fused train step). With several base models the rollout rows are
    coloured by model instead: which model's engine each rank ran when."""
    ranks = sorted({(s["role"], s["rank"]) for s in run.timeline}, key=lambda rr: (ROLE_ORDER.get(rr[0], 9), rr[1]))
    row_of = {rank: i for i, (_, rank) in enumerate(ranks)}
    by_model = model_colours(run)
    colours = {**task_colours(run), **by_model}
    model_of = task_models(run)
    t0 = run.job_start
    fig, ax = plt.subplots(figsize=(13, 1.0 + 0.6 * max(1, len(ranks))))
    bars: dict[tuple, list] = {}
    for span in run.timeline:
        keys = span_keys(span, model_of, bool(by_model))
        height = 0.8 / len(keys)
        for j, key in enumerate(keys):
            y = row_of[span["rank"]] - 0.4 + j * height
            bars.setdefault((key, y, height), []).append((span["start"] - t0, span["end"] - span["start"]))
    for (key, y, height), spans in bars.items():
        ax.broken_barh(spans, (y, height), facecolors=colours.get(key, "grey"))
    if not ranks:
        ax.text(0.5, 0.5, "no timeline recorded (timeline/rank<N>.jsonl)", ha="center", transform=ax.transAxes)
    ax.set_yticks(range(len(ranks)), [f"rank {rank} {role}{_group_label(run, role, rank)}" for role, rank in ranks])
    ax.invert_yaxis()
    wall = run.summary.get("wall_time_s") or run.summary.get("elapsed_s")
    if wall:
        ax.set_xlim(0, wall)
    ax.set(xlabel="seconds since the job started", title=f"utilisation timeline: {run.label}")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    ax.legend(handles, list(colours), loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8,
              title="task / model" if by_model else "task")
    return _save(fig, out / "utilisation_gantt.png")


def _group_label(run: RunData, role: str, rank: int) -> str:
    """' g<N>' for a trainer rank of trainer group N, when the job has several groups (summary 'trainer_groups')."""
    groups = run.summary.get("trainer_groups") or {}
    if role != "trainer" or len(groups) < 2:
        return ""
    return next((f" g{g}" for g, info in groups.items() if rank in info.get("ranks", ())), "")


def ttfs_tpts(run: RunData, out: Path) -> Path:
    tasks = run.summary["tasks"]
    names = list(tasks)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "ttfs_s", "TTFS: submitted -> first optimizer step"),
                           (axes[1], "tpts_s", "TPTS: mean time between optimizer steps")):
        ax.bar(range(len(names)), [tasks[t][key] or 0.0 for t in names],
               color=[task_colours(run)[t] for t in names])
        ax.set_xticks(range(len(names)), names, rotation=30, fontsize=8)
        ax.set(ylabel="seconds", title=title)
    return _save(fig, out / "ttfs_tpts.png")


def comparison(runs: list[RunData], rows: list[dict], out: Path) -> Path:
    """Side by side: e2e time, busy fraction per role, mean TTFS and TPTS of each run."""
    fig, axes = plt.subplots(1, 4, figsize=(16, 4))
    labels = [run.label for run in runs]
    x = range(len(runs))
    axes[0].bar(x, [r["e2e_s"] for r in rows], color="tab:blue")
    roles = ("rollout", "env", "trainer")
    for k, role in enumerate(roles):
        axes[1].bar([i + (k - 1) * 0.27 for i in x], [r["busy"].get(role) or 0.0 for r in rows], 0.27, label=role)
    axes[1].legend(fontsize=8)
    axes[2].bar(x, [r["ttfs_mean_s"] or 0.0 for r in rows], color="tab:orange")
    axes[3].bar(x, [r["tpts_mean_s"] or 0.0 for r in rows], color="tab:green")
    for ax, title in zip(axes, ("end-to-end time (s)", "busy fraction per role", "mean TTFS (s)", "mean TPTS (s)")):
        ax.set_xticks(list(x), labels, rotation=20, fontsize=8)
        ax.set_title(title)
    return _save(fig, out / "comparison.png")


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
