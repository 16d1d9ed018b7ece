"""Laminar's repack in the simulator (issue #29, item 2): a rollout rank held by a few long sequences hands them to
a designated tail rank and refills with fresh groups.

    a rank's engine, after sequences finish:  under `share` of its slots running, nothing queued, and every
    running sequence single-turn, not an eval, and past its kind's p90 length
        -> its running sequences move to the least-loaded tail rank, which re-prefills each (prompt + what it has
           generated) and decodes the rest under the same pinned version (a group never changes version)
        -> the rank reports each moved group's turn done (`Generated`, as a multi-turn group's tool call does),
           so the scheduler fills its slots again; the tail rank scores the group when its last sequence ends.

The tail ranks are the setup's last `tail_ranks` rollout ranks, taken out of the scheduler's rollout ranks
(`with_tail_ranks`): the same GPUs, some of them set aside. Nothing is trained twice and no group is split: a
group's every sequence still in the engine moves with it. Only the simulator repacks; the runtime does not yet.
"""
from __future__ import annotations

import dataclasses
import heapq
import math
import random

from marlaas_hpc.scheduler import Scheduler
from marlaas_hpc.sim.engine import Sequence, Simulation
from studies.tails import OccupancyRolloutSim

Z90 = 1.2815515655446004
"""The standard normal's 0.9 quantile (a log-normal's p90 is median * exp(Z90 * sigma))."""


def p90_tokens(distribution, cap: float) -> float:
    """The 0.9 quantile of a response-length distribution, clipped at the task's max_new_tokens."""
    if distribution.dist == "lognormal":
        value = distribution.median * math.exp(Z90 * distribution.sigma)
    else:  # by sampling with a fixed seed: the quantile is a property of the workload, not of the run
        rng = random.Random(0)
        draws = sorted(distribution.sample(rng) for _ in range(2000))
        value = draws[int(0.9 * len(draws))]
    return min(value, cap)


