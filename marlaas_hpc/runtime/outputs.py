"""Job outputs under the run dir: summary.json (per task and job level), audit.jsonl (per sample) and the live
status.json."""
from __future__ import annotations

import json
import time
from pathlib import Path

from marlaas_hpc.rundir import atomic_write_text, task_record
from marlaas_hpc.runtime.records import JobRecords
from marlaas_hpc.scheduler import Admit, Generate, StepDone, Submit, TaskEnded
from marlaas_hpc.scheduler.state import CANCELLED, DONE, FAILED


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

    def rewrite(self, scheduler) -> None:
        """The whole file again from the scheduler's audit (a task rolled back in the live job: its steps after
        the checkpoint left the audit)."""
        self.sink.close()
        atomic_write_text(self.path, "".join(audit_lines(r, scheduler.tasks[r.task_id].spec.algo.group_size)
                                             for r in scheduler.audit))
        self.sink = open(self.path, "a")
        self.written = len(scheduler.audit)

    def close(self) -> None:
        self.sink.close()


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


class StatusBoard:
    """RUN_DIR/status.json, the live table of `marlaas status` and `marlaas tasks ls`: rewritten at most every
    PERIOD_S while something changed, each task's entry encoded again only if the task changed since its last
    write (`changed`). Rewriting and re-encoding every task on each step made rank 0's work per event grow
    with the number of tasks (21% of its time at 384 tasks)."""

    PERIOD_S = 1.0

    def __init__(self, run_dir: Path, job, scheduler, start: float, clock=time.time):
        self.path = Path(run_dir) / "status.json"
        self.job, self.scheduler, self.start, self.clock = job, scheduler, start, clock
        self.entries: dict[str, str | None] = {}
        """task -> its entry (JSON text) as last written."""
        self.dirty: set[str] = set()
        self.written_at: float | None = None
        self.encoded = 0
        """Task entries encoded so far (each write encodes only the changed ones)."""
        self.ranks: dict | None = None
        """The live ranks once they changed (a rank lost, joined or left: runtime/scheduler_rank.py)."""

    def changed(self, task_id: str) -> None:
        if task_id not in self.entries:
            self.entries[task_id] = None  # its place: tasks are listed in the order they came
        self.dirty.add(task_id)

    def due(self) -> bool:
        """A task changed and PERIOD_S has passed since the last write."""
        return bool(self.dirty) and (self.written_at is None or self.clock() - self.written_at >= self.PERIOD_S)

    def refresh(self) -> None:
        now = self.clock()
        tasks = self.scheduler.tasks
        for task_id in self.dirty:
            if task_id in tasks:
                self.entries[task_id] = json.dumps(task_record(tasks[task_id]))
            else:  # refused at submission
                self.entries.pop(task_id, None)
        self.encoded += len(self.dirty)
        self.dirty.clear()
        serving = self.scheduler.rank_models  # several models: which one each rollout rank serves now
        head = json.dumps({"mode": self.job.mode, "elapsed_s": now - self.start,
                           "finished": self.scheduler.finished(), **({"ranks": self.ranks} if self.ranks else {}),
                           **({"rollout_models": {str(r): m for r, m in serving.items()}} if serving else {})})
        body = ",\n".join(f"  {json.dumps(task_id)}: {entry}" for task_id, entry in self.entries.items())
        atomic_write_text(self.path, head[:-1] + ', "tasks": {\n' + body + "\n}}\n")
        self.written_at = now


class QuietLog:
    """Rank 0's log, plus one line of where the job stands after QUIET_S without any line: a first step on GPUs
    can take minutes (engines start, FlexAttention compiles, long generations) and a silent job looks hung."""

    QUIET_S = 60.0

    def __init__(self, log, clock=time.monotonic):
        self.log, self.clock = log, clock
        self.last = clock()

    def __call__(self, message: str) -> None:
        self.log(message)
        self.last = self.clock()

    def tick(self, scheduler) -> None:
        """The standing line, if nothing was printed for QUIET_S (cheap when not due: one clock read)."""
        if self.clock() - self.last >= self.QUIET_S:
            self(standing_line(scheduler.tasks.values(), self.clock() - self.last))


