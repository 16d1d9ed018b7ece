"""What is simulated: the job's layout and tasks, taken from a normal job config and optionally scaled.

A simulated job may be larger than the configs run here: N copies of the config's tasks (`copies_to`), any
number of rollout / env ranks and trainer groups. Tasks are placed on trainer groups by the scheduler's own
placement (scheduler/placement.py), as in the runtime.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from marlaas_hpc.config import JobConfig
from marlaas_hpc.scheduler import SchedulerConfig
from marlaas_hpc.scheduler.settings import SchedulerSettings
from marlaas_hpc.tasks.spec import SpecError, TaskSpec
from marlaas_hpc.config_loader import bounded, check_bounds


@dataclass(frozen=True)
class RankLoss:
    """An injected failure: the `index`-th rank of a role (0-based) is lost `at_s` seconds into the simulation."""

    role: str
    """'rollout' or 'env' (the ranks whose loss the job goes on without)."""
    index: int
    at_s: float

    @classmethod
    def parse(cls, text: str) -> "RankLoss":
        """'rollout:1@30' (the second rollout rank, at 30 s)."""
        try:
            where, at = text.split("@")
            role, index = where.split(":")
            return cls(role, int(index), float(at))
        except ValueError:
            raise SpecError("losses", f"{text!r} is not ROLE:INDEX@SECONDS, e.g. rollout:1@30") from None


@dataclass(kw_only=True)
class SimSetup(SchedulerSettings):
    """A simulated job: the scheduler's settings (SchedulerSettings, as a job config sets them), its ranks and
    its tasks."""

    env_ranks: int = bounded(1, ge=1)
    """Env (CPU) ranks."""
    rollout_ranks: int = bounded(1, ge=1)
    """Rollout ranks (one inference engine each, one GPU each in the GPU count)."""
    trainer_tp: int = bounded(1, ge=1)
    """Tensor-parallel size of a trainer group."""
    trainer_dp: int = bounded(1, ge=1)
    """Data-parallel replicas inside a trainer group (a step's tokens are split over them)."""
    trainer_groups: int = bounded(1, ge=1)
    """Independent trainer groups (DP x TP GPUs each); the scheduler places each task on one."""
    tasks: list[TaskSpec] = field(default_factory=list)
    """The tasks submitted at time 0."""
    losses: list[RankLoss] = field(default_factory=list)
    """Ranks lost while the simulation runs (the scheduler gets RankLost, as rank 0 does in a tolerant job)."""

    @property
    def gpus(self) -> int:
        return self.rollout_ranks + self.trainer_tp * self.trainer_dp * self.trainer_groups

    def world_ranks(self) -> dict[str, tuple[int, ...]]:
        """World ranks per role, in the runtime's order: 0 scheduler, env, rollout, trainer group leaders."""
        env = tuple(range(1, 1 + self.env_ranks))
        rollout = tuple(range(env[-1] + 1, env[-1] + 1 + self.rollout_ranks))
        size = self.trainer_tp * self.trainer_dp
        trainer = tuple(rollout[-1] + 1 + i * size for i in range(self.trainer_groups))
        return {"env": env, "rollout": rollout, "trainer": trainer}

    def scheduler_config(self) -> SchedulerConfig:
        ranks = self.world_ranks()
        return SchedulerConfig(**self.scheduler_settings(), rollout_ranks=ranks["rollout"], env_ranks=ranks["env"],
                               trainer_groups=self.trainer_groups)

    def validate(self) -> "SimSetup":
        check_bounds(self)  # the ranks' and the scheduler settings' bounds
        if not self.tasks:
            raise SpecError("tasks", "nothing to simulate: the config has no tasks")
        for i, loss in enumerate(self.losses):
            count = {"rollout": self.rollout_ranks, "env": self.env_ranks}.get(loss.role)
            if count is None or not 0 <= loss.index < count or loss.at_s < 0:
                raise SpecError(f"losses[{i}]", f"{loss} names no rollout or env rank of this layout")
        for role in ("rollout", "env"):
            if len({loss.index for loss in self.losses if loss.role == role}) >= getattr(self, f"{role}_ranks"):
                raise SpecError("losses", f"every {role} rank is lost: the job would stop, not go on")
        self.scheduler_config().validate()
        return self


def setup_from_job(job: JobConfig, **overrides) -> SimSetup:
    """The simulated twin of a job config; keyword overrides replace fields (None: keep the config's)."""
    setup = SimSetup(**job.scheduler_settings(), env_ranks=job.layout.env_ranks,
                     rollout_ranks=job.layout.rollout_ranks, trainer_tp=job.layout.trainer_tp,
                     trainer_dp=job.layout.trainer_dp, trainer_groups=job.layout.trainer_groups,
                     tasks=list(job.tasks))
    return dataclasses.replace(setup, **{k: v for k, v in overrides.items() if v is not None}).validate()


def copies_to(tasks: list[TaskSpec], count: int) -> list[TaskSpec]:
    """`count` tasks cycling through the given ones; copies get ids '<id>-c<i>' (scale studies)."""
    if count <= len(tasks):
        return list(tasks[:count])
    out = []
    for i in range(count):
        base = tasks[i % len(tasks)]
        out.append(base if i < len(tasks) else dataclasses.replace(base, task_id=f"{base.task_id}-c{i}"))
    return out
