"""The scheduler's property tests' driver: the simulator's `SimDriver` (sim/driver.py) with per-stage durations.

The same Scheduler that runs on rank 0 under MPI, and under `marlaas simulate`, runs here on the simulator's
event queue: commands become future events after durations drawn by a `Durations` model (not a workload's rank
models), deliveries may be reordered (`delivery_jitter`: a Scored overtaking its Generated, as messages from
different MPI ranks do), and ranks or whole trainer groups can be lost or join at any time.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from marlaas_hpc.scheduler import (Admit, Discard, Generate, Generated, Move, Moved, RankJoined, RankLost, Scheduler,
                                   Scored, StepDone, Submit, TaskEnded, TaskFailed, Train)
from marlaas_hpc.scheduler.staleness import within_bound
from marlaas_hpc.sim.driver import SimDriver
from marlaas_hpc.tasks.spec import TaskSpec


class Durations(Protocol):
    """Stage-time model (seconds of simulated time)."""

    def generate(self, task_id: str, group_id: str) -> float: ...
    def score(self, task_id: str, group_id: str) -> float: ...
    def train(self, task_id: str, n_groups: int) -> float: ...
    def publish(self, task_id: str) -> float: ...
    # optional: informative(task_id, group_id) -> bool, whether the group's rewards differ (dynamic sampling)


@dataclass
class SimResult:
    end_time: float
    events: int
    ended: dict[str, str] = field(default_factory=dict)
    trained_versions: dict[str, list[tuple[tuple[int, ...], int]]] = field(default_factory=dict)
    """Per task: (behaviour versions of the step's groups, the trainer's version when it started)."""
    trains: list[Train] = field(default_factory=list)
    """Every Train order, in issue order."""
    moves: list[Move] = field(default_factory=list)
    discarded: list[str] = field(default_factory=list)
    """Every group id the scheduler discarded (stale, its task ended, or lost with a rank)."""
    lost_events: int = 0
    """Worker events that never happened because their rank was lost first."""


@dataclass(frozen=True)
class _Worker:
    """An event a worker produces, which happens only if the ranks it depends on are alive then: a Generated needs
    its rollout rank at the end of generation; a Scored needs the rollout rank then and the env rank at its end."""

    event: object
    rollout_rank: int = -1
    generated_at: float = 0.0
    env_rank: int | None = None
    trainer_group: int | None = None
    """A trainer group's event: it happens only if the group is not lost by then."""


