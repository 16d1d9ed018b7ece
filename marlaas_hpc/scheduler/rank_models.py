"""Rank 0's model pool: which base model each rollout rank serves in a job of several models (issue #28, item 4).

The policy is the simulator's (scheduler/multiplex.py `ModelPool`); this is its runtime driver, the one owner of
the assignment. Per rollout rank a state: generating for model M, draining (closed to M's new groups, for
another model), waking (told to switch, its answer not in yet). Every `tick_s`:

    demand per model:  waiting = Scheduler.pending_rollout(M) + M's evals held back here (no rank serves M)
                       held[rank] = M's groups on the rank: issued and not generated, multi-turn ones until
                                    scored (open between turns), eval groups out
    ModelPool.plan ─► Drain(rank)   Scheduler.close_rollout_rank
                      Reopen(rank)  Scheduler.open_rollout_rank (its commands: Generate)
                      Switch(rank)  close the rank, `rank_models[rank] = M'`, Serve(rank, M') to the rank
    Served(rank, M') from the rank (after its engine switch, with its measured cost) ─► ModelPool.woken,
                      ModelPool.measured(cost), open the rank, release M''s evals held back

The one hook in the scheduler's core is `Scheduler.rank_models` (a rank takes only its model's tasks) and
`pending_rollout(model)`; everything else is here. The rollout rank's `ModelEngines` follows `Serve`
(rollout/model_engines.py `follow`): it switches once its awake engine is idle, never deciding alone. Every
task's staleness bound and audit are the scheduler's, unchanged.

Ranks that come and go. A rank that joins the running job (`marlaas scale` up, or a replacement for a lost rank,
runtime/scaling.py) enters the pool (`joined`, before the scheduler's RankJoined fills it): a new pool index, for
the model with the most waiting groups (`ModelPool.join`), `rank_models[rank]` set so its first groups are of
that model, and a `Serve` sent ahead of them, so its ModelEngines follows rank 0 from its first group (it comes
up with the first model's engine awake: for another model it is 'waking' until its Served, its groups waiting
in its ModelEngines meanwhile). A rank that drains to leave (`marlaas scale` down: `leaving`) leaves the split at
once (phase 'released'; its groups finish there), and a rank lost or gone (`lost`) leaves it and `rank_models`.

Pure like the scheduler: no clock (the caller passes `now`), no MPI (runtime/scheduler_rank.py sends `Serve` and
hands `Served` back).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from marlaas_hpc.scheduler.multiplex import GONE, WAKING, Drain, ModelDemand, ModelPool, Reopen, Switch


@dataclass(frozen=True, slots=True)
class Serve:
    """rank 0 -> a rollout rank: serve `model` from now on (once its awake engine holds nothing, sleep it and wake
    this one), then answer `Served`."""

    rollout_rank: int
    model: str


@dataclass(frozen=True, slots=True)
class Served:
    """rollout rank -> rank 0: its engine of `model` is awake; the switch cost `sleep_s` + `wake_s` (both 0 when
    it was awake already)."""

    rollout_rank: int
    model: str
    sleep_s: float = 0.0
    wake_s: float = 0.0


class RankModels:
    """The assignment of rollout ranks to base models on rank 0, by the ModelPool policy."""

    def __init__(self, scheduler, models: list[str], multi_turn: Callable[[str], bool], tick_s: float = 0.05,
                 gain_margin: float = 2.0):
        self.scheduler = scheduler
        self.ranks = [rank for rank in scheduler.rollout_ranks if rank in scheduler.rollout_load]
        """The pool's rollout ranks (world ranks), in the scheduler's order: pool index i is ranks[i]."""
        self.index = {rank: i for i, rank in enumerate(self.ranks)}
        self.multi_turn = multi_turn
        """task id -> whether its groups stay open on their rank between turns (held until scored)."""
        self.tick_s = tick_s
        """Seconds between two plans."""
        # the switch cost is unknown until a rank measures one: 0 (switches are taken; the dwell is 0)
        self.policy = ModelPool(len(self.ranks), models, switch_s=0.0, slots=scheduler.config.rollout_slots,
                                gain_margin=gain_margin)
        for rank, state in zip(self.ranks, self.policy.ranks):
            scheduler.rank_models[rank] = state.awake
        self.evals: dict[str, list] = {model: [] for model in models}
        """Per model: (eval payload, groups) held back because no rank serves the model now."""
        self.next_tick = 0.0
        self._since: dict[str, tuple[str, float]] = {}
        """Group held on a rank -> (its model, when it was first seen held): its hold time when it leaves."""

    # ---- what rank 0 asks ----
    def start(self) -> list[Serve]:
        """The first assignment, one Serve per rank (before any Generate: rank i serves model i mod K)."""
        return [Serve(rank, state.awake) for rank, state in zip(self.ranks, self.policy.ranks)]

    def model_of(self, rank: int) -> str | None:
        return self.scheduler.rank_models.get(rank)

    def eval_rank(self, model: str) -> int | None:
        """A rank serving `model` now for an eval of it (the one holding fewest groups); None: none does (hold
        the eval back with `hold_eval`)."""
        serving = [self.ranks[i] for i in self.policy.serving(model) if self.ranks[i] in self.scheduler.rollout_load]
        return min(serving, key=lambda rank: self.scheduler.rollout_load[rank], default=None)

    def hold_eval(self, model: str, payload, groups: int) -> None:
        """An eval of `model` waits here for a rank serving it; its groups count as the model's waiting work."""
        self.evals[model].append((payload, groups))

    # ---- events ----
    def due(self, now: float) -> bool:
        return now >= self.next_tick

    def tick(self, now: float, evals_out: Iterable[tuple[str, int]] = ()) -> list:
        """Plans and applies: returns the scheduler's commands (a reopened rank filled) and `Serve` orders.
        `evals_out`: (model, rollout rank) per eval group out and not answered."""
        self.next_tick = now + self.tick_s
        out: list = []
        for command in self.policy.plan(now, self._demand(now, evals_out)):
            rank = self.ranks[command.rank]
            if isinstance(command, Drain):
                self.scheduler.close_rollout_rank(rank)
            elif isinstance(command, Reopen):
                out += self.scheduler.open_rollout_rank(rank)
            elif isinstance(command, Switch):
                self.scheduler.close_rollout_rank(rank)
                self.scheduler.rank_models[rank] = command.to_model
                out.append(Serve(rank, command.to_model))
        return out

    def served(self, event: Served, now: float) -> tuple[list, list]:
        """A rank's answer to Serve: it serves `event.model` now. Returns the scheduler's commands (its slots
        filled) and the evals held back for that model (payloads, to send to this rank)."""
        i = self.index.get(event.rollout_rank)
        state = None if i is None else self.policy.ranks[i]
        if state is None or state.awake != event.model or state.phase in GONE:
            return [], []  # not (or no longer) the pool's assignment, or a rank that left the pool
        if event.sleep_s or event.wake_s:
            self.policy.measured(event.sleep_s + event.wake_s)
        if state.phase == WAKING:
            self.policy.woken(i, now)
        commands = self.scheduler.open_rollout_rank(event.rollout_rank)
        evals, self.evals[event.model] = [payload for payload, _ in self.evals[event.model]], []
        return commands, evals

    def lost(self, rank: int) -> None:
        """A rollout rank lost, or gone after its drain: it leaves the pool (never a donor nor a target again) and
        the assignment (`rank_models`, status.json's `rollout_models`)."""
        i = self.index.get(rank)
        if i is not None and self.policy.ranks[i].phase not in GONE:
            self.policy.lose(i)
        self.scheduler.rank_models.pop(rank, None)

    def leaving(self, rank: int) -> None:
        """A rollout rank drains to leave (`marlaas scale` down, the scheduler's RankLeaving): it leaves the split
        now (never a donor nor a target again); its groups there finish, and it keeps its model until it is gone
        (`lost`)."""
        i = self.index.get(rank)
        if i is not None:
            self.policy.leave(i)

    def joined(self, rank: int, now: float, evals_out: Iterable[tuple[str, int]] = (),
               awake: str | None = None) -> list[Serve]:
        """A rollout rank joined the job: it enters the pool for the model with the most waiting groups now
        (`ModelPool.join`), takes only that model's tasks from its first group (`rank_models`), and is told so:
        returns its `Serve`, to send before any command to it that the scheduler's RankJoined makes (call this
        first). `awake`: the model whose engine is awake on it as it comes up (None: the first, as
        runtime/main.py `model_engines` builds them); another model is switched to ('waking' until its Served;
        its groups wait in its ModelEngines). ValueError for a rank the pool has already had."""
        if rank in self.index:
            raise ValueError(f"rollout rank {rank} is already in the model pool")
        i = self.policy.join(now, self._demand(now, evals_out), self.policy.models[0] if awake is None else awake)
        self.ranks.append(rank)
        self.index[rank] = i
        model = self.scheduler.rank_models[rank] = self.policy.ranks[i].awake
        return [Serve(rank, model)]

    # ---- demand ----
    def _demand(self, now: float, evals_out: Iterable[tuple[str, int]]) -> dict[str, ModelDemand]:
        demand = {model: ModelDemand(self.scheduler.pending_rollout(model) + sum(n for _, n in self.evals[model]))
                  for model in self.policy.models}
        seen = set()
        for task_id, task in self.scheduler.tasks.items():
            model = task.spec.base_model
            held = demand[model].held
            groups = list(task.generating.values())
            if task.scoring and self.multi_turn(task_id):
                groups += task.scoring.values()
            for group in groups:
                i = self.index.get(group.rollout_rank)
                if i is None:
                    continue
                seen.add(group.group_id)
                self._since.setdefault(group.group_id, (model, now))
                if self.policy.ranks[i].phase not in GONE:  # a draining rank's groups need no rank of the pool
                    held[i] = held.get(i, 0) + 1
        for model, rank in evals_out:
            i = self.index.get(rank)
            if i is not None and model in demand and self.policy.ranks[i].phase not in GONE:
                demand[model].held[i] = demand[model].held.get(i, 0) + 1
        for group_id in [g for g in self._since if g not in seen]:
            model, since = self._since.pop(group_id)
            self.policy.observe(model, now - since)
        return demand
