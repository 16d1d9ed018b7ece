"""Which trainer group owns each task: placement by tokens per step, and moves that even the groups out.

A trainer group (DP x TP ranks, `layout.trainer_groups`) holds the adapter shards and optimizer state of the
tasks it owns and trains them; groups never exchange gradients. A group's load is the sum of its tasks'
tokens per step (what its train steps cost), not its task count: one task with 1024-token answers weighs as
much as many tasks with short ones. A task's tokens per step start as an estimate from its spec and become the
mean measured over its steps (StepDone metrics 'step_tokens') once it has trained.

    place(task)      a new (or resumed) task goes to the least-loaded group of its base model (ties: the lowest
                     index; issue #28: each group loads one base model, `models`)
    observe(task, n) a step of the task trained n tokens (prompt + completion): its cost is the measured mean
    move_target(t)   at t's step boundary: the least-loaded group of t's model if moving t there lowers the larger of the
                     two groups' loads by at least MOVE_GAIN of it, else None (a move hands over the adapter
                     and optimizer state, so it must be worth it)
    release(task)    the task ended: its group sheds its load

A move never raises the larger load of the pair it moves between, so with fixed costs a task cannot bounce
back and forth. The scheduler and the simulator both place through this object (scheduler/core.py).
"""
from __future__ import annotations

from marlaas_hpc.tasks.spec import TaskSpec

MOVE_GAIN = 0.1
"""A move must lower the larger load of its two groups by at least this fraction of it."""


def estimated_tokens_per_step(spec: TaskSpec) -> float:
    """Tokens a step of the task trains, before it has trained: B prompt groups x G samples x the per-turn
    token cap (prompts are unknown here; the measured mean replaces this after the first step)."""
    algo = spec.algo
    return float(algo.batch_prompts * algo.group_size * algo.max_new_tokens)


class Placement:
    def __init__(self, groups: int, models: tuple[str, ...] = ()):
        if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
            raise ValueError(f"trainer_groups: must be an integer >= 1, got {groups!r}")
        if models and len(models) != groups:
            raise ValueError(f"trainer_group_models: {len(models)} models for {groups} trainer groups")
        self.groups = groups
        self.models = tuple(models)
        """The base model each group loads (empty: every group loads the job's one model)."""
        self._groups_of: dict[str, list[int]] = {}
        for group, model in enumerate(self.models):
            self._groups_of.setdefault(model, []).append(group)
        self.model_of: dict[str, str | None] = {}
        """task -> the base model it was placed by (None: any group)."""
        self.load = [0.0] * groups
        """Tokens per step of the tasks each group owns."""
        self.tasks = [0] * groups
        """Tasks each group owns."""
        self.owner: dict[str, int] = {}
        self.cost: dict[str, float] = {}
        """Tokens per step of each placed task (estimate, then measured mean)."""
        self._measured: dict[str, tuple[float, int]] = {}
        """task -> (sum of measured step tokens, steps measured)."""

    def groups_of(self, model: str | None) -> list[int] | None:
        """The groups that load `model` (None: every group, a job of one model or a task naming none);
        ValueError naming `base_model` if none does."""
        if not self.models or model is None:
            return None
        groups = self._groups_of.get(model)
        if not groups:
            raise ValueError(f"base_model: no trainer group loads model {model!r} (groups load "
                             f"{sorted(self._groups_of)})")
        return groups

    def place(self, task_id: str, tokens_per_step: float, model: str | None = None) -> int:
        """The least-loaded group of `model` (ties: the lowest index) takes the task."""
        if task_id in self.owner:
            raise ValueError(f"task {task_id!r} is already placed on trainer group {self.owner[task_id]}")
        group = self.least_loaded(self.groups_of(model))
        self.model_of[task_id] = model
        self.owner[task_id], self.cost[task_id] = group, float(tokens_per_step)
        self.load[group] += self.cost[task_id]
        self.tasks[group] += 1
        return group

    def least_loaded(self, among: list[int] | None = None) -> int:
        """The group with the least load, of `among` (None: of all; ties: the lowest index)."""
        load = self.load
        if among is None:
            return load.index(min(load))  # two C-level scans: the scheduler asks at every step boundary
        return min(among, key=load.__getitem__)

    def observe(self, task_id: str, step_tokens: float) -> None:
        """A step of the task trained `step_tokens` tokens: its cost becomes the mean of its measured steps."""
        if task_id not in self.owner:
            return
        total, steps = self._measured.get(task_id, (0.0, 0))
        total, steps = total + float(step_tokens), steps + 1
        self._measured[task_id] = (total, steps)
        self._set_cost(task_id, total / steps)

    def move_target(self, task_id: str) -> int | None:
        """The group the task should move to now (at its step boundary), or None."""
        source = self.owner[task_id]
        target = self.least_loaded(self.groups_of(self.model_of.get(task_id)))
        if target == source:
            return None
        cost = self.cost[task_id]
        larger_after = max(self.load[source] - cost, self.load[target] + cost)
        return target if larger_after <= (1.0 - MOVE_GAIN) * self.load[source] else None

    def move(self, task_id: str, target: int) -> int:
        """Hands the task to `target`; returns the group it left."""
        source = self.owner[task_id]
        cost = self.cost[task_id]
        self.load[source] -= cost
        self.load[target] += cost
        self.tasks[source] -= 1
        self.tasks[target] += 1
        self.owner[task_id] = target
        return source

    def drop_group(self, group: int) -> None:
        """The group is lost: it is never the least loaded again (its tasks are released one by one)."""
        self.load[group] = float("inf")

    def release(self, task_id: str) -> None:
        group = self.owner.pop(task_id, None)
        self.model_of.pop(task_id, None)
        if group is not None:
            self.load[group] -= self.cost.pop(task_id)
            self._measured.pop(task_id, None)
            self.tasks[group] -= 1
            if not self.tasks[group] and self.load[group] != float("inf"):
                self.load[group] = 0.0  # no float residue on an empty group (a lost one stays infinite)

    def _set_cost(self, task_id: str, cost: float) -> None:
        group = self.owner[task_id]
        self.load[group] += cost - self.cost[task_id]
        self.cost[task_id] = cost
