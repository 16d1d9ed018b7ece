"""Reading a run dir: summary.json (or the live status.json), each task's metrics.jsonl, every rank's timeline."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

BUSY_STAGES = {"rollout": ("generate", "load_delta"), "env": ("score",),
               "trainer": ("train", "admit", "move_out", "move_in")}
"""Timeline stages that are a rank's busy time. 'group' (a prompt group's life in the engine) and 'publish'
(inside a train/admit span) are notes, not busy time of their own."""


@dataclass
class RunData:
    run_dir: Path
    summary: dict
    """summary.json, or status.json of a job still running (then `finished` is False)."""
    finished: bool
    metrics: dict[str, list[dict]] = field(default_factory=dict)
    """Per task: its metrics.jsonl records (one per optimizer step), in order."""
    timeline: list[dict] = field(default_factory=list)
    """Busy spans of every rank (timeline/rank<N>.jsonl), notes left out."""

    @property
    def name(self) -> str:
        """The run dir's name; bench_modes leaves .../<mode>/run: such dirs are named after their parent."""
        return self.run_dir.parent.name if self.run_dir.name == "run" else self.run_dir.name

    @property
    def label(self) -> str:
        mode = self.summary.get("mode", "?")
        return self.name if self.name == mode else f"{self.name} ({mode})"

    @property
    def job_start(self) -> float:
        """Time zero of the plots: the summary's job_start, else the earliest span."""
        start = self.summary.get("job_start")
        if start is not None:
            return float(start)
        return min((span["start"] for span in self.timeline), default=0.0)


def load_run(run_dir: str | Path) -> RunData:
    run_dir = Path(run_dir)
    path = run_dir / "summary.json"
    finished = path.is_file()
    if not finished:
        path = run_dir / "status.json"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} has no summary.json or status.json (not a run dir, or not started)")
    summary = json.loads(path.read_text())
    metrics = {task_id: _jsonl(run_dir / "tasks" / task["tenant"] / task_id / "metrics.jsonl")
               for task_id, task in summary.get("tasks", {}).items()}
    timeline = []
    for rank_file in sorted((run_dir / "timeline").glob("rank*.jsonl")):
        timeline += [s for s in _jsonl(rank_file) if s.get("stage") in BUSY_STAGES.get(s.get("role"), ())]
    return RunData(run_dir, summary, finished, metrics, timeline)


def _jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