def standing_line(tasks, quiet_s: float) -> str:
    tasks = list(tasks)
    ended = sum(task.status in (DONE, FAILED, CANCELLED) for task in tasks)
    steps = sum(max(task.version, 0) for task in tasks)
    counts = {"generating": 0, "scoring": 0, "ready": 0}
    training = 0
    for task in tasks:
        for name in counts:
            counts[name] += len(getattr(task, name))
        training += task.training is not None
    groups = ", ".join(f"{n} {name}" for name, n in counts.items())
    return (f"[job] no news for {quiet_s:.0f} s: {ended}/{len(tasks)} tasks ended, {steps} steps trained; groups: "
            f"{groups}; {training} tasks training")


class RunBooks:
    """What rank 0 writes into the run dir as the scheduler handles events: the records a resume restarts from
    (runtime/records.py), audit.jsonl and status.json. `handled` is each event's share, and its cost does not
    grow with the number of tasks: a record line per task saved, submitted or ended, the audit lines of a step,
    and a mark on the tasks status.json must encode again; `tick` rewrites status.json when due."""

    def __init__(self, run_dir: Path, job, scheduler, resume: dict | None, start: float, clock=time.time):
        self.scheduler = scheduler
        self.records = JobRecords(run_dir, resume, clock)
        self.audit = AuditLog(run_dir, fresh=resume is None)
        self.audit.written = len(scheduler.audit)
        self.status = StatusBoard(run_dir, job, scheduler, start, clock)
        self.pending_saves: dict[str, int] = {}
        """task -> version the trainer saved and whose StepDone has not arrived yet (TaskSaved precedes it)."""

    def task_saved(self, task_id: str, version: int) -> None:
        self.pending_saves[task_id] = version

    def handled(self, event, commands: list) -> None:
        """After `Scheduler.handle(event)`, before its commands go out: the record of a task submitted, saved or
        ended (a command may depend on it), the audit of a step, the tasks whose status entry changed."""
        tasks = self.scheduler.tasks
        if isinstance(event, Submit):
            if event.spec.task_id in tasks:
                self.records.submitted(tasks[event.spec.task_id])
                self.status.changed(event.spec.task_id)
        elif isinstance(event, StepDone):
            if self.pending_saves.get(event.task_id) == event.version:
                del self.pending_saves[event.task_id]
                self.records.saved(tasks[event.task_id])
            self.audit.extend(self.scheduler)
        if getattr(event, "task_id", None) in tasks:  # StepDone, TaskFailed, Cancel, Moved
            self.status.changed(event.task_id)
        for command in commands:
            if isinstance(command, TaskEnded):
                self.records.ended(tasks[command.task_id])
            if not isinstance(command, Generate):  # the one command that changes nothing status.json shows
                self.status.changed(command.spec.task_id if isinstance(command, Admit) else command.task_id)
        self.records.maybe_compact()

    def roll_back(self, task, version: int) -> None:
        """A task went back to its checkpoint at `version` in the live job (its trainer group was lost): the audit
        and its metrics.jsonl lose the steps after it, as a resume's rollback cuts them (runtime/recovery.py)."""
        from marlaas_hpc.rundir import task_dir
        from marlaas_hpc.runtime.recovery import cut_jsonl

        self.audit.rewrite(self.scheduler)
        cut_jsonl(task_dir(self.records.run_dir, task.spec) / "metrics.jsonl",
                  lambda row: row.get("version", 0) <= version)
        self.status.changed(task.task_id)

    def tick(self, busy=None) -> None:
        """status.json when due (busy: rank 0's BusyClock, which counts the time as 'status')."""
        if self.status.due():
            if busy is None:
                self.status.refresh()
                return
            with busy.track("status"):
                self.status.refresh()

    def close(self, run: dict, finished: bool) -> None:
        """The end of the run: the audit's last lines, the records' one compaction, status.json."""
        self.audit.extend(self.scheduler)
        self.audit.close()
        self.records.close_run(run, finished)
        self.status.refresh()