class SimLoop(SimDriver):
    def __init__(self, scheduler: Scheduler, durations: Durations, delivery_jitter: float = 0.0, seed: int = 0):
        import random

        super().__init__(scheduler=scheduler)
        self.durations = durations
        self.delivery_jitter = delivery_jitter
        """Max extra latency of each worker event: with jitter, a group's Scored may overtake its Generated,
        as messages from different MPI ranks do."""
        self._rng = random.Random(seed)
        self.result = SimResult(0.0, 0)
        self.lost_at: dict[int, float] = {}
        """Rank -> when it was lost (injected failures)."""
        self.saved: dict[str, dict] = {}
        """Task -> its checkpoint record after its latest step (or at submission)."""
        self.lost_groups: dict[int, float] = {}
        """Trainer group -> when it was lost."""

    @property
    def now(self) -> float:
        return self.queue.now

    def clock(self) -> float:
        return self.queue.now

    def at(self, delay: float, event) -> None:
        self.queue.after(max(0.0, delay), self._arrive, event)

    def submit(self, spec: TaskSpec, delay: float = 0.0) -> None:
        self.at(delay, Submit(spec))

    def lose(self, rank: int, role: str, at: float) -> None:
        """Injects a failure: the rank is gone at time `at` (what it had not finished by then never happens) and
        the scheduler hears of it then (RankLost), as rank 0 does from the MPI's failure notice."""
        self.at(at, _Loss(rank, role))

    def lose_trainer_group(self, group: int, at: float) -> None:
        """Injects a trainer group's loss at time `at`: its steps not done by then never happen, and each task it
        owned goes back to its newest checkpoint (this loop checkpoints every task at every step)."""
        self.at(at, _Loss(-1 - group, "trainer", group))

    def join(self, rank: int, at: float) -> None:
        """A rollout rank joins at time `at` (RankJoined)."""
        self.at(at, RankJoined(rank))

    def run(self, max_events: int = 10_000_000) -> SimResult:
        self.queue.run(until_idle=lambda: self.result.events >= max_events)
        self.result.end_time = self.now
        return self.result

    def _arrive(self, event) -> None:
        """An event is due: a loss or a worker's event becomes the scheduler's (or never happens), then the
        scheduler handles it; every task is checkpointed after its steps."""
        if isinstance(event, _Loss):
            event = self._lost(event)
        elif isinstance(event, _Worker):
            if not self._happens(event):
                self.result.lost_events += 1
                return
            event = event.event
        self.result.events += 1
        self.deliver(event)
        if isinstance(event, (StepDone, Submit)):
            task = self.scheduler.tasks[event.task_id if isinstance(event, StepDone) else event.spec.task_id]
            self.saved[task.task_id] = task.checkpoint()

    def _lost(self, loss: "_Loss") -> RankLost:
        if loss.role != "trainer":
            self.lost_at[loss.rank] = self.now
            return RankLost(loss.rank, loss.role)
        self.lost_groups[loss.group] = self.now
        owned = [t.task_id for t in self.scheduler.tasks.values() if t.status == "running"
                 and loss.group in (t.trainer_group, self.scheduler.trainers.moving.get(t.task_id))]
        return RankLost(loss.rank, "trainer", loss.group, {t: self.saved[t] for t in owned})

    def _happens(self, worker: "_Worker") -> bool:
        if worker.trainer_group is not None:
            return self.lost_groups.get(worker.trainer_group, float("inf")) > self.now
        lost = self.lost_at
        if lost.get(worker.rollout_rank, float("inf")) <= worker.generated_at:
            return False
        return worker.env_rank is None or lost.get(worker.env_rank, float("inf")) > self.now

    def _jitter(self) -> float:
        return self._rng.uniform(0.0, self.delivery_jitter) if self.delivery_jitter else 0.0

    def _execute(self, command) -> None:
        d = self.durations
        if isinstance(command, Admit):
            done = StepDone(command.spec.task_id, command.resume_version or 0)
            self.at(d.publish(command.spec.task_id), _Worker(done, trainer_group=command.trainer_group))
        elif isinstance(command, Generate):
            rank = command.rollout_rank
            for group_id, _ in command.groups:
                gen_time = d.generate(command.task_id, group_id)
                generated = self.now + gen_time
                self.at(gen_time + self._jitter(), _Worker(Generated(rank, (group_id,)), rank, generated))
                informative = d.informative(command.task_id, group_id) if hasattr(d, "informative") else True
                self.at(gen_time + d.score(command.task_id, group_id) + self._jitter(),
                        _Worker(Scored(group_id, 0.0, informative), rank, generated, command.env_rank))
        elif isinstance(command, Train):
            # the trainer's own check of the staleness rule, as the real trainer does
            if not all(within_bound(v, command.from_version, command.bound) for v in command.behaviour_versions):
                self.at(0.0, TaskFailed(command.task_id, "trainer: staleness bound violated"))
                return
            self.result.trained_versions.setdefault(command.task_id, []).append(
                (command.behaviour_versions, command.from_version))
            self.result.trains.append(command)
            cost = d.train(command.task_id, len(command.group_ids)) + d.publish(command.task_id)
            done = StepDone(command.task_id, command.from_version + 1)
            self.at(cost, _Worker(done, trainer_group=command.trainer_group))
        elif isinstance(command, TaskEnded):
            self.result.ended[command.task_id] = command.status
        elif isinstance(command, Move):  # the handover takes about a publish
            self.result.moves.append(command)
            self.at(d.publish(command.task_id), _Worker(Moved(command.task_id, command.to_group),
                                                        trainer_group=command.from_group))
        elif isinstance(command, Discard):
            self.result.discarded += command.group_ids
        else:
            raise TypeError(f"unknown command {command!r}")


@dataclass(frozen=True)
class _Loss:
    rank: int
    role: str
    group: int | None = None
