"""Job outputs under the run dir: summary.json (per task and job level) and audit.jsonl (per sample)."""
from __future__ import annotations

import json
from pathlib import Path

from marlaas_hpc.rundir import atomic_write_text, task_record


def audit_lines(record, group_size: int) -> str:
    """audit.jsonl lines of one trained group: one per sample (task, group, sample, behaviour version, version
    trained into, bound)."""
    return "".join(json.dumps({"task_id": record.task_id, "group_id": record.group_id, "sample": sample,
                               "behaviour_version": record.behaviour_version,
                               "trained_into": record.trained_into, "bound": record.bound}) + "\n"
                   for sample in range(group_size))


class AuditLog:
    """RUN_DIR/audit.jsonl, appended and flushed as steps land: a crash keeps every line of every step rank 0
    has seen (a resume first rolls it back to the checkpoints it resumes from: runtime/recovery.py)."""

    def __init__(self, run_dir: Path, fresh: bool):
        self.path = Path(run_dir) / "audit.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.sink = open(self.path, "w" if fresh else "a")
        self.written = 0
        """Records of scheduler.audit already in the file."""

    def extend(self, scheduler) -> None:
        """Appends the scheduler's audit records not written yet."""
        new = scheduler.audit[self.written:]
        if not new:
            return
        self.sink.write("".join(audit_lines(r, scheduler.tasks[r.task_id].spec.algo.group_size) for r in new))
        self.sink.flush()
        self.written += len(new)

    def close(self) -> None:
        self.sink.close()


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def write_status(run_dir: Path, job, scheduler, elapsed_s: float) -> None:
    """Live snapshot for `marlaas status RUN_DIR`, rewritten as tasks progress."""
    status = {"mode": job.mode, "elapsed_s": elapsed_s, "finished": scheduler.finished(),
              "tasks": {task_id: task_record(task) for task_id, task in scheduler.tasks.items()}}
    atomic_write_text(Path(run_dir) / "status.json", json.dumps(status, indent=2) + "\n")


def trainer_groups(stats: list, scheduler, wall_s: float) -> dict:
    """Per trainer group (its leader's RankStats): its ranks, busy fraction and the tasks it owns at the end."""
    out = {}
    for stat in stats:
        if stat.kind == "trainer" and "trainer_group" in stat.extra:
            group = stat.extra["trainer_group"]
            out[str(group)] = {"ranks": stat.extra["ranks"], "busy_fraction": stat.busy_s / max(wall_s, 1e-9),
                               "tasks": sorted(t for t, s in scheduler.tasks.items() if s.trainer_group == group)}
    return dict(sorted(out.items(), key=lambda item: int(item[0])))


def write_summary(run_dir: Path, job, scheduler, evals: dict, stats: list, wall_s: float,
                  rejected: dict[str, str], startup_s: float = 0.0, job_start: float | None = None,
                  runs: list[dict] | None = None, preempted: bool = False) -> dict:
    """wall_time_s runs from the moment every rank is ready (job_start, unix seconds; start-up excluded:
    startup_s). Timeline records (timeline/rank<N>.jsonl) use the same unix clock. `runs`: this job's
    earlier runs (each ended by a preemption or a crash); `preempted`: this run ended in a checkpoint, not
    completion."""
    tasks = {}
    for task_id, task in scheduler.tasks.items():
        tasks[task_id] = {**task_record(task),
                          "eval_accuracy_before": _mean(evals.get((task_id, "before"), [])),
                          "eval_accuracy_after": _mean(evals.get((task_id, "after"), []))}
    busy: dict[str, list[float]] = {}
    for stat in stats:
        busy.setdefault(stat.kind, []).append(stat.busy_s / max(wall_s, 1e-9))
    summary = {"mode": job.mode, "wall_time_s": wall_s, "startup_s": startup_s, "job_start": job_start,
               "model": job.model,
               "engine": job.engine,
               "busy_fraction": {kind: _mean(values) for kind, values in sorted(busy.items())},
               "preempted": preempted, "previous_runs": runs or [],
               "total_wall_time_s": wall_s + sum(r["wall_time_s"] for r in runs or []),
               "tasks": tasks, "rejected": rejected,
               # per env rank: env-step latencies by stage (tool:<name>, reward) and per-task episode figures
               "env_ranks": {str(stat.rank): stat.extra for stat in stats if stat.kind == "env" and stat.extra},
               "trainer_groups": trainer_groups(stats, scheduler, wall_s),
               # rollout engines rebuilt after an engine error (rollout/restart.py), per rollout rank
               "engine_restarts": {str(stat.rank): stat.extra.get("engine_restarts", 0)
                                   for stat in stats if stat.kind == "rollout"}}
    atomic_write_text(Path(run_dir) / "summary.json", json.dumps(summary, indent=2) + "\n")
    write_status(run_dir, job, scheduler, wall_s)
    return summary
