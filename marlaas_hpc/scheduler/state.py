"""Per-task and per-group book-keeping of the scheduler (pure data, no MPI)."""
from __future__ import annotations

from dataclasses import dataclass, field

from marlaas_hpc.tasks.spec import TaskSpec

QUEUED, RUNNING, DONE, FAILED, CANCELLED = "queued", "running", "done", "failed", "cancelled"


@dataclass(slots=True)
class Group:
    """G completions of one prompt: the unit the scheduler routes, trains or drops."""

    group_id: str
    task_id: str
    prompt_index: int
    """Cursor into the task's training stream."""
    version: int
    """Adapter version the rollout rank was told to sample with (the behaviour version)."""
    rollout_rank: int
    env_rank: int
    reward_mean: float | None = None


@dataclass
class TaskState:
    spec: TaskSpec
    status: str = QUEUED
    version: int = 0
    """Optimizer steps applied to the adapter (the trainer's version)."""
    next_prompt: int = 0
    """Next cursor of the task's training stream to hand out."""
    generating: dict[str, Group] = field(default_factory=dict)
    """Issued, not yet generated."""
    scoring: dict[str, Group] = field(default_factory=dict)
    """Generated, being scored on an env rank."""
    ready: list[Group] = field(default_factory=list)
    """Scored and buffered at the trainer, oldest first."""
    training: list[Group] | None = None
    """Groups of the step in flight, if any."""
    trained_groups: int = 0
    dropped_groups: int = 0
    filtered_groups: int = 0
    """Groups dropped by dynamic sampling (their rewards were all equal; scheduler/sampling.py)."""
    uninformative_run: int = 0
    """Uninformative groups scored in a row (dynamic sampling's patience counts them)."""
    max_trained_staleness: int = 0
    preempted_groups: int = 0
    """Groups issued but not trained when the job stopped (preempted or crashed) after the checkpoint it resumed
    from: their prompts are not re-issued."""
    submitted_at: float = 0.0
    admitted_at: float | None = None
    step_times: list[float] = field(default_factory=list)
    """Time of each completed optimizer step (TTFS, TPTS)."""
    error: str | None = None
    cancel_requested: bool = False
    """Cancel arrived while a step was in flight: end the task when that step lands."""
    reward_history: list[float] = field(default_factory=list)
    resume_version: int | None = None
    """Set for a task restored from a checkpoint: the version its adapter and optimizer were saved at."""
    trainer_group: int | None = None
    """The trainer group that owns the task's adapter and optimizer (set at admission; None before)."""
    moves: int = 0
    """Times the task moved to another trainer group (placement/rebalancing)."""
    reissue: list[int] = field(default_factory=list)
    """Prompts of lost in-flight groups (their rank was lost), issued again before the stream's next ones."""
    attempts: dict[int, int] = field(default_factory=dict)
    """Prompt -> times it was issued again (the suffix of its group id)."""
    reissued_groups: int = 0
    """Groups lost with a rank and issued again."""
    rollbacks: int = 0
    """Times the task went back to its checkpoint because its trainer group was lost. Each rollback starts a new
    line of adapter versions (`adapter_key`): the rollout ranks still hold the lost line's newer versions."""

    @property
    def adapter_key(self) -> str:
        """The name its adapter versions are published and sampled under: the task id, then `<task>@<n>` after
        its n-th rollback (version v of the lost line and of the new one are different adapters)."""
        return self.task_id if not self.rollbacks else f"{self.task_id}@{self.rollbacks}"

    def checkpoint(self) -> dict:
        """What a resume restarts the task from (JSON). Groups in flight or buffered are not kept: their prompts
        are not re-issued (the cursor has moved on) and are counted in preempted_groups."""
        unfinished = self.status in (QUEUED, RUNNING)
        return {"status": self.status, "error": self.error,
                "version": self.version if self.version >= 0 else None,
                "next_prompt": self.next_prompt, "trained_groups": self.trained_groups,
                "dropped_groups": self.dropped_groups, "filtered_groups": self.filtered_groups,
                "max_trained_staleness": self.max_trained_staleness,
                "submitted_at": self.submitted_at, "step_times": list(self.step_times),
                "reward_history": list(self.reward_history), "trainer_group": self.trainer_group,
                "moves": self.moves,
                "reissued_groups": self.reissued_groups,
                "preempted_groups": self.preempted_groups + self.outstanding() + len(self.reissue) if unfinished
                else self.preempted_groups}

    @classmethod
    def from_checkpoint(cls, spec: TaskSpec, record: dict) -> "TaskState":
        """A running task comes back queued (it is re-admitted from its saved version); an ended one as is."""
        ended = record["status"] in (DONE, FAILED, CANCELLED)
        version = record["version"]
        task = cls(spec=spec, status=record["status"] if ended else QUEUED,
                   version=(version or 0) if ended else -1, next_prompt=record["next_prompt"],
                   trained_groups=record["trained_groups"], dropped_groups=record["dropped_groups"],
                   max_trained_staleness=record["max_trained_staleness"], submitted_at=record["submitted_at"],
                   step_times=list(record["step_times"]), error=record["error"],
                   reward_history=list(record["reward_history"]),
                   preempted_groups=record.get("preempted_groups", 0), moves=record.get("moves", 0),
                   reissued_groups=record.get("reissued_groups", 0),
                   filtered_groups=record.get("filtered_groups", 0),
                   trainer_group=record.get("trainer_group") if ended else None)
        if not ended and version is not None:
            task.resume_version = version
        return task

    def __post_init__(self):
        # read on every scheduler event: plain attributes, not lookups through spec (simulations of 1024 tasks)
        self.task_id: str = self.spec.task_id
        self.batch: int = self.spec.algo.batch_prompts
        """B: prompt groups per optimizer step."""
        self.bound: int = self.spec.max_staleness
        """k: the staleness bound."""
        self.total_steps: int = self.spec.total_steps
        self.filters_groups: bool = self.spec.algo.filters_groups
        """Dynamic sampling: groups with equal rewards are dropped and replaced (scheduler/sampling.py)."""
        self.filter_patience: int = self.spec.algo.dynamic_sampling_patience * self.batch
        """Uninformative groups in a row that dynamic sampling drops before it lets them through."""

    def outstanding(self) -> int:
        """Groups generated or in flight beyond what the trainer has consumed (admission control)."""
        training = self.training
        return (len(self.generating) + len(self.scoring) + len(self.ready)
                + (len(training) if training is not None else 0))

    def ttfs(self) -> float | None:
        return self.step_times[0] - self.submitted_at if self.step_times else None

    def tpts(self) -> float | None:
        if len(self.step_times) < 2:
            return None
        return (self.step_times[-1] - self.step_times[0]) / (len(self.step_times) - 1)
