"""The scheduler: a pure, event-driven state machine (events in, commands out, injectable clock).

It runs on world rank 0 behind a thin MPI loop, and unchanged under the discrete-event simulator.

    Submit ──► queued ──(slot free)──► Admit ──► StepDone(v0) ──► running
    running: Generate(rollout rank, env rank, groups @ version v) ──► Generated ──► Scored ──► ready
             ready ≥ B (versions ≥ v − k) ──► Train(groups) ──► StepDone(v+1) ──► ... ──► done

Staleness (scheduler/staleness.py, the rule written once): the optimizer step producing version v+1 may only
use groups sampled by versions >= v - k. Admission control keeps at most (k+1)·B groups of a task generated or
in flight beyond what the trainer consumed (async mode's quota); a ready group that is too old when its task's
step is formed is dropped (Discard) and counted, never trained. Every trained group goes to the audit log.

Dynamic sampling (scheduler/sampling.py): a task may drop scored groups whose rewards are all equal; the quota
then issues replacements inside the same window.

Modes (scheduler/modes.py): one policy object per mode (async / sync / sequential) owns its quota and train
rules; the scheduler asks it and tells it what changed. Handlers are `_on_<event>`.

Trainer groups (`trainer_groups` G, scheduler/placement.py): every admitted task is owned by one group, the
least loaded by tokens per step; Admit and Train name it. Each group fuses up to `trainer_slots` orders, in the
order's ranking among its own tasks. At a step boundary a task may move to a less-loaded group (Move; the
groups hand over its adapter and optimizer state and answer Moved). With G = 1 nothing of this shows: every
command is what a single trainer gets.
"""
from __future__ import annotations

import bisect
import heapq
import itertools
from dataclasses import dataclass
from operator import attrgetter
from typing import Callable

from marlaas_hpc.scheduler.events import (Admit, AuditRecord, Cancel, Discard, Generate, Generated, Move, Moved,
                                          RankJoined, RankLeaving, RankLost, Resumed, Scored, StepDone, Submit,
                                          TaskEnded, TaskFailed, Train)
from marlaas_hpc.scheduler.modes import MODES, mode_policy
from marlaas_hpc.scheduler.rank_changes import RankChanges
from marlaas_hpc.scheduler.placement import Placement, estimated_tokens_per_step
from marlaas_hpc.scheduler.sampling import drops
from marlaas_hpc.scheduler.settings import ORDERS, SchedulerSettings
from marlaas_hpc.scheduler.staleness import oldest_allowed
from marlaas_hpc.scheduler.state import CANCELLED, DONE, FAILED, QUEUED, RUNNING, Group, TaskState
from marlaas_hpc.tasks.spec import TaskSpec

_version = attrgetter("version")


@dataclass(kw_only=True)
class SchedulerConfig(SchedulerSettings):
    """The job's scheduler settings (SchedulerSettings: mode, order, slots, adapters) and the ranks it drives."""

    rollout_ranks: tuple[int, ...] = (1,)
    """World ranks that generate."""
    env_ranks: tuple[int, ...] = (2,)
    """World ranks that score."""
    trainer_groups: int = 1
    """Independent trainer groups; each task is owned by one (placement by tokens per step)."""
    trainer_group_models: tuple[str, ...] = ()
    """The base model each trainer group loads (one per group): a task is placed only on a group of its
    `spec.base_model`. Empty: every group loads the job's one model."""

    def validate(self) -> "SchedulerConfig":
        self.check_settings()
        if not self.rollout_ranks or not self.env_ranks:
            raise ValueError("the scheduler needs at least one rollout rank and one env rank")
        if self.trainer_groups < 1:
            raise ValueError("trainer_groups must be >= 1")
        if self.trainer_group_models and len(self.trainer_group_models) != self.trainer_groups:
            raise ValueError(f"trainer_group_models: {len(self.trainer_group_models)} models for "
                             f"{self.trainer_groups} trainer groups")
        return self