class RepackingRolloutSim(OccupancyRolloutSim):
    """A continuous-batching rollout rank that repacks its long tail (a regular rank) or takes others' tails (a
    tail rank: `tail` set by `with_tail_ranks`)."""

    def __init__(self, sim: Simulation, rank: int):
        super().__init__(sim, rank)
        self.tail = False
        self.share = 0.25
        """Repack when fewer than share * max_running_sequences run (set by `with_tail_ranks`)."""
        self.started: dict[Sequence, float] = {}
        """Running sequence -> the token counter when it entered (what it has generated is the difference)."""
        self.adopted: set[int] = set()
        """Tail rank: ids of the groups it took over (their turns end here without a second Generated)."""
        self.backlog: list[tuple[Sequence, float]] = []
        """Tail rank: (sequence, tokens left) waiting for room."""
        self.repacked_sequences = 0
        self.check_token = None
        """The pending look at the tail (a newer one supersedes it)."""
        self.p90: dict[tuple, float] = {}
        """(profile, max_new_tokens) -> its p90 completion length."""

    def _enter(self, sequence: Sequence) -> None:
        running = len(self.running)
        super()._enter(sequence)
        if len(self.running) > running:
            self.started[sequence] = self.tokens

    def _wake(self, token) -> None:
        super()._wake(token)
        if self.tail:
            self._admit_backlog()
        else:
            self._check()

    def _check(self, token=None) -> None:
        """Repacks if the tail holds this rank now; if only the p90 is missing, looks again when the youngest
        running sequence passes it (the engine checks every step; completions alone may not come)."""
        if token is not None:
            if token is not self.check_token:
                return  # superseded
            self._advance()
        passes_at = self._tail_passes_at()
        if passes_at is None:
            return
        if passes_at <= self.tokens + 1e-9:
            self._repack()
            return
        now = self.sim.queue.now
        per_step = self._step_time(len(self.running)) + self.model.step_overhead
        self.check_token = object()
        self.sim.queue.at(max(now, self.stall_until) + (passes_at - self.tokens) * per_step, self._check,
                          self.check_token)

    def _tail_passes_at(self) -> float | None:
        """The token count at which every running sequence has generated more tokens than its p90 (a whole
        number of steps), if only that keeps the rank from repacking (few running, nothing queued, all
        single-turn training sequences); else None."""
        running = self.running
        if not running or self.queue or len(running) >= self.share * self.model.max_running_sequences:
            return None
        passes_at = 0.0
        for _, _, sequence in running:
            group = sequence.group
            if group.eval or group.profile.turns != 1:
                return None
            passes_at = max(passes_at, self.started.get(sequence, self.tokens) + math.floor(self._p90(group)) + 1)
        return passes_at

    def _p90(self, group) -> float:
        key = (id(group.profile), group.max_tokens)
        if key not in self.p90:
            self.p90[key] = p90_tokens(group.profile.response_tokens, group.max_tokens)
        return self.p90[key]

    def _repack(self) -> None:
        tail = min((r for r in self.sim.rollout.values() if r.tail), key=lambda r: len(r.running) + len(r.backlog))
        moved = [(sequence, need - self.tokens, self.tokens - self.started.pop(sequence, self.tokens))
                 for need, _, sequence in self.running]
        self.running = []
        groups = {id(sequence.group): sequence.group for sequence, _, _ in moved}
        for group in groups.values():
            group.in_engine = 0
            self.sim.group_left_engine(self.rank, group)  # its slot here is free: the scheduler refills it
        self.repacked_sequences += len(moved)
        tail.adopt(moved)

    def _turn_done(self, sequence: Sequence) -> None:
        self.started.pop(sequence, None)
        group = sequence.group
        if id(group) not in self.adopted:
            super()._turn_done(sequence)
            return
        group.in_engine -= 1  # its turn was reported done by the rank it came from
        group.sequences_left -= 1
        if group.sequences_left == 0:
            self.adopted.discard(id(group))
            self.sim.group_generated(self.rank, group)

    # ---- tail rank ----
    def adopt(self, moved: list[tuple[Sequence, float, float]]) -> None:
        """Takes (sequence, tokens left, tokens generated) from a rank: each waits for room, then re-prefills its
        context (prompt + generated so far) and decodes the rest here."""
        for sequence, _, _ in moved:
            self.adopted.add(id(sequence.group))
            sequence.group.in_engine += 1
        self.backlog += moved
        self._admit_backlog()

    def _admit_backlog(self) -> None:
        room = self.model.max_running_sequences - len(self.running)
        if room <= 0 or not self.backlog:
            return
        entering, self.backlog = self.backlog[:room], self.backlog[room:]
        self._advance()
        self._prefill(sum(sequence.group.profile.prompt_tokens.expected() + generated
                          for sequence, _, generated in entering))
        for sequence, left, _ in entering:
            sequence.need = self.tokens + max(left, 0.0)
            heapq.heappush(self.running, (sequence.need, next(self._seq), sequence))
        self._schedule()


def with_tail_ranks(sim: Simulation, tail_ranks: int, share: float = 0.25) -> Simulation:
    """Sets the last `tail_ranks` rollout ranks of a not yet run simulation (built with RepackingRolloutSim) aside
    as tail ranks: the scheduler issues only to the others, which repack under `share` of their slots running."""
    ranks = sorted(sim.rollout)
    if not 1 <= tail_ranks < len(ranks):
        raise ValueError(f"tail_ranks must be in 1..{len(ranks) - 1}, got {tail_ranks}")
    if not 0 < share <= 1:
        raise ValueError(f"share must be in (0, 1], got {share}")
    for rank in ranks:
        sim.rollout[rank].share = share
    for rank in ranks[-tail_ranks:]:
        sim.rollout[rank].tail = True
    config = dataclasses.replace(sim.setup.scheduler_config(), rollout_ranks=tuple(ranks[:-tail_ranks]))
    sim.scheduler = Scheduler(config.validate(), clock=lambda: sim.queue.now)
    return sim
