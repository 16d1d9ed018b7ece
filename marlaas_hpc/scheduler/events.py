"""What goes into the scheduler (events) and what comes out (commands), and the audit's record of each trained
group (scheduler/core.py handles them; runtime/scheduler_rank.py and the simulator drive it with them).

Events and commands are plain slotted dataclasses, not frozen ones: a frozen dataclass sets each field through
object.__setattr__, which makes it 4x dearer to build (1.2 us against 0.3), and a simulation builds one or more of
each per event. Nothing mutates one once it is sent: treat them as values.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from marlaas_hpc.tasks.spec import TaskSpec


# ---- events (into the scheduler) ----
@dataclass(slots=True)
class Submit:
    spec: TaskSpec
    resume: dict | None = field(default=None, compare=False)
    """A checkpointed task record (`TaskState.checkpoint()`): the task continues at its saved version."""


@dataclass(slots=True)
class Cancel:
    task_id: str


@dataclass(slots=True)
class Generated:
    rollout_rank: int
    group_ids: tuple[str, ...]
    versions: tuple[int | None, ...] = ()
    """Adapter version each group was actually sampled with (a rollout rank may use a newer version than
    the one asked for if the older one is gone; never an older one). Empty: as issued."""


@dataclass(slots=True)
class Resumed:
    """A multi-turn group's next turn entered the rollout rank's batch (its tool calls are back): it takes a rollout
    slot again, even past rollout_slots (its episodes' version is pinned: it never waits). Its Generated, when the
    turn is done, frees the slot."""

    rollout_rank: int
    group_ids: tuple[str, ...]


@dataclass(slots=True)
class RankLost:
    """A worker rank is gone (it died, hung and was killed, or left); runtime/membership.py notices the loss and
    rank 0 hands it to the scheduler. A rollout or env rank: the unscored groups it held are sampled again
    elsewhere. A trainer rank: its whole trainer group is gone, and each task it owned goes back to its newest
    checkpoint (`restore`) and is admitted again on a surviving group."""

    rank: int
    role: str
    """'rollout', 'env' or 'trainer'."""
    trainer_group: int | None = None
    """A trainer rank's group."""
    restore: dict = field(default_factory=dict, repr=False)
    """A trainer group's loss: task -> the checkpoint record it goes back to (TaskState.checkpoint() at its
    newest save, or at submission: rank 0's records, runtime/records.py)."""


@dataclass(slots=True)
class RankLeaving:
    """A rollout rank is to leave the live job (`marlaas scale` down): it gets no new group; once none of its groups
    is left (`rank_idle`) it leaves, and its RankLost finds nothing to issue again."""

    rank: int


@dataclass(slots=True)
class RankJoined:
    """A rollout rank joined the live job (`marlaas scale`, a replacement): it takes groups from now on."""

    rank: int
    role: str = "rollout"


@dataclass(slots=True)
class Scored:
    group_id: str
    reward_mean: float
    informative: bool = field(default=True, repr=False)
    """Whether the group's training rewards differ (some learning signal); dynamic sampling drops the others
    (scheduler/sampling.py). Out of the repr: traces of jobs without dynamic sampling read as before."""


@dataclass(slots=True)
class StepDone:
    """The trainer applied a step (or, at version 0, created the adapter) and published `version`."""

    task_id: str
    version: int
    metrics: dict = field(default_factory=dict, compare=False)


@dataclass(slots=True)
class TaskFailed:
    task_id: str
    error: str


@dataclass(slots=True)
class Moved:
    """The task's adapter and optimizer state arrived in its new trainer group (after a Move)."""

    task_id: str
    trainer_group: int


# ---- commands (out of the scheduler) ----
@dataclass(slots=True)
class Admit:
    spec: TaskSpec
    resume_version: int | None = None
    """Restore the adapter and optimizer saved at this version instead of creating a fresh adapter."""
    trainer_group: int = 0
    """The trainer group that creates (or restores) the adapter and owns the task."""
    adapter_key: str | None = field(default=None, repr=False)
    """The name its versions are published under, after a rollback (TaskState.adapter_key); None: the task id."""


@dataclass(slots=True)
class Generate:
    rollout_rank: int
    env_rank: int
    task_id: str
    version: int
    groups: tuple[tuple[str, int], ...]
    """(group_id, prompt index in the task's training stream)."""


@dataclass(slots=True)
class Train:
    task_id: str
    from_version: int
    group_ids: tuple[str, ...]
    behaviour_versions: tuple[int, ...]
    bound: int
    """The task's staleness bound k; the trainer re-checks every version against it."""
    trainer_group: int = field(default=0, repr=False)
    """The trainer group that owns the task (out of the repr: traces of one-group jobs read as before)."""
    in_use_from: int | None = field(default=None, repr=False)
    """The oldest version any other outstanding group of the task was issued at (generating, in a multi-turn
    episode waiting on a tool, being scored, buffered); None: none. A rollout rank may sample such a group
    with any version from that one to the newest, so the trainer keeps all of them (runtime/retention.py)."""


@dataclass(slots=True)
class Move:
    """Hand the task (idle: at a step boundary, at `version`) from one trainer group to another: the source
    sends its adapter and optimizer state (and any data it holds for it) to the target, which answers Moved.
    Train orders for the task go to the target from now on; it runs them once the state is there."""

    task_id: str
    from_group: int
    to_group: int
    version: int


@dataclass(slots=True)
class Discard:
    task_id: str
    group_ids: tuple[str, ...]
    reason: str


@dataclass(slots=True)
class TaskEnded:
    task_id: str
    status: str
    error: str | None = None


@dataclass(slots=True)
class AuditRecord:
    task_id: str
    group_id: str
    behaviour_version: int
    trained_into: int
    bound: int

    @property
    def staleness(self) -> int:
        """Versions between the sampler and the step's starting version (trained_into - 1): at most `bound`
        (scheduler/staleness.py)."""
        return self.trained_into - 1 - self.behaviour_version