def trainer_groups(stats: list, scheduler, wall_s: float) -> dict:
    """Per trainer group (its leader's RankStats): its ranks, busy fraction and the tasks it owns at the end."""
    out = {}
    for stat in stats:
        if stat.kind == "trainer" and "trainer_group" in stat.extra:
            group = stat.extra["trainer_group"]
            out[str(group)] = {"ranks": stat.extra["ranks"], "busy_fraction": stat.busy_s / max(wall_s, 1e-9),
                               "tasks": sorted(t for t, s in scheduler.tasks.items() if s.trainer_group == group),
                               # the leader's delta plane: versions sent, seconds blocked in sending them
                               "delta": stat.extra.get("delta", {}),
                               # sections of its ops that failed on some rank and were settled together
                               # (runtime/group_guard.py): redone, or failed alike on every rank
                               "regroups": stat.extra.get("regroups", [])}
    return dict(sorted(out.items(), key=lambda item: int(item[0])))


def write_summary(run_dir: Path, job, scheduler, evals: dict, stats: list, wall_s: float,
                  rejected: dict[str, str], startup_s: float = 0.0, job_start: float | None = None,
                  runs: list[dict] | None = None, preempted: bool = False,
                  ranks_lost: list[dict] | None = None, ranks_joined: list[dict] | None = None,
                  ranks_left: list[dict] | None = None) -> dict:
    """wall_time_s runs from the moment every rank is ready (job_start, unix seconds; start-up excluded:
    startup_s). Timeline records (timeline/rank<N>.jsonl) use the same unix clock. `runs`: this job's
    earlier runs (each ended by a preemption or a crash); `preempted`: this run ended in a checkpoint, not
    completion; `ranks_lost`: ranks the live job went on without (when, role, cause, what was issued again),
    over all its runs."""
    tasks = {}
    for task_id, task in scheduler.tasks.items():
        tasks[task_id] = {**task_record(task),
                          "eval_accuracy_before": _mean(evals.get((task_id, "before"), [])),
                          "eval_accuracy_after": _mean(evals.get((task_id, "after"), []))}
    busy: dict[str, list[float]] = {}
    for stat in stats:
        busy.setdefault(stat.kind, []).append(stat.busy_s / max(wall_s, 1e-9))
    summary = {"mode": job.mode, "wall_time_s": wall_s, "startup_s": startup_s, "job_start": job_start,
               "model": job.model, "models": job.model_names(),
               "engine": job.engine,
               "busy_fraction": {kind: _mean(values) for kind, values in sorted(busy.items())},
               "preempted": preempted, "previous_runs": runs or [],
               "total_wall_time_s": wall_s + sum(r["wall_time_s"] for r in runs or []),
               "tasks": tasks, "rejected": rejected, "ranks_lost": ranks_lost or [],
               "ranks_joined": ranks_joined or [], "ranks_left": ranks_left or [],
               # per env rank: env-step latencies by stage (tool:<name>, reward) and per-task episode figures
               "env_ranks": {str(stat.rank): stat.extra for stat in stats if stat.kind == "env" and stat.extra},
               "trainer_groups": trainer_groups(stats, scheduler, wall_s),
               # rank 0: scheduler events handled and bytes appended to its records (the journal, compactions)
               "scheduler_rank": next((stat.extra for stat in stats if stat.kind == "scheduler"), {}),
               # rollout engines rebuilt after an engine error (rollout/restart.py), per rollout rank
               "engine_restarts": {str(stat.rank): stat.extra.get("engine_restarts", 0)
                                   for stat in stats if stat.kind == "rollout"},
               # per rollout rank: decode steps by rows running, row- and token-steps (hf engine only:
               # rollout/base.py DecodeOccupancy; {} for the others)
               "decode_occupancy": {str(stat.rank): stat.extra.get("occupancy", {})
                                    for stat in stats if stat.kind == "rollout"},
               # a job of several base models, per rollout rank: switches of its awake engine and their seconds
               "model_switches": {str(stat.rank): {"switches": stat.extra["model_switches"],
                                                   "seconds": stat.extra["model_switch_s"]}
                                  for stat in stats if stat.kind == "rollout" and "model_switches" in stat.extra}}
    atomic_write_text(Path(run_dir) / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary
