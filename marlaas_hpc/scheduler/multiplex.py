"""Several base models on one pool of rollout ranks: which model's engine is awake on each rank (issue #28).

Each rollout rank holds one engine per model; one is awake, the others sleep (vLLM sleep mode level 1: weights
in host memory, KV cache freed). The pool moves a rank from one model to another when the other model's
rollout work waits for an engine and this one's demand on the rank has ended:

    generating(A) ──(A over its share, B waiting, gain > switch cost)──► draining(A → B)
    draining(A → B) ──(A holds no group on the rank)──► waking(B) ──(switch cost elapsed)──► generating(B)
    generating(A) ──(A holds no group there and wants nothing, B waiting, gain > cost)──► waking(B)

- **Demand and shares.** Per model, the groups waiting for an engine (`Scheduler.pending_rollout`: quota that no
  open rank has room for) and the groups it holds on each rank (in the engine, or in a tool call between turns).
  A model needs the ranks those groups fill (`slots` each); the ranks are split max-min fairly over the needs,
  by weight (e.g. the GPUs each job would have had alone): a model gets its need or its weighted part, whichever
  is less, and what it does not need goes to the others. A model with demand gets at least one rank.
- **Affinity.** A rank is never taken from a model at or under its share, and a model's groups are never cut
  off: draining closes the rank to the model's new groups (`Scheduler.close_rollout_rank`) and lets the ones on
  it finish, multi-turn episodes included, so no KV cache of a running sequence is lost and no episode changes
  engine. A rank stays with the model it woke for at least `min_dwell_s`; when more models want ranks than
  there are, ranks rotate after that dwell (a model with waiting work and no rank is never starved).
- **Gain against cost.** A switch pays `switch_s` (sleep one engine, wake the other); it is worth it only if the
  engine time it serves for the waiting model, one round of the rank's slots at the model's observed time per
  group (`observe`), exceeds `gain_margin` x `switch_s` (the margin pays for switching back later).
- **Gaps inside episodes (`fill_gaps`).** A rank whose model has no sequence in its engine, only groups whose
  every sequence waits on a tool call (`ModelDemand.engine` 0 there), is idle although it holds groups. With
  `fill_gaps` it may switch at once, not waiting for those groups to end: (1) back to a sleeping model whose
  parked sequences came back from their tool calls on this rank (`ModelDemand.ready`: mid-episode, they can run
  nowhere else), else (2) to a model with waiting groups when the gain is worth the switch. The parked groups
  keep their rank; their engine sleeps with them, and each sequence's context is prefilled again when it
  continues (its KV cache was freed by the sleep: the driver charges that). A drain then also ends as soon as
  its model has nothing in the engine. Off, a rank changes model only once its model holds no group on it.
- **Ranks that come and go.** A rank lost (`lose`) or given back (`leave`: a scale-down; `release`: a model's
  job ended) leaves the split and is never a donor nor a target again. A rank that joins (`join`: a scale-up, a
  replacement) enters it under a new index, for the model with the most waiting groups (switching first if
  that is not the engine awake on it), and is then a rank like the others.

The pool only decides; its driver applies each `Switch` and closes / opens ranks on the schedulers: in the
simulator's study (tools/studies/multiplex.py) every model's tasks keep their own scheduler; on rank 0 of a job
of several models (scheduler/rank_models.py `RankModels`) one scheduler holds every task and each rank takes only
its model's tasks (`Scheduler.rank_models`), and the switch cost is the one the ranks measure (`measured`). Either
way the staleness rule and the audit are the schedulers', unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, field

GENERATING, DRAINING, WAKING, LOST, RELEASED = "generating", "draining", "waking", "lost", "released"
GONE = (LOST, RELEASED)


@dataclass(slots=True)
class RankState:
    """One rollout rank of the pool."""

    awake: str
    """The model whose engine is awake (or waking) on the rank; the others sleep."""
    phase: str = GENERATING
    """'generating' (serving `awake`), 'draining' (closed to `awake`'s new groups, for `to`), 'waking', 'lost'
    (the rank is gone: out of the split, never a donor), 'released' (given back when a model's job ended, or the
    job scaled down, `leave`: the same, and its GPU is no longer paid for)."""
    to: str | None = None
    """The model the rank is being handed to (draining)."""
    since: float = 0.0
    """When `awake` woke (or the pool started): the dwell time counts from here."""
    until: float = 0.0
    """Waking: when the engine is awake."""


@dataclass(slots=True)
class ModelDemand:
    """What a model wants from the pool now."""

    waiting: int = 0
    """Groups the model's scheduler would issue but no open rank has room for."""
    held: dict[int, int] = field(default_factory=dict)
    """Per pool rank: the model's groups on it (in the engine, or between turns in a tool call)."""
    engine: dict[int, int] | None = None
    """Per pool rank: of `held`, the groups with a sequence in the engine (running, queued, waiting for their
    adapter version, or on their way); the others wait on tool calls. None: not known, every held group counts
    as in the engine (no gap is seen)."""
    ready: dict[int, int] = field(default_factory=dict)
    """Per pool rank where the model sleeps: its parked groups with a sequence back from its tool call, waiting
    for the engine to wake."""

    def in_engine(self, rank: int) -> int:
        return (self.held if self.engine is None else self.engine).get(rank, 0)

    def total(self) -> int:
        return self.waiting + sum(self.held.values())


@dataclass(slots=True)
class Drain:
    """Close `rank` to `model`'s new groups (it will be handed to another model once they finish)."""

    rank: int
    model: str


@dataclass(slots=True)
class Reopen:
    """The drain of `rank` is called off: `model`'s scheduler may issue to it again."""

    rank: int
    model: str


@dataclass(slots=True)
class Switch:
    """Sleep `from_model`'s engine on `rank` and wake `to_model`'s; it serves `to_model` at `ready_at`."""

    rank: int
    from_model: str
    to_model: str
    ready_at: float


class ModelPool:
    """The rollout ranks' model states and the policy that moves them (pure: no clock, no I/O)."""

    def __init__(self, ranks: int, models: list[str], switch_s: float, slots: int, gain_margin: float = 2.0,
                 min_dwell_s: float | None = None, weights: dict[str, float] | None = None, fill_gaps: bool = False):
        if ranks < 1 or not models:
            raise ValueError("a model pool needs at least one rank and one model")
        self.models = list(models)
        self.weights = {model: 1.0 for model in self.models} | (weights or {})
        """Each model's weight in the fair split of the ranks (e.g. the GPUs its job would have had alone)."""
        self.switch_s = switch_s
        """Seconds from sleeping one engine to the other serving (sleep + wake + warm-up)."""
        self.slots = slots
        """Groups a rank generates at once (the schedulers' rollout_slots)."""
        self.gain_margin = gain_margin
        self.fill_gaps = fill_gaps
        """Switch a rank whose model's groups all wait on tool calls (see the module doc); off: only a rank whose
        model holds nothing on it switches."""
        self.min_dwell_s = 10 * switch_s if min_dwell_s is None else min_dwell_s
        """A rank serves the model it woke for at least this long while that model wants it (default: ten
        switches, so rotating ranks spends at most ~10% of their time switching)."""
        self._dwell_follows_cost = min_dwell_s is None
        self._measured: list[float] = []
        self.ranks = [RankState(awake=self.models[i % len(self.models)]) for i in range(ranks)]
        """Rank i starts awake for model i mod K: every model starts with ranks (it has tasks to start)."""
        self.group_s = {model: 0.0 for model in self.models}
        """Observed seconds a group of each model holds its rank (mean over its groups so far)."""
        self._observed = {model: 0 for model in self.models}
        self.switches = 0

    # ---- what the driver tells the pool ----
    def observe(self, model: str, seconds: float) -> None:
        """A group of `model` left its rank after holding it `seconds` (from its arrival to its last turn's end,
        tool calls included: the time the rank cannot be handed over because of it)."""
        self._observed[model] += 1
        self.group_s[model] += (seconds - self.group_s[model]) / self._observed[model]

    def measured(self, seconds: float) -> None:
        """A switch a rank measured (the runtime: rank 0's driver, scheduler/rank_models.py): the switch cost
        becomes the mean of those measured so far, and a default dwell follows it (ten switches)."""
        self._measured.append(seconds)
        self.switch_s = sum(self._measured) / len(self._measured)
        if self._dwell_follows_cost:
            self.min_dwell_s = 10 * self.switch_s

    def lose(self, rank: int) -> None:
        """The rank is gone (the runtime lost it): it leaves the split and is never handed to a model again."""
        self.ranks[rank].phase, self.ranks[rank].to = LOST, None

    def leave(self, rank: int) -> None:
        """The rank is given back (the job scaled down: it drains, then leaves): it leaves the split at once, as a
        lost rank, phase 'released'; the groups it holds finish there (its driver closed it to new ones)."""
        if self.ranks[rank].phase not in GONE:
            self.ranks[rank].phase, self.ranks[rank].to = RELEASED, None

    def join(self, now: float, demand: dict[str, ModelDemand], awake: str | None = None) -> int:
        """A rank joins the pool (the job scaled up, or a replacement for a lost rank): it enters the split under a
        new pool index (a gone rank's index is never reused), for the model with the most unmet demand now
        (`ModelDemand.waiting`: groups no open rank has room for), else for `awake`, else the first model.
        `awake`: the model whose engine is awake on the joiner as it comes up (a joiner builds every engine and
        wakes the first, runtime/main.py `model_engines`); it serves at once if that is the model chosen, else
        it switches first ('waking', `switch_s`, a switch). From then on it is a donor and a target like any
        other rank. Returns its pool index."""
        order = {model: i for i, model in enumerate(self.models)}
        model = max(self.models, key=lambda m: (demand[m].waiting if m in demand else 0, m == awake, -order[m]))
        state = RankState(awake=model, since=now)
        if awake is not None and awake != model:
            state.phase, state.until = WAKING, now + self.switch_s
            self.switches += 1
        self.ranks.append(state)
        return len(self.ranks) - 1

    def release(self, model: str, pinned: set[int] = frozenset()) -> list[int]:
        """`model`'s job ended: the pool keeps the ranks the remaining models would have had alone (their
        weights, at least one) and releases the others among the ranks awake for `model` (it holds nothing
        there any more), which leave the split; a `pinned` rank (it hosts something still running, e.g. a
        trainer on a shared GPU) is never released. Returns the released ranks."""
        self.weights[model] = 0.0
        remaining = [m for m in self.models if self.weights[m] > 0]
        live = [i for i, s in enumerate(self.ranks) if s.phase not in GONE]
        if not remaining:
            return []
        keep = max(1, round(sum(self.weights[m] for m in remaining)))
        idle = [i for i in live if self.ranks[i].awake == model and self.ranks[i].phase == GENERATING
                and i not in pinned]
        released = idle[:max(0, len(live) - keep)]
        for rank in released:
            self.ranks[rank].phase, self.ranks[rank].to = RELEASED, None
        return released

    def woken(self, rank: int, now: float) -> None:
        """The rank's switch is done: its awake model serves."""
        state = self.ranks[rank]
        state.phase, state.since = GENERATING, now

    def serving(self, model: str) -> list[int]:
        """Ranks open to `model`'s new groups (generating for it)."""
        return [i for i, s in enumerate(self.ranks) if s.awake == model and s.phase == GENERATING]

    # ---- the policy ----
    def plan(self, now: float, demand: dict[str, ModelDemand]) -> list:
        """Commands for the ranks given every model's demand now: finished drains switch, drains nobody wants
        any more are called off, and ranks of models over their share start draining toward models short of
        theirs (or switch at once when their model holds nothing on them)."""
        out: list = []
        for rank, state in enumerate(self.ranks):
            if state.phase == DRAINING:
                out += self._settle_drain(rank, state, now, demand)
        if self.fill_gaps:
            out += self._fill_gaps(now, demand)
        shares = self._shares(demand)
        counts = self._counts()
        for model in sorted(self.models, key=lambda m: -demand[m].waiting):
            want = demand[model].waiting
            while want > 0 and counts[model] < shares[model] and self._worth(model, want, counts[model]):
                rank = self._donor(model, shares, counts, demand, now)
                if rank is None:
                    break
                command = self._take(rank, model, now, demand)
                out.append(command)
                counts[model] += 1
                counts[command.from_model if isinstance(command, Switch) else command.model] -= 1
                want -= self.slots
        return out

    def _fill_gaps(self, now: float, demand: dict[str, ModelDemand]) -> list:
        """Ranks whose awake model has nothing in the engine (its groups there, if any, wait on tools) switch to
        a model whose parked sequences are back on the rank, else to one with waiting groups worth a switch."""
        out: list = []
        counts = self._counts()
        for rank, state in enumerate(self.ranks):
            if state.phase != GENERATING or demand[state.awake].in_engine(rank):
                continue
            back = [m for m in self.models if m != state.awake and demand[m].ready.get(rank, 0)]
            if not back and not demand[state.awake].held.get(rank):
                continue  # an idle rank with nobody parked on it: the shares below decide, as without gaps
            waiting = [m for m in self.models if m != state.awake and demand[m].waiting
                       and self._worth(m, demand[m].waiting, counts[m])]
            target = (back or sorted(waiting, key=lambda m: -demand[m].waiting) or [None])[0]
            if target is None:
                continue
            counts[state.awake] -= 1
            counts[target] += 1
            out.append(self._switch(rank, state, target, now))
        return out

    def _idle_for(self, model: str, rank: int, demand: dict[str, ModelDemand]) -> bool:
        """Whether `model`'s engine on `rank` may sleep now: it holds nothing there (with `fill_gaps`: nothing in
        the engine, its groups there wait on tools)."""
        if self.fill_gaps:
            return demand[model].in_engine(rank) == 0
        return demand[model].held.get(rank, 0) == 0

    def _settle_drain(self, rank: int, state: RankState, now: float, demand: dict[str, ModelDemand]) -> list:
        if self._idle_for(state.awake, rank, demand):
            return [self._switch(rank, state, state.to, now)]
        if demand[state.to].waiting == 0:  # the model it was drained for wants nothing now: keep serving
            state.phase, state.to = GENERATING, None
            return [Reopen(rank, state.awake)]
        return []

    def _shares(self, demand: dict[str, ModelDemand]) -> dict[str, int]:
        """Ranks per model: a weighted max-min fair split of the ranks over the models' needs (a model needs the
        ranks its waiting and held groups fill, `slots` a rank); what a model does not need goes to the others.
        Rounded down, at least one for any demand, so a model keeps a rank it holds until it is clearly over."""
        need = {m: -(-demand[m].total() // self.slots) for m in self.models}
        live = sum(1 for state in self.ranks if state.phase not in GONE)
        if not any(need.values()):
            return {model: live for model in self.models}  # nobody wants anything: nobody moves
        share = {m: 0.0 for m in self.models}
        left, active = float(live), {m for m in self.models if need[m]}
        while active and left > 1e-9:
            weight = sum(self.weights[m] for m in active)
            sated = {m for m in active if need[m] - share[m] <= left * self.weights[m] / weight}
            if not sated:
                for m in active:
                    share[m] += left * self.weights[m] / weight
                break
            for m in sated:
                left -= need[m] - share[m]
                share[m] = float(need[m])
            active -= sated
        return {m: max(1 if need[m] else 0, int(share[m] + 1e-9)) for m in self.models}

    def _over_share(self, model: str, shares: dict[str, int], counts: dict[str, int], state: RankState,
                    now: float) -> bool:
        """Whether a rank of `model` may be taken: its model holds more than its share, or (more models want
        ranks than there are) it has served its turn, `min_dwell_s`: the ranks then rotate, one turn each."""
        if counts[model] > shares[model]:
            return True
        live = sum(1 for s in self.ranks if s.phase not in GONE)
        return sum(1 for m in self.models if shares[m]) > live and now - state.since >= self.min_dwell_s

    def _counts(self) -> dict[str, int]:
        """Ranks per model, a draining rank counted for the model it goes to."""
        counts = {model: 0 for model in self.models}
        for state in self.ranks:
            if state.phase not in GONE:
                counts[state.to if state.phase == DRAINING else state.awake] += 1
        return counts

    def _worth(self, model: str, waiting: int, ranks: int) -> bool:
        """Whether serving `model`'s waiting groups on one more rank beats paying for the switch: one round of
        the rank's slots at the model's time per group. A model with no rank at all has nothing else to serve
        it, and one not observed yet has no estimate: their switch is taken."""
        if ranks == 0 or self._observed[model] == 0:
            return True
        gain = min(waiting, self.slots) / self.slots * self.group_s[model]
        return gain > self.gain_margin * self.switch_s

    def _donor(self, model: str, shares: dict[str, int], counts: dict[str, int], demand: dict[str, ModelDemand],
               now: float) -> int | None:
        """The rank to hand to `model`: generating for a model over its share, past its dwell time; the one
        whose model holds the fewest groups on it (an idle rank switches at once)."""
        best = None
        for rank, state in enumerate(self.ranks):
            if state.phase != GENERATING or state.awake == model:
                continue
            if not self._over_share(state.awake, shares, counts, state, now):
                continue
            if now - state.since < self.min_dwell_s and demand[state.awake].total():
                continue
            held = demand[state.awake].held.get(rank, 0)
            if best is None or held < best[0]:
                best = (held, rank)
        return None if best is None else best[1]

    def _take(self, rank: int, model: str, now: float, demand: dict[str, ModelDemand]):
        state = self.ranks[rank]
        if self._idle_for(state.awake, rank, demand):
            return self._switch(rank, state, model, now)
        state.phase, state.to = DRAINING, model
        return Drain(rank, state.awake)

    def _switch(self, rank: int, state: RankState, model: str, now: float) -> Switch:
        switch = Switch(rank, state.awake, model, now + self.switch_s)
        state.awake, state.phase, state.to, state.until = model, WAKING, None, switch.ready_at
        self.switches += 1
        return switch
