"""Laminar's repack in the runtime (issue #29; config `repack:`, config.RepackSettings; off by default).

A rollout rank held by a few long sequences runs engine steps that decode for few rows while new work could fill
them. With repack on, the last `tail_ranks` rollout ranks are tail ranks: rank 0 issues them no work
(RepackSettings.issuing). Every other rollout rank, after each engine step, asks its `Repacker` whether it is
held by a tail: no work waits, fewer than `busy_below` of its sequence slots run, and every running request has
sampled more tokens than the `past_quantile` of its task's completion lengths seen on the rank. Then it hands
every group with a running request over (`RolloutRank._hand_over`): the engine aborts the group's requests and
returns their continuations (partial tokens, their logprobs, the pinned version: rollout/base.py `abort`), the
rank sends one `RepackGroup` (the group's finished completions and the continuations) to the next tail rank, and
tells rank 0 the group left its engine (`Generated`), which frees its slot for new groups. The decision is the
rank's own: it alone knows its requests' lengths (a departure from the issue's wording, where rank 0 decides).

The tail rank (`RolloutRank._take_repacked`) continues each continuation in its engine under the same version
(prompt + partial prefilled) and, once the group's G completions are done, sends the group's turn to its env rank
as the source would have, without a second `Generated`. Every version a group can still be trained from is held
there: a tail rank keeps the newest `keep` versions of every task pinned in its engine (`TailVersions`; keep =
the job's largest max_staleness + 1), and a group sampled with an older one is past its bound for good (the
trainer's version is at least the newest published, so it would be dropped at the bound anyway). Such a group is
sent on with its completions as cut (tokens and logprobs of its own version, never another), and rank 0 drops it.
So nothing is sampled across versions and nothing is trained twice: each group's turn reaches its env rank once,
from the one rank that holds it, and the staleness rule and audit are rank 0's, unchanged.

Scope: single-turn training groups only (multi-turn and eval groups are never handed over), the hf engine (the
one that can cut a request mid-way: HfEngine.step_tokens), the broadcast delta plane, one base model.
"""
from __future__ import annotations

import itertools
from collections import defaultdict, deque
from dataclasses import dataclass, field



LENGTHS_KEPT = 512
"""Finished completion lengths a rank keeps per task for its quantile (the newest)."""


class Repacker:
    """A regular rollout rank's side: the lengths its tasks' completions reach, and when it is held by a tail.

    Args:
        settings: the job's RepackSettings.
        slots: the rank's sequence slots (rollout_slots x the tasks' largest group size).
        tails: the tail ranks, handed groups in turn.
    """

    def __init__(self, settings, slots: int, tails: tuple[int, ...]):
        if not tails:
            raise ValueError("repack needs at least one tail rank")
        self.settings, self.slots = settings, slots
        self._tails = itertools.cycle(tails)
        self.lengths: dict[str, deque] = defaultdict(lambda: deque(maxlen=LENGTHS_KEPT))
        self.handed = 0
        """Groups handed over so far."""

    def record(self, task_id: str, tokens: int) -> None:
        """A finished single-turn completion of `task_id`, `tokens` long."""
        self.lengths[task_id].append(tokens)

    def quantile(self, task_id: str) -> float | None:
        """The `past_quantile` of the task's finished lengths; None before `min_lengths` of them."""
        seen = sorted(self.lengths.get(task_id, ()))
        if len(seen) < self.settings.min_lengths:
            return None
        return seen[min(len(seen) - 1, int(self.settings.past_quantile * len(seen)))]

    def held_by_tail(self, running: dict[str, tuple[str, int]]) -> bool:
        """`running`: request id -> (task, tokens sampled), every request in the engine. True when they are
        fewer than `busy_below` of the slots and each is past its task's quantile."""
        if not running or len(running) >= self.settings.busy_below * self.slots:
            return False
        for task_id, tokens in running.values():
            limit = self.quantile(task_id)
            if limit is None or tokens <= limit:
                return False
        return True

    def next_tail(self) -> int:
        self.handed += 1
        return next(self._tails)


@dataclass
class TailVersions:
    """A tail rank's side: the newest `keep` versions of every task stay pinned in its engine, so that a group
    handed over finds its version (retention's rule, runtime/retention.py, for engines: a version is kept while
    something may still need it)."""

    keep: int
    pinned: dict[str, deque] = field(default_factory=dict)

    def installed(self, engine, task_id: str, version: int) -> None:
        """After `engine.add_adapter` of (task, version): pin it, release the one that falls out of the window."""
        window = self.pinned.setdefault(task_id, deque())
        engine.pin(task_id, version)
        window.append(version)
        while len(window) > self.keep:
            engine.unpin(task_id, window.popleft())

    def holds(self, engine, task_id: str, version: int) -> bool:
        return version in engine.versions.live(task_id)
