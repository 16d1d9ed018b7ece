"""`marlaas report RUN_DIR [RUN_DIR ...] [-o OUT]`: figures (PNG) and a Markdown summary of finished or running
jobs, and TensorBoard event files beside each task's metrics.jsonl (written by the trainer as it steps).

    run dir ──load_run──► RunData(summary, metrics per task, busy spans) ──► plots.* (PNG) + markdown (report.md)
"""
from __future__ import annotations

from pathlib import Path

from marlaas_hpc.report.load import RunData, load_run


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def comparison_row(run: RunData) -> dict:
    tasks = run.summary["tasks"].values()
    return {"e2e_s": run.summary.get("wall_time_s", run.summary.get("elapsed_s")),
            "busy": run.summary.get("busy_fraction") or {},
            "ttfs_mean_s": _mean(t["ttfs_s"] for t in tasks), "tpts_mean_s": _mean(t["tpts_s"] for t in tasks)}


def write_report(run_dirs: list[str | Path], out: str | Path) -> Path:
    """Writes OUT/report.md and its PNGs (one subfolder per run when there are several); returns report.md."""
    from marlaas_hpc.report import markdown, plots

    out = Path(out)
    runs = [load_run(d) for d in run_dirs]
    lines = ["# marlaas report", ""]
    for i, run in enumerate(runs):
        sub = Path(f"{i + 1}-{run.name}") if len(runs) > 1 else Path(".")
        (out / sub).mkdir(parents=True, exist_ok=True)
        figures = {"reward curves and eval accuracy": plots.reward_curves(run, out / sub),
                   "utilisation timeline": plots.utilisation_gantt(run, out / sub),
                   "TTFS and TPTS per task": plots.ttfs_tpts(run, out / sub)}
        lines += markdown.run_section(run, {title: str(p.relative_to(out)) for title, p in figures.items()})
    if len(runs) > 1:
        rows = [comparison_row(run) for run in runs]
        figure = plots.comparison(runs, rows, out)
        lines += markdown.comparison_section(runs, rows, str(figure.relative_to(out)))
    report = out / "report.md"
    report.write_text("\n".join(lines))
    return report