class TrainerGroups:
    """The scheduler's book of the trainer groups: which owns each task (placement), each group's heap of
    trainable tasks and its orders in flight, the groups a train pass may act on, and tasks moving."""

    __slots__ = ("placement", "heaps", "busy", "ready", "moving", "lost")

    def __init__(self, groups: int, models: tuple[str, ...] = ()):
        self.placement = Placement(groups, models)
        self.heaps: list[list] = [[] for _ in range(groups)]
        """Per group: heap of (order key, stamp, task_id) of its trainable tasks (stale entries skipped)."""
        self.busy = [0] * groups
        """Train orders in flight per group."""
        self.ready: set[int] = set()
        """Groups with a free slot and a non-empty heap (several groups only)."""
        self.moving: dict[str, int] = {}
        """Tasks whose Move has not been answered (Moved) yet -> the group they are leaving."""
        self.lost: set[int] = set()
        """Trainer groups lost (RankLost of one of their ranks): never placed on again."""

    def changed(self, group: int, slots: int) -> None:
        """Keeps `ready` true for one group after its slots or its heap changed."""
        if self.heaps[group] and self.busy[group] < slots:
            self.ready.add(group)
        else:
            self.ready.discard(group)


class Scheduler(RankChanges):
    def __init__(self, config: SchedulerConfig, clock: Callable[[], float]):
        self.config = config.validate()
        self.clock = clock
        self.tasks: dict[str, TaskState] = {}
        self.audit: list[AuditRecord] = []
        self.rollout_load = {rank: 0 for rank in config.rollout_ranks}
        self.env_load = {rank: 0 for rank in config.env_ranks}
        self.training: set[str] = set()
        """Tasks with a Train order in flight (at most trainer_slots per trainer group)."""
        self.trainers = TrainerGroups(config.trainer_groups, config.trainer_group_models)
        """Placement of tasks on trainer groups, and each group's train heap and orders in flight. (State about
        groups lives in this one object: an instance with more than 29 attributes loses CPython's fast
        attribute loads, which made every event of a one-group job 7% dearer.)"""
        self.draining = False
        """Preemption: issue nothing new (no admit, train or generate) so in-flight work can settle."""
        self._group_of: dict[str, Group] = {}
        self._served: dict[str, int] = {}
        """Fair order: when each task last got a train order (least recently served trains first)."""
        self._served_rollout: dict[str, int] = {}
        """... and rollout slots, counted apart: issuing a waiting task's prompts must not push it back in
        the trainer's queue (it could then be overtaken again and again)."""
        self._seq = itertools.count()
        # Incremental indexes, so that one event costs O(log tasks), not a scan of every task (simulations
        # run 1024 tasks). Each is kept true by `_touch(task)` after any change to that task.
        self._live = 0
        """Tasks queued or running (finished() is live == 0)."""
        self._n_running = 0
        self._queued: list = []
        """Heap of (admission key, submission number, task_id); ended tasks are skipped lazily."""
        self._issuable: dict[str, int] = {}
        """Running tasks whose quota is > 0 -> the stamp of their valid entry in `_issue_heap`."""
        self._issue_heap: list = []
        """Heap of (order key, stamp, task_id); entries whose stamp is not current are stale."""
        self._stamps = itertools.count()
        self._trainable: dict[str, int] = {}
        """Running tasks a train pass would act on (idle, with a full batch or a stale group) -> the stamp of
        their valid entry in their trainer group's heap)."""
        self._train_heap: list | None = self.trainers.heaps[0] if config.trainer_groups == 1 else None
        """One trainer group: its heap (the hot path of a one-group job stays as it was). None with several:
        their heaps are in `trainers`."""
        self.mode = mode_policy(config.mode, self.tasks)
        """The mode's policy: quota and train rules (scheduler/modes.py)."""
        self._env_heap = [(0, rank) for rank in sorted(config.env_ranks)]
        """(load, env rank) entries; one whose load is not the rank's load now is stale."""
        self.rollout_ranks: list[int] = list(config.rollout_ranks)
        """Every rollout rank the job has had, in the order they came (config order, then joins); a lost one
        stays listed (its index is never reused) but has no load entry and is never free."""
        self.leaving: set[int] = set()
        """Rollout ranks draining before they leave (RankLeaving): never free again."""
        self._rank_index = {rank: i for i, rank in enumerate(config.rollout_ranks)}
        self._free_ranks: list[int] = list(range(len(config.rollout_ranks)))
        """Indexes (in rollout_ranks) of the live rollout ranks with a free slot, sorted: the generate pass fills
        them in config order."""
        self._closed_ranks: set[int] = set()
        """Rollout ranks that take no new groups (a model pool gave them to another model: `close_rollout_rank`)."""
        self.rank_models: dict[int, str] = {}
        """Rollout rank -> the one base model whose tasks it takes (rank 0's model pool, scheduler/rank_models.py,
        sets it); empty: every rank takes every task (a job of one model, and the simulator's per-model jobs)."""

    # ---------------------------------------------------------------- events
    def handle(self, event) -> list:
        """Applies one event and returns the commands it makes possible."""
        handler = self._HANDLERS.get(type(event))
        if handler is None:
            raise TypeError(f"unknown event {event!r}")
        return handler(self, event) + self.dispatch()

    def _on_submit(self, event: Submit) -> list:
        self._submit(event.spec, event.resume)
        return []

    def _on_cancel(self, event: Cancel) -> list:
        return self._cancel(event.task_id)

    def _on_task_failed(self, event: TaskFailed) -> list:
        return self._end(event.task_id, FAILED, event.error)

    def _on_moved(self, event: Moved) -> list:
        self.trainers.moving.pop(event.task_id, None)
        return []

    def _on_resumed(self, event: Resumed) -> list:
        if event.rollout_rank in self.rollout_load:
            self._rank_taken(event.rollout_rank, len(event.group_ids))
        return []

    def _submit(self, spec: TaskSpec, resume: dict | None = None) -> None:
        if spec.task_id in self.tasks:
            raise ValueError(f"task_id: duplicate task id {spec.task_id!r}")
        if resume is None:
            task = TaskState(spec=spec, submitted_at=self.clock(), version=-1)
        else:
            task = TaskState.from_checkpoint(spec, resume)
        self.tasks[spec.task_id] = task
        self._served[spec.task_id] = self._served_rollout[spec.task_id] = next(self._seq)
        if task.status != QUEUED:
            return  # a resumed task that had already ended
        self._live += 1
        key = (-spec.priority, task.submitted_at) if self.config.order == "priority" else (task.submitted_at,)
        heapq.heappush(self._queued, (key, self._served[spec.task_id], spec.task_id))

    def _on_generated(self, event: Generated) -> list:
        # Events from different ranks may arrive in any order: a group's Scored (from its env rank) can
        # overtake its Generated (from its rollout rank). Only a group still generating moves to scoring; the
        # Generated of a multi-turn group's later turn (after its Resumed) only frees the slot.
        out = []
        versions = event.versions or (None,) * len(event.group_ids)
        if event.rollout_rank in self.rollout_load:  # a lost rank's last words free nothing
            self._rank_freed(event.rollout_rank, len(event.group_ids))
        for gid, version in zip(event.group_ids, versions):
            group = self._group_of.get(gid)
            if group is None:
                continue
            task = self.tasks[group.task_id]
            if version is not None and version != group.version:
                self._sampled_newer(task, group, version)
            if task.generating.pop(gid, None) is None:
                continue  # already scored (or dropped)
            if task.status != RUNNING:
                out.append(self._forget([group], task, "task ended"))
                continue
            task.scoring[gid] = group  # generating -> scoring: outstanding and ready unchanged, no re-filing
        return out

    def _sampled_newer(self, task: TaskState, group: Group, version: int) -> None:
        """The rollout rank sampled a group with a newer version than the one issued (never an older one)."""
        if version < group.version:
            raise RuntimeError(f"{group.group_id}: sampled with v{version}, older than the v{group.version} issued")
        group.version = version
        if any(g is group for g in task.ready):  # its Scored overtook this Generated: keep ready in version order
            task.ready.sort(key=_version)
            self._touch(task, quota_changed=False)

    def _on_scored(self, event: Scored) -> list:
        group = self._group_of.get(event.group_id)
        if group is None:
            return []
        self._env_rank_freed(group.env_rank)
        task = self.tasks[group.task_id]
        if task.scoring.pop(group.group_id, None) is None and task.generating.pop(group.group_id, None) is None:
            return []  # not in flight any more
        if task.status != RUNNING:
            return [self._forget([group], task, "task ended")]
        if drops(task, event.informative):  # dynamic sampling: outstanding falls, so a replacement is issued
            task.filtered_groups += 1
            self._touch(task)
            return [self._forget([group], task, "uninformative: equal rewards (dynamic sampling)")]
        group.reward_mean = event.reward_mean
        ready = task.ready  # kept in version order (stable: equal versions in arrival order), oldest first
        if not ready or ready[-1].version <= group.version:
            ready.append(group)  # the common case: groups are mostly scored in the order they were sampled
        else:
            bisect.insort_right(ready, group, key=_version)
        self._touch(task, quota_changed=False)  # scoring -> ready: outstanding (the quota's input) unchanged
        return []

    def _on_step_done(self, event: StepDone) -> list:
        task = self.tasks[event.task_id]
        now = self.clock()
        if task.version < 0:  # admitted: the adapter exists (v0, or the resumed version) on every rollout rank
            expected = task.resume_version or 0
            if event.version != expected:
                raise RuntimeError(f"{task.task_id}: admitted at v{event.version}, expected v{expected}")
            task.version = event.version
            self._touch(task)
            return []
        if task.training is None or event.version != task.version + 1:
            raise RuntimeError(f"{task.task_id}: unexpected StepDone v{event.version} at v{task.version}")
        for group in task.training:
            self.audit.append(AuditRecord(task.task_id, group.group_id, group.version, event.version, task.bound))
            self._group_of.pop(group.group_id, None)
        stalest = event.version - 1 - min([g.version for g in task.training])  # as AuditRecord.staleness
        if stalest > task.max_trained_staleness:
            task.max_trained_staleness = stalest
        task.trained_groups += len(task.training)
        rewards = [g.reward_mean for g in task.training if g.reward_mean is not None]
        task.reward_history.append(sum(rewards) / max(1, len(rewards)))
        task.training, task.version = None, event.version
        task.step_times.append(now)
        self.training.discard(task.task_id)
        trainers = self.trainers
        trainers.busy[task.trainer_group] -= 1
        multi_group = self._train_heap is None
        if multi_group:
            trainers.changed(task.trainer_group, self.config.trainer_slots)
        self._touch(task)
        if task.cancel_requested:
            return self._end(task.task_id, CANCELLED)
        if task.version >= task.total_steps:
            return self._end(task.task_id, DONE)
        if multi_group:
            step_tokens = event.metrics.get("step_tokens")
            if step_tokens:
                trainers.placement.observe(task.task_id, step_tokens)
            return self._rebalance(task)
        return []

    def _rebalance(self, task: TaskState) -> list:
        """At the task's step boundary: moves it to a less-loaded trainer group if that is worth a handover."""
        if self.draining or task.cancel_requested:
            return []
        placement = self.trainers.placement
        target = placement.move_target(task.task_id)
        if target is None:
            return []
        source = placement.move(task.task_id, target)
        task.trainer_group = target
        task.moves += 1
        self.trainers.moving[task.task_id] = source
        self._trainable.pop(task.task_id, None)  # its entry in the old group's heap goes stale
        self._touch(task, quota_changed=False)  # ... and it is filed in the new group's
        return [Move(task.task_id, source, target, task.version)]

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
        self._live -= 1
        if task.status == RUNNING:
            self._n_running -= 1
        task.status, task.error = status, error
        out = []
        # groups still generating or scoring are forgotten when their events arrive (task not active)
        if task.ready or task.training:
            out.append(self._forget(task.ready + (task.training or []), task, f"task {status}"))
        task.ready, task.training = [], None
        if was_training:
            self.training.discard(task_id)
            self.trainers.busy[task.trainer_group] -= 1
        if self._train_heap is None:
            self.trainers.placement.release(task_id)
            if was_training:
                self.trainers.changed(task.trainer_group, self.config.trainer_slots)
        self._touch(task)
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
        # each pass is skipped outright when its index says it has nothing to do (the common case per event)
        out = self._admit() if self._queued else []
        if self.mode.has_rounds and self._n_running:  # quotas that depend on every task (sync, sequential)
            for task in self.mode.new_round():
                self._refile_issuable(task)
        heap = self._train_heap
        if heap is not None:  # one trainer group
            if heap and len(self.training) < self.config.trainer_slots:
                out += self._train(0)
        elif self.trainers.ready:
            for group in sorted(self.trainers.ready):
                out += self._train(group)
        if self._issuable and self._free_ranks and self.env_load:
            out += self._generate()
        return out

    def _admit(self) -> list:
        out = []
        while self._queued and self._n_running < self.config.max_adapters:
            task = self.tasks[heapq.heappop(self._queued)[2]]
            if task.status != QUEUED:
                continue  # cancelled while queued
            task.status, task.admitted_at = RUNNING, self.clock()
            self._n_running += 1
            task.trainer_group = (0 if self._train_heap is not None else
                                  self.trainers.placement.place(task.task_id, estimated_tokens_per_step(task.spec),
                                                                task.spec.base_model))
            self.mode.admitted(task)
            self._touch(task)
            out.append(Admit(task.spec, task.resume_version, task.trainer_group,
                             task.adapter_key if task.rollbacks else None))
        return out

    def _order_key(self, task: TaskState, served: dict[str, int] | None = None):
        """Train order by `_served` (default); rollout order by `_served_rollout`."""
        served = self._served if served is None else served
        order = self.config.order
        if order == "fair":
            return served[task.task_id]
        if order == "priority":
            return (-task.spec.priority, served[task.task_id])
        return (task.submitted_at, task.task_id)  # fifo

    def _train(self, group: int) -> list:
        """Train orders for one trainer group (dispatch comes here with a slot of it free, its heap not empty)."""
        out: list = []
        if self.mode.round_incomplete():
            return out
        # only tasks in _trainable would do anything in this pass, taken in order from their group's heap
        heap, busy, slots = self.trainers.heaps[group], self.trainers.busy, self.config.trainer_slots
        skipped = []
        while busy[group] < slots and heap:
            entry = heapq.heappop(heap)
            task = self.tasks[entry[2]]
            if self._trainable.get(task.task_id) != entry[1]:
                continue
            if not self.mode.may_train(task):
                skipped.append(entry)
                continue
            out += self._drop_stale(task)
            if len(task.ready) < task.batch:
                self._touch(task)
                continue
            # oldest versions first (ready is in version order): they are closest to the bound
            batch, task.ready = task.ready[: task.batch], task.ready[task.batch:]
            # the step's rows in sampling order, not scoring order: which env rank scored first then does not
            # change the trainer's float sums (a job replays bit for bit)
            batch.sort(key=lambda g: (g.version, g.prompt_index, g.group_id))
            task.training = batch
            self.training.add(task.task_id)
            busy[group] += 1
            self._serve(task)
            out.append(Train(task.task_id, task.version, tuple(g.group_id for g in batch),
                             tuple(g.version for g in batch), task.bound, group, self._in_use_from(task)))
        for entry in skipped:
            heapq.heappush(heap, entry)
        if self._train_heap is None:
            self.trainers.changed(group, slots)
        return out

    @staticmethod
    def _in_use_from(task: TaskState) -> int | None:
        """The oldest version of the task's outstanding groups other than the step's own."""
        groups = itertools.chain(task.generating.values(), task.scoring.values(), task.ready)
        return min(map(_version, groups), default=None)

    def _serve(self, task: TaskState) -> None:
        """The task was just given a train order (fair order): it moves to the back of the trainer's queue only
        (issuing prompts moves it in the rollout queue, `_issue`)."""
        self._served[task.task_id] = next(self._seq)
        self._trainable.pop(task.task_id, None)
        self._touch(task)

    def _drop_stale(self, task: TaskState) -> list:
        """Discards the task's ready groups that the staleness rule forbids in its next step."""
        oldest = oldest_allowed(task.version, task.bound)
        cut = bisect.bisect_left(task.ready, oldest, key=_version)  # ready is in version order
        if not cut:
            return []
        stale, task.ready = task.ready[:cut], task.ready[cut:]
        task.dropped_groups += len(stale)
        return [self._forget(stale, task, f"staler than k={task.bound} at v{task.version}")]

    def _quota(self, task: TaskState) -> int:
        """Groups this task may have issued now, by the mode's rule (never more than its remaining steps need)."""
        version = task.version
        if version < 0:
            return 0
        outstanding = task.outstanding()
        remaining = (task.total_steps - version) * task.batch - outstanding
        if remaining <= 0:
            return 0  # finished issuing: the groups out there suffice for the remaining steps
        return max(0, min(self.mode.allowed(task, outstanding), remaining))

    def _env_rank_freed(self, rank: int) -> None:
        """A group left an env rank: its load falls by one (re-filed in the heap; its old entry goes stale)."""
        if rank not in self.env_load:
            return  # lost
        load = self.env_load[rank] = self.env_load[rank] - 1
        heapq.heappush(self._env_heap, (load, rank))
        if len(self._env_heap) > 8 * len(self.env_load) + 64:  # drop the stale entries now and then
            self._env_heap = sorted((load, r) for r, load in self.env_load.items())

    def _take_env_rank(self, count: int) -> int:
        """The least loaded env rank (ties: the lowest), which takes `count` groups. Stale heap entries on top
        are replaced by their rank's load now (which may have been raised from outside) until the top is
        current; the top then makes way for its rank's new load."""
        heap, env_load = self._env_heap, self.env_load
        while True:
            load, rank = heap[0]
            current = env_load.get(rank)
            if load == current:
                break
            if current is None:  # a lost rank's entry
                heapq.heappop(heap)
            else:
                heapq.heapreplace(heap, (current, rank))
        env_load[rank] = load + count
        heapq.heapreplace(heap, (load + count, rank))
        return rank

    def _rank_freed(self, rank: int, count: int) -> None:
        """A rollout rank finished `count` groups; it is listed in _free_ranks iff its load is below its slots."""
        slots = self.config.rollout_slots
        load = self.rollout_load[rank] = self.rollout_load[rank] - count
        if load < slots <= load + count and rank not in self.leaving and rank not in self._closed_ranks:
            bisect.insort(self._free_ranks, self._rank_index[rank])

    def _rank_taken(self, rank: int, count: int) -> None:
        """A rollout rank was given `count` group turns: new groups (it is listed in _free_ranks), or multi-turn
        groups' next turns (Resumed: they may take it past its slots)."""
        load = self.rollout_load[rank] = self.rollout_load[rank] + count
        if load - count < self.config.rollout_slots <= load and rank not in self._closed_ranks:
            del self._free_ranks[bisect.bisect_left(self._free_ranks, self._rank_index[rank])]

    def _generate(self) -> list:
        """Fills the rollout ranks' free slots (config order) with the issuable tasks' groups, in rollout order."""
        if self.rank_models:
            return self._generate_by_model()
        out = []
        while self._issuable and self._free_ranks:
            rank = self.rollout_ranks[self._free_ranks[0]]  # the first rank (config order) with room
            free = self.config.rollout_slots - self.rollout_load[rank]
            # tasks with quota > 0 in order; each one popped is issued (take > 0), so none needs re-pushing
            # unless it keeps quota, which means the rank is full and this rank's pass ends
            while free > 0 and self._issue_heap:
                _, stamp, task_id = heapq.heappop(self._issue_heap)
                if self._issuable.get(task_id) != stamp:
                    continue  # a stale entry: the task was re-filed since
                task = self.tasks[task_id]
                quota = self._quota(task)
                take = min(free, quota)
                if take <= 0:  # cannot happen while the indexes are true; never issue nothing
                    del self._issuable[task_id]
                    continue
                out.append(self._issue(task, rank, take, quota - take))
                free -= take
            if free > 0:
                break  # nothing left to issue
        return out

    def _generate_by_model(self) -> list:
        """`_generate` with `rank_models` set: each free rank takes only its model's tasks, in rollout order; the
        other models' entries are set aside and filed back unchanged (same key and stamp) after the rank's pass."""
        out = []
        for index in list(self._free_ranks):
            if not self._issuable:
                break
            rank = self.rollout_ranks[index]
            model = self.rank_models.get(rank)
            free = self.config.rollout_slots - self.rollout_load[rank]
            aside = []
            while free > 0 and self._issue_heap:
                entry = heapq.heappop(self._issue_heap)
                task_id = entry[2]
                if self._issuable.get(task_id) != entry[1]:
                    continue  # stale
                task = self.tasks[task_id]
                if model is not None and task.spec.base_model != model:
                    aside.append(entry)
                    continue
                quota = self._quota(task)
                take = min(free, quota)
                if take <= 0:
                    del self._issuable[task_id]
                    continue
                out.append(self._issue(task, rank, take, quota - take))
                free -= take
            for entry in aside:
                heapq.heappush(self._issue_heap, entry)
        return out

    def _issue(self, task: TaskState, rank: int, count: int, quota_left: int) -> Generate:
        """Issues `count` prompts of a task (popped from the issue heap) to a rollout rank. `quota_left` is its
        quota less `count`, which is exactly its quota afterwards: issuing raises only outstanding, and every
        mode's quota falls one for one with it (down to the clamp at 0)."""
        env_rank = self._take_env_rank(count)
        groups = []
        for prompt, group_id in self._prompts(task, count):
            group = Group(group_id, task.task_id, prompt, task.version, rank, env_rank)
            self._group_of[group_id] = task.generating[group_id] = group
            groups.append((group_id, prompt))
        self._rank_taken(rank, count)
        # served (fair order): the task moves to the back of the rollout queue only (its train order must not
        # change: it could be overtaken again and again); only the issuable index is re-filed
        self._served_rollout[task.task_id] = next(self._seq)
        if quota_left > 0:
            self._file_issuable(task)
        else:
            del self._issuable[task.task_id]
        return Generate(rank, env_rank, task.task_id, task.version, tuple(groups))

    @staticmethod
    def _prompts(task: TaskState, count: int) -> list[tuple[int, str]]:
        """(prompt index, group id) of the task's next `count` groups: prompts of lost groups first, each under
        a fresh id (`<task>/g<prompt>.r<n>`, n-th issue again: data of the lost one may still turn up), then
        the stream's next ones (`<task>/g<prompt>`)."""
        out = []
        while task.reissue and len(out) < count:
            prompt = task.reissue.pop(0)
            again = task.attempts[prompt] = task.attempts.get(prompt, 0) + 1
            out.append((prompt, f"{task.task_id}/g{prompt}.r{again}"))
        fresh = count - len(out)
        out += [(prompt, f"{task.task_id}/g{prompt}") for prompt in range(task.next_prompt, task.next_prompt + fresh)]
        task.next_prompt += fresh
        return out

    # ---------------------------------------------------------------- rollout ranks lent to other models
    def close_rollout_rank(self, rank: int) -> None:
        """The rank takes no new groups of this scheduler's tasks (a model pool, scheduler/multiplex.py, is
        handing it to another model); the groups on it run to their end, multi-turn ones included. A lost rank
        is left as it is (it is in no pool any more); a rank this scheduler never had is a ValueError."""
        self._check_rollout_rank(rank)
        if rank in self._closed_ranks or rank not in self.rollout_load:
            return
        self._closed_ranks.add(rank)
        index = bisect.bisect_left(self._free_ranks, self._rank_index[rank])
        if index < len(self._free_ranks) and self._free_ranks[index] == self._rank_index[rank]:
            del self._free_ranks[index]

    def open_rollout_rank(self, rank: int) -> list:
        """The rank serves this scheduler's tasks again: returns the commands that fill its free slots. A rank
        lost meanwhile (RankLost) is skipped: nothing to reopen, no command. A rank this scheduler never had is a
        ValueError."""
        self._check_rollout_rank(rank)
        if rank not in self._closed_ranks:
            return []
        self._closed_ranks.discard(rank)
        if rank not in self.rollout_load:  # lost while closed
            return []
        if self.rollout_load[rank] < self.config.rollout_slots and rank not in self.leaving:
            bisect.insort(self._free_ranks, self._rank_index[rank])
        return self.dispatch()

    def _check_rollout_rank(self, rank: int) -> None:
        if rank not in self._rank_index:
            raise ValueError(f"rank {rank} is not a rollout rank of this scheduler "
                             f"(its rollout ranks: {sorted(self._rank_index)})")

    def pending_rollout(self, model: str | None = None) -> int:
        """Groups the running tasks (of base model `model`, when given) may issue now but that no open rollout
        rank has room for: rollout work waiting for an engine (what a model pool weighs against the other
        models' demand)."""
        if self.draining:
            return 0
        return sum(self._quota(self.tasks[task_id]) for task_id in self._issuable
                   if model is None or self.tasks[task_id].spec.base_model == model)

    # ---------------------------------------------------------------- queries
    def settled(self) -> bool:
        """Nothing in flight: no group generating or being scored, no train order outstanding, no task moving
        between trainer groups. With `draining` set this is a step boundary for every task (the point a
        checkpoint is taken at)."""
        return (not self.training and not self.trainers.moving
                and all(not t.generating and not t.scoring for t in self.tasks.values()))

    def trainer_group(self, task_id: str) -> int | None:
        """The trainer group that owns the task now (None before its admission)."""
        return self.tasks[task_id].trainer_group

    def finished(self) -> bool:
        """No task is queued or running."""
        return self._live == 0

    # ---------------------------------------------------------------- incremental indexes
    def _touch(self, task: TaskState, quota_changed: bool = True) -> None:
        """Re-files one task in the indexes after any change to it (status, version, groups, order key)."""
        running = task.status == RUNNING
        idle = running and task.training is None and task.version >= 0
        if self.mode.watches_tasks:
            self.mode.touched(task, running, idle)
        ready = task.ready
        if idle and ready and (len(ready) >= task.batch  # ready is in version order: a stale group is first
                               or ready[0].version < oldest_allowed(task.version, task.bound)):
            if task.task_id not in self._trainable:
                stamp = next(self._stamps)
                self._trainable[task.task_id] = stamp
                if self._train_heap is not None:
                    heapq.heappush(self._train_heap, (self._order_key(task), stamp, task.task_id))
                else:
                    group = task.trainer_group
                    heapq.heappush(self.trainers.heaps[group], (self._order_key(task), stamp, task.task_id))
                    self.trainers.changed(group, self.config.trainer_slots)
        else:
            self._trainable.pop(task.task_id, None)
        if quota_changed:
            self._refile_issuable(task)

    def _refile_issuable(self, task: TaskState) -> None:
        if task.status != RUNNING or self._quota(task) <= 0:
            self._issuable.pop(task.task_id, None)
        elif task.task_id not in self._issuable:
            self._file_issuable(task)

    def _file_issuable(self, task: TaskState) -> None:
        """Lists a task with quota in the issue heap, in rollout order, under a fresh stamp."""
        stamp = self._issuable[task.task_id] = next(self._stamps)
        heapq.heappush(self._issue_heap, (self._order_key(task, self._served_rollout), stamp, task.task_id))


# event type -> handler (one dict lookup per event instead of a chain of isinstance checks)
Scheduler._HANDLERS = {Submit: Scheduler._on_submit, Cancel: Scheduler._on_cancel,
                       Generated: Scheduler._on_generated, Resumed: Scheduler._on_resumed, Scored: Scheduler._on_scored,
                       StepDone: Scheduler._on_step_done, TaskFailed: Scheduler._on_task_failed,
                       Moved: Scheduler._on_moved, RankLost: Scheduler._on_rank_lost,
                       RankJoined: Scheduler._on_rank_joined, RankLeaving: Scheduler._on_rank_leaving}
