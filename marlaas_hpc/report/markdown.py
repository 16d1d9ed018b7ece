"""The report's Markdown: per run, the job figures and a per-task table taken from summary.json (same numbers,
3 decimals), links to the figures; for several runs, their comparison table."""
from __future__ import annotations

from marlaas_hpc.report.load import RunData

TASK_COLUMNS = (("model", "base_model"), ("status", "status"), ("steps", "steps_done"), ("k", "staleness_bound"),
                ("reward first", "reward_first"), ("reward last", "reward_last"),
                ("eval acc before", "eval_accuracy_before"), ("eval acc after", "eval_accuracy_after"),
                ("TTFS s", "ttfs_s"), ("TPTS s", "tpts_s"))


def fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]


def run_section(run: RunData, figures: dict[str, str]) -> list[str]:
    s = run.summary
    state = "finished" if run.finished else "still running (status.json)"
    lines = [f"## {run.label}", "", f"- run dir: `{run.run_dir}` ({state}); engine {s.get('engine', '-')}, "
             f"model {s.get('model', '-')}",
             f"- wall time: {fmt(s.get('wall_time_s', s.get('elapsed_s')))} s (start-up {fmt(s.get('startup_s'))} s)"]
    busy = s.get("busy_fraction") or {}
    if busy:
        lines.append("- busy fraction: " + ", ".join(f"{role} {fmt(v)}" for role, v in busy.items()))
    groups = s.get("trainer_groups") or {}
    if len(groups) > 1:
        lines.append("- trainer groups: " + "; ".join(
            f"g{g} (ranks {', '.join(map(str, info['ranks']))}) busy {fmt(info['busy_fraction'])}, tasks "
            f"{', '.join(info['tasks']) or '-'}" for g, info in groups.items()))
    lines += ["", *table(["task", "tenant"] + [name for name, _ in TASK_COLUMNS],
                         [[task_id, t["tenant"]] + [t.get(key) for _, key in TASK_COLUMNS]
                          for task_id, t in s["tasks"].items()])]
    if s.get("rejected"):
        lines += ["", "Refused tasks:", *[f"- `{task_id}`: {reason}" for task_id, reason in s["rejected"].items()]]
    lines.append("")
    lines += [f"![{title}]({path})" for title, path in figures.items()]
    return lines + [""]


def comparison_section(runs: list[RunData], rows: list[dict], figure: str) -> list[str]:
    header = ["run", "e2e s", "busy rollout", "busy env", "busy trainer", "mean TTFS s", "mean TPTS s"]
    body = [[run.label, r["e2e_s"], r["busy"].get("rollout"), r["busy"].get("env"), r["busy"].get("trainer"),
             r["ttfs_mean_s"], r["tpts_mean_s"]] for run, r in zip(runs, rows)]
    return ["## Comparison", "", *table(header, body), "", f"![comparison]({figure})", ""]
