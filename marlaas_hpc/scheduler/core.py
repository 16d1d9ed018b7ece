"""The scheduler: a pure, event-driven state machine (events in, commands out, injectable clock).

It runs on world rank 0 behind a thin MPI loop, and unchanged under the discrete-event simulator.

    Submit ──► queued ──(slot free)──► Admit ──► StepDone(v0) ──► running
    running: Generate(rollout rank, env rank, groups @ version v) ──► Generated ──► Scored ──► ready
             ready ≥ B (versions ≥ v − k) ──► Train(groups) ──► StepDone(v+1) ──► ... ──► done

Staleness (DESIGN.md §3): the optimizer step producing version v+1 may only use groups sampled by
versions ≥ v − k. Admission control keeps at most (k+1)·B groups of a task generated or in flight beyond
what the trainer consumed; a ready group that is too old when its task's step is formed is dropped
(Discard) and counted, never trained. Every trained group goes to the audit log.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

from marlaas_hpc.scheduler.state import CANCELLED, DONE, FAILED, QUEUED, RUNNING, Group, TaskState
from marlaas_hpc.tasks.spec import TaskSpec

MODES = ("async", "sync", "sequential")
ORDERS = ("fair", "priority", "fifo")


# ---- events (into the scheduler) ----
@dataclass(frozen=True)
class Submit:
    spec: TaskSpec
    resume: dict | None = field(default=None, compare=False)
    """A checkpointed task record (`TaskState.checkpoint()`): the task continues at its saved version."""


@dataclass(frozen=True)
class Cancel:
    task_id: str


@dataclass(frozen=True)
class Generated:
    rollout_rank: int
    group_ids: tuple[str, ...]
    versions: tuple[int | None, ...] = ()
    """Adapter version each group was actually sampled with (a rollout rank may use a newer version than
    the one asked for if the older one is gone; never an older one). Empty: as issued."""


@dataclass(frozen=True)
class Scored:
    group_id: str
    reward_mean: float


@dataclass(frozen=True)
class StepDone:
    """The trainer applied a step (or, at version 0, created the adapter) and published `version`."""

    task_id: str
    version: int
    metrics: dict = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class TaskFailed:
    task_id: str
    error: str


# ---- commands (out of the scheduler) ----
@dataclass(frozen=True)
class Admit:
    spec: TaskSpec
    resume_version: int | None = None
    """Restore the adapter and optimizer saved at this version instead of creating a fresh adapter."""


@dataclass(frozen=True)
class Generate:
    rollout_rank: int
    env_rank: int
    task_id: str
    version: int
    groups: tuple[tuple[str, int], ...]
    """(group_id, prompt index in the task's training stream)."""


@dataclass(frozen=True)
class Train:
    task_id: str
    from_version: int
    group_ids: tuple[str, ...]
    behaviour_versions: tuple[int, ...]
    bound: int
    """The task's staleness bound k; the trainer re-checks every version against it."""


@dataclass(frozen=True)
class Discard:
    task_id: str
    group_ids: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class TaskEnded:
    task_id: str
    status: str
    error: str | None = None


@dataclass(frozen=True)
class AuditRecord:
    task_id: str
    group_id: str
    behaviour_version: int
    trained_into: int
    bound: int

    @property
    def staleness(self) -> int:
        """Versions between the sampler and the step's starting version (trained_into - 1)."""
        return self.trained_into - 1 - self.behaviour_version


@dataclass(kw_only=True)
class SchedulerConfig:
    mode: str = "async"
    """'async' (MARLaaS), 'sync' (lockstep rounds) or 'sequential' (one task at a time)."""
    order: str = "fair"
    """Which ready task goes first: 'fair' (least recently served), 'priority' (spec.priority), 'fifo'."""
    rollout_ranks: tuple[int, ...] = (1,)
    """World ranks that generate."""
    env_ranks: tuple[int, ...] = (2,)
    """World ranks that score."""
    rollout_slots: int = 4
    """Groups one rollout rank generates concurrently (its continuous batch, in prompt groups)."""
    max_active_tasks: int = 8
    """Adapter slots: tasks running at once; the rest wait queued."""
    trainer_slots: int = 4
    """Train orders (of different tasks) in flight at once; the trainer fuses those whose data is present
    into one step that shares the base model's forward and backward. 1 = one task per step."""

    def validate(self) -> "SchedulerConfig":
        if self.mode not in MODES:
            raise ValueError(f"mode: unknown {self.mode!r}; known {MODES}")
        if self.order not in ORDERS:
            raise ValueError(f"order: unknown {self.order!r}; known {ORDERS}")
        if not self.rollout_ranks or not self.env_ranks:
            raise ValueError("the scheduler needs at least one rollout rank and one env rank")
        if self.rollout_slots < 1 or self.max_active_tasks < 1 or self.trainer_slots < 1:
            raise ValueError("rollout_slots, max_active_tasks and trainer_slots must be >= 1")
        return self


class Scheduler:
    def __init__(self, config: SchedulerConfig, clock: Callable[[], float]):
        self.config = config.validate()
        self.clock = clock
        self.tasks: dict[str, TaskState] = {}
        self.audit: list[AuditRecord] = []
        self.rollout_load = {rank: 0 for rank in config.rollout_ranks}
        self.env_load = {rank: 0 for rank in config.env_ranks}
        self.training: set[str] = set()
        """Tasks with a Train order in flight (at most trainer_slots)."""
        self.draining = False
        """Preemption: issue nothing new (no admit, train or generate) so in-flight work can settle."""
        self._group_of: dict[str, Group] = {}
        self._served: dict[str, int] = {}
        self._tick = itertools.count()
        self._seq = itertools.count()

    # ---------------------------------------------------------------- events
    def handle(self, event) -> list:
        """Applies one event and returns the commands it makes possible."""
        out: list = []
        if isinstance(event, Submit):
            self._submit(event.spec, event.resume)
        elif isinstance(event, Cancel):
            out += self._cancel(event.task_id)
        elif isinstance(event, Generated):
            out += self._generated(event)
        elif isinstance(event, Scored):
            out += self._scored(event)
        elif isinstance(event, StepDone):
            out += self._step_done(event)
        elif isinstance(event, TaskFailed):
            out += self._end(event.task_id, FAILED, event.error)
        else:
            raise TypeError(f"unknown event {event!r}")
        return out + self.dispatch()

    def _submit(self, spec: TaskSpec, resume: dict | None = None) -> None:
        if spec.task_id in self.tasks:
            raise ValueError(f"task_id: duplicate task id {spec.task_id!r}")
        if resume is None:
            self.tasks[spec.task_id] = TaskState(spec=spec, submitted_at=self.clock(), version=-1)
        else:
            self.tasks[spec.task_id] = TaskState.from_checkpoint(spec, resume)
        self._served[spec.task_id] = next(self._seq)

    def _generated(self, event: Generated) -> list:
        # Events from different ranks may arrive in any order: a group's Scored (from its env rank) can
        # overtake its Generated (from its rollout rank). Only a group still generating moves to scoring.
        out = []
        versions = event.versions or (None,) * len(event.group_ids)
        for gid, version in zip(event.group_ids, versions):
            self.rollout_load[event.rollout_rank] -= 1
            group = self._group_of.get(gid)
            if group is None:
                continue
            if version is not None:
                if version < group.version:
                    raise RuntimeError(f"{gid}: sampled with v{version}, older than the v{group.version} issued")
                group.version = version
            task = self.tasks[group.task_id]
            if task.generating.pop(gid, None) is None:
                continue  # already scored (or dropped)
            if not task.active:
                out.append(self._forget([group], task, "task ended"))
                continue
            task.scoring[gid] = group
        return out

    def _scored(self, event: Scored) -> list:
        group = self._group_of.get(event.group_id)
        if group is None:
            return []
        self.env_load[group.env_rank] -= 1
        task = self.tasks[group.task_id]
        if task.scoring.pop(group.group_id, None) is None and task.generating.pop(group.group_id, None) is None:
            return []  # not in flight any more
        if not task.active:
            return [self._forget([group], task, "task ended")]
        group.reward_mean = event.reward_mean
        task.ready.append(group)
        return []

    def _step_done(self, event: StepDone) -> list:
        task = self.tasks[event.task_id]
        now = self.clock()
        if task.version < 0:  # admitted: the adapter exists (v0, or the resumed version) on every rollout rank
            expected = task.resume_version or 0
            if event.version != expected:
                raise RuntimeError(f"{task.task_id}: admitted at v{event.version}, expected v{expected}")
            task.version = event.version
            return []
        if task.training is None or event.version != task.version + 1:
            raise RuntimeError(f"{task.task_id}: unexpected StepDone v{event.version} at v{task.version}")
        for group in task.training:
            record = AuditRecord(task.task_id, group.group_id, group.version, event.version, task.bound)
            self.audit.append(record)
            task.max_trained_staleness = max(task.max_trained_staleness, record.staleness)
            self._group_of.pop(group.group_id, None)
        task.trained_groups += len(task.training)
        rewards = [g.reward_mean for g in task.training if g.reward_mean is not None]
        task.reward_history.append(sum(rewards) / max(1, len(rewards)))
        task.training, task.version = None, event.version
        task.step_times.append(now)
        self.training.discard(task.task_id)
        if task.cancel_requested:
            return self._end(task.task_id, CANCELLED)
        if task.version >= task.spec.total_steps:
            return self._end(task.task_id, DONE)
        return []

    def _cancel(self, task_id: str) -> list:
        task = self.tasks[task_id]
        if task.status == QUEUED:
            return self._end(task_id, CANCELLED)
        if task.training is not None:  # stop at the step boundary: after this step lands
            task.cancel_requested = True
            return []
        return self._end(task_id, CANCELLED)

    def _end(self, task_id: str, status: str, error: str | None = None) -> list:
        task = self.tasks[task_id]
        if task.status in (DONE, FAILED, CANCELLED):
            return []
        was_training = task.training is not None
        task.status, task.error = status, error
        out = []
        # groups still generating or scoring are forgotten when their events arrive (task not active)
        if task.ready or task.training:
            out.append(self._forget(task.ready + (task.training or []), task, f"task {status}"))
        task.ready, task.training = [], None
        if was_training:
            self.training.discard(task_id)
        out.append(TaskEnded(task_id, status, error))
        return out

    def _forget(self, groups: list[Group], task: TaskState, reason: str) -> Discard:
        for group in groups:
            self._group_of.pop(group.group_id, None)
        return Discard(task.task_id, tuple(g.group_id for g in groups), reason)

    # ---------------------------------------------------------------- dispatch
    def dispatch(self) -> list:
        """Fills free capacity: admits queued tasks, starts a train step, keeps rollout ranks busy."""
        if self.draining:
            return []
        return self._admit() + self._train() + self._generate()

    def _admit(self) -> list:
        running = sum(t.status == RUNNING for t in self.tasks.values())
        queued = sorted((t for t in self.tasks.values() if t.status == QUEUED),
                        key=lambda t: (-t.spec.priority, t.submitted_at) if self.config.order == "priority"
                        else (t.submitted_at,))
        out = []
        for task in queued[: max(0, self.config.max_active_tasks - running)]:
            task.status, task.admitted_at = RUNNING, self.clock()
            out.append(Admit(task.spec, task.resume_version))
        return out

    def _running(self) -> list[TaskState]:
        return [t for t in self.tasks.values() if t.status == RUNNING]

    def _ordered(self, tasks: list[TaskState]) -> list[TaskState]:
        if self.config.order == "priority":
            return sorted(tasks, key=lambda t: (-t.spec.priority, self._served[t.task_id]))
        if self.config.order == "fifo":
            return sorted(tasks, key=lambda t: (t.submitted_at, t.task_id))
        return sorted(tasks, key=lambda t: self._served[t.task_id])

    def _train(self) -> list:
        out: list = []
        for task in self._ordered(self._running()):
            if len(self.training) >= self.config.trainer_slots:
                break
            if task.training is not None or task.version < 0 or not self._may_train(task):
                continue
            out += self._drop_stale(task)
            if len(task.ready) < task.batch:
                continue
            task.ready.sort(key=lambda g: g.version)  # oldest versions first: they are closest to the bound
            batch, task.ready = task.ready[: task.batch], task.ready[task.batch:]
            task.training = batch
            self.training.add(task.task_id)
            self._served[task.task_id] = next(self._seq)
            out.append(Train(task.task_id, task.version, tuple(g.group_id for g in batch),
                             tuple(g.version for g in batch), task.bound))
        return out

    def _drop_stale(self, task: TaskState) -> list:
        oldest_allowed = task.version - task.bound
        stale = [g for g in task.ready if g.version < oldest_allowed]
        if not stale:
            return []
        task.ready = [g for g in task.ready if g.version >= oldest_allowed]
        task.dropped_groups += len(stale)
        return [self._forget(stale, task, f"staler than k={task.bound} at v{task.version}")]

    def _may_train(self, task: TaskState) -> bool:
        if self.config.mode != "sync":
            return True
        # lockstep: the round trains only once every task of the round has its whole batch scored
        return all(t.training is not None or len(t.ready) >= t.batch or t.version > task.version
                   for t in self._running() if t.version >= 0)

    def _quota(self, task: TaskState) -> int:
        """Groups this task may have issued now, by the mode's rule."""
        if task.version < 0 or task.finished_issuing():
            return 0
        remaining = (task.spec.total_steps - task.version) * task.batch - task.outstanding()
        mode = self.config.mode
        if mode == "async":
            allowed = (task.bound + 1) * task.batch - task.outstanding()
        elif mode == "sync":
            round_version = min(t.version for t in self._running())
            allowed = task.batch - task.outstanding() if task.version == round_version else 0
        else:  # sequential: only the first unfinished task, one synchronous step at a time
            first = self._ordered_sequential()[0]
            allowed = task.batch - task.outstanding() if task is first and task.training is None else 0
        return max(0, min(allowed, remaining))

    def _ordered_sequential(self) -> list[TaskState]:
        return sorted(self._running(), key=lambda t: (-t.spec.priority, t.submitted_at, t.task_id))

    def _generate(self) -> list:
        out = []
        for rank in self.config.rollout_ranks:
            free = self.config.rollout_slots - self.rollout_load[rank]
            for task in self._ordered(self._running()):
                if free <= 0:
                    break
                take = min(free, self._quota(task))
                if take <= 0:
                    continue
                out.append(self._issue(task, rank, take))
                free -= take
        return out

    def _issue(self, task: TaskState, rank: int, count: int) -> Generate:
        env_rank = min(self.env_load, key=lambda r: (self.env_load[r], r))
        groups = []
        now = self.clock()
        for _ in range(count):
            gid = f"{task.task_id}/g{task.next_prompt}"
            group = Group(gid, task.task_id, task.next_prompt, task.version, rank, env_rank, now)
            task.generating[gid] = group
            self._group_of[gid] = group
            groups.append((gid, task.next_prompt))
            task.next_prompt += 1
        self.rollout_load[rank] += count
        self.env_load[env_rank] += count
        self._served[task.task_id] = next(self._seq)
        return Generate(rank, env_rank, task.task_id, task.version, tuple(groups))

    # ---------------------------------------------------------------- queries
    def settled(self) -> bool:
        """Nothing in flight: no group generating or being scored, no train order outstanding. With
        `draining` set this is a step boundary for every task (the point a checkpoint is taken at)."""
        return not self.training and all(not t.generating and not t.scoring for t in self.tasks.values())

    def finished(self) -> bool:
        """No task is queued or running."""
        return all(t.status in (DONE, FAILED, CANCELLED) for t in self.tasks.values())
