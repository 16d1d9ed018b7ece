"""How each mode paces tasks: one policy object per mode, owning its quota and train rules and their state.

    async       every task at its own pace: up to (k+1)·B groups outstanding (the staleness rule,
                scheduler/staleness.py), a step whenever B groups are ready
    sync        lockstep rounds: only tasks at the lowest running version are issued (B groups each), and no task
                trains until every idle task at that version has its batch: every step is on-policy
    sequential  one task at a time (by -priority, then submission): B groups while no step of it is in flight

The scheduler (core.py) asks the mode's policy, and tells it what changed:
- `allowed(task, outstanding)`: groups the task may have issued now, before the cap of its remaining steps;
- `may_train(task)`, and `round_incomplete()` (no task may train: checked once per train pass);
- `admitted(task)`, `touched(task, running, idle)`: a task was admitted / changed (the indexes the mode keeps);
- `new_round()`: the tasks whose quota changed because the round moved on (sync: the lowest version rose;
  sequential: another task is first), for the scheduler to re-file. Called once per dispatch while tasks run.
"""
from __future__ import annotations

import heapq
from collections import Counter
from typing import Iterable

from marlaas_hpc.scheduler.staleness import admission_window
from marlaas_hpc.scheduler.state import RUNNING, TaskState


class Mode:
    """A mode's hooks with their common answers: every task may train, no rounds."""

    has_rounds = False
    """Whether quotas depend on every task (the scheduler asks `new_round` once per dispatch)."""
    watches_tasks = False
    """Whether the mode keeps an index of the tasks (the scheduler tells it each change: `touched`)."""

    def __init__(self, tasks: dict[str, TaskState]):
        self.tasks = tasks

    def allowed(self, task: TaskState, outstanding: int) -> int:
        raise NotImplementedError

    def may_train(self, task: TaskState) -> bool:
        return True

    def round_incomplete(self) -> bool:
        return False

    def admitted(self, task: TaskState) -> None:
        pass

    def touched(self, task: TaskState, running: bool, idle: bool) -> None:
        pass

    def new_round(self) -> Iterable[TaskState]:
        return ()


class AsyncMode(Mode):
    """Every task at its own pace, within the staleness rule's admission window."""

    def allowed(self, task: TaskState, outstanding: int) -> int:
        return admission_window(task.bound, task.batch) - outstanding


class SyncMode(Mode):
    """Lockstep rounds at the lowest running version: every step on-policy."""

    has_rounds = watches_tasks = True

    def __init__(self, tasks: dict[str, TaskState]):
        super().__init__(tasks)
        self.versions: Counter = Counter()
        """Versions of the running tasks: the round is the lowest."""
        self.short_of_batch: Counter = Counter()
        """Per version: running idle tasks at it with less than a batch ready."""
        self.counted: dict[str, tuple] = {}
        """task_id -> (its version in `versions`, its key in `short_of_batch`), as last counted."""
        self.round: int | None = None
        """The round (lowest running version) the tasks' quotas were filed for."""

    def allowed(self, task: TaskState, outstanding: int) -> int:
        return task.batch - outstanding if task.version == min(self.versions) else 0

    def may_train(self, task: TaskState) -> bool:
        # the round trains only once every task of the round has its whole batch scored
        return not any(version <= task.version for version in self.short_of_batch)

    def round_incomplete(self) -> bool:
        """An idle task at the lowest version is short of a batch, so no task may train (may_train's rule,
        checked once per train pass instead of for every waiting task)."""
        if not self.short_of_batch:
            return False
        return min(self.short_of_batch) <= min(v for v in self.versions if v >= 0)

    def touched(self, task: TaskState, running: bool, idle: bool) -> None:
        short = task.version if idle and len(task.ready) < task.batch else None
        counted = (task.version if running else None, short)
        before = self.counted.get(task.task_id, (None, None))
        if counted == before:
            return
        for counter, old, new in ((self.versions, before[0], counted[0]), (self.short_of_batch, before[1], counted[1])):
            if old != new:
                if old is not None:
                    counter[old] -= 1
                    if counter[old] == 0:
                        del counter[old]
                if new is not None:
                    counter[new] += 1
        self.counted[task.task_id] = counted

    def new_round(self) -> Iterable[TaskState]:
        lowest = min(self.versions)
        if lowest == self.round:
            return ()
        self.round = lowest
        return [task for task in self.tasks.values() if task.status == RUNNING]


class SequentialMode(Mode):
    """One task at a time, one synchronous step after another."""

    has_rounds = True

    def __init__(self, tasks: dict[str, TaskState]):
        super().__init__(tasks)
        self.order: list = []
        """Heap of (-priority, submitted_at, task_id) of admitted tasks; ended ones are dropped from the top."""
        self.current: TaskState | None = None
        """The task the quotas were filed for."""

    def allowed(self, task: TaskState, outstanding: int) -> int:
        return task.batch - outstanding if task is self.first() and task.training is None else 0

    def admitted(self, task: TaskState) -> None:
        heapq.heappush(self.order, (-task.spec.priority, task.submitted_at, task.task_id))

    def first(self) -> TaskState:
        """The task served now: the first running one by (-priority, submitted_at, task_id)."""
        while self.tasks[self.order[0][2]].status != RUNNING:
            heapq.heappop(self.order)
        return self.tasks[self.order[0][2]]

    def new_round(self) -> Iterable[TaskState]:
        first, previous = self.first(), self.current
        if first is previous:
            return ()
        self.current = first  # only the previous and the new first task change quota
        return [task for task in (previous, first) if task is not None]


_POLICIES: dict[str, type[Mode]] = {"async": AsyncMode, "sync": SyncMode, "sequential": SequentialMode}
MODES = tuple(_POLICIES)
"""The mode names a job config may name."""


def mode_policy(name: str, tasks: dict[str, TaskState]) -> Mode:
    """The policy object of mode `name` over the scheduler's tasks."""
    return _POLICIES[name](tasks)
