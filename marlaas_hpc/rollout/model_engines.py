"""A rollout rank of a job with several base models: its EngineSet (rollout/engine_set.py, one engine per model,
one awake) behind the one-engine interface the rank's loop drives (issue #28, item 2).

Each request goes to its task's model engine. A task's model comes with its work (GenerateWork.model) and its
adapter versions (DeltaAnnounce.model: a trainer group loads one model), and is set once per adapter key
(`assign`). Requests of the awake model go into its engine at once; requests of a sleeping model wait here. The
rank switches when its awake engine has nothing in flight and another model has requests waiting: that model's
engine wakes (adapter versions published while it slept are installed then) and its waiting requests go in.
While another model waits, new requests of the awake model still go in during its dwell, DWELL_SWITCHES times
the last measured switch cost since it woke (affinity: a switch must buy more engine time than it costs, as the
model pool's dwell, scheduler/multiplex.py); after that they wait too, so its engine drains and the waiting
model gets its turn: the models take turns, first come first served. A switch never happens
with a request in flight (its KV cache would be lost), so a running sequence or an open group's turn never
changes engine; an episode's later turns wait while another model is awake, as they wait on a tool.

Versions. An engine retires a version once a newer one is installed and no request uses it, so a request that
waits here must not lose its version meanwhile. A model's new versions go into its engine at once only while it
is awake with nothing waiting; otherwise they wait here too (`deferred`, every version in order, not EngineSet's
queue, which keeps only the newest), and the model's turn interleaves them with its requests: first the requests
on versions its engine holds, then each waiting version followed by the requests on it (a version no request
and no pin needs, superseded by a newer one waiting, is skipped and retired unread). Pins of a model that is not
being served apply in that same order (a pin right after its version, unpins at the end).

Following rank 0 (`follow`). In a job run by mpirun/srun, rank 0's model pool (scheduler/rank_models.py) decides
which model each rollout rank serves and sends only that model's groups to it; `follow(model)` hands the
decision to it for good: requests of other models wait (none should come but evals held back, and those rank 0
sends only to a rank serving their model), the rank switches to the assigned model as soon as its awake engine
holds nothing (rank 0 assigns it only once its groups there ended), and no dwell applies (rank 0's pool has
its own, ten measured switch costs). The turns above are what a rank does when nobody assigns it (a driver
without rank 0; a rank that joins a running job is assigned like the others, from its first group). `switches` keeps each switch's measured cost; the rank's timeline notes
each one and rank 0 gets it with `Served` (runtime/rollout_rank.py).
"""
from __future__ import annotations

import time
from typing import Callable

from marlaas_hpc.rollout.base import AdapterRef, Generation, GenerationRequest, RolloutEngine
from marlaas_hpc.rollout.engine_set import EngineSet, SwitchCost


DWELL_SWITCHES = 10
"""A model keeps taking new requests for this many times the last switch cost after it woke, others waiting."""


class ModelEngines(RolloutEngine):
    def __init__(self, engines: EngineSet, dwell_s: float | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.engines = engines
        self.dwell_s = dwell_s
        """How long the awake model keeps taking new requests while others wait; None: DWELL_SWITCHES x the
        last measured switch cost."""
        self.clock = clock
        self.woke_at = clock()
        """When the awake model's turn began."""
        self.model_of: dict[str, str] = {}
        """Adapter key -> its task's base model (`assign`)."""
        self.pending: dict[str, list[GenerationRequest]] = {model: [] for model in engines.models}
        """Per model: requests waiting for its engine (asleep, or draining for a model that waits)."""
        self.turns: list[str] = []
        """Models with requests waiting, in the order they started waiting (who wakes next)."""
        self.pins: dict[str, list[tuple[str, str, int]]] = {model: [] for model in engines.models}
        """Per model not being served: (pin | unpin, adapter key, version) to apply on its turn, in order."""
        self.deferred: dict[str, list[AdapterRef]] = {model: [] for model in engines.models}
        """Per model not being served: adapter versions to install on its turn, in arrival order."""
        self.retired: list[AdapterRef] = []
        """Deferred versions skipped unread (superseded before their turn, unused)."""
        self.switched: list[SwitchCost] = []
        """Switches not yet taken by `pop_switches` (the rank's timeline)."""
        self.assigned: str | None = None
        """The model rank 0 assigned this rank (`follow`); None: the rank decides by its waiting work."""

    @property
    def models(self) -> list[str]:
        return self.engines.models

    @property
    def awake(self) -> str | None:
        return self.engines.awake

    @property
    def switches(self) -> list[SwitchCost]:
        return self.engines.switches

    def follow(self, model: str) -> None:
        """Rank 0 assigns the rank `model`: from now on only its requests go in; the switch to it happens at the
        next step once the awake engine holds nothing (KeyError if this rank has no engine of it)."""
        if model not in self.pending:
            raise KeyError(f"model {model!r} has no engine on this rank (models: {self.models})")
        self.assigned = model

    def assign(self, adapter_key: str, model: str) -> None:
        """Names the model whose engine serves `adapter_key` (KeyError if this rank has no engine of it;
        ValueError if the key was assigned another model)."""
        if model not in self.pending:
            raise KeyError(f"model {model!r} has no engine on this rank (models: {self.models})")
        known = self.model_of.setdefault(adapter_key, model)
        if known != model:
            raise ValueError(f"adapter {adapter_key!r} belongs to model {known!r}, not {model!r}")

    def model(self, adapter_key: str) -> str:
        try:
            return self.model_of[adapter_key]
        except KeyError:
            raise KeyError(f"adapter {adapter_key!r} has no model assigned on this rank") from None

    # ---- the RolloutEngine interface ----
    def add_adapter(self, adapter: AdapterRef) -> None:
        model = self.model(adapter.task_id)
        if self._served(model):
            self.engines.engine(model).add_adapter(adapter)
        else:
            self.deferred[model].append(adapter)

    def _served(self, model: str) -> bool:
        """The model is awake and nothing of it waits: its versions, pins and requests go straight in."""
        return model == self.awake and not self.pending[model] and not self.deferred[model]

    def submit(self, requests: list[GenerationRequest]) -> None:
        now: list[GenerationRequest] = []
        awake = self.awake
        for request in requests:
            model = self.model(request.task_id)
            if self.assigned is not None:
                take = model == self.assigned and self._served(model)
            else:
                take = self._served(model) and (not self._others_wait(model) or self._dwelling())
            if take:
                now.append(request)
            else:
                self._wait(model, request)
        if now:
            self.engines.engine(awake).submit(now)

    def step(self) -> list[Generation]:
        self._turn()
        awake = self.awake
        if awake is None or not self.engines.engine(awake).has_unfinished():
            return []
        return self.engines.engine(awake).step()

    def has_unfinished(self) -> bool:
        awake = self.awake
        busy = awake is not None and self.engines.engine(awake).has_unfinished()
        model = self.assigned
        if model is not None:  # a switch to make, or the assigned model's work waiting
            return busy or model != awake or bool(self.pending[model] or self.deferred[model] or self.pins[model])
        return bool(self.turns) or busy

    def pin(self, task_id: str, version: int) -> None:
        self._pin_op(task_id, version, "pin")

    def unpin(self, task_id: str, version: int) -> None:
        self._pin_op(task_id, version, "unpin")

    def _pin_op(self, task_id: str, version: int, op: str) -> None:
        """A pin or unpin: at once on an awake engine; on a sleeping one when it wakes (the version may be one
        queued for its wake, not installed yet)."""
        model = self.model(task_id)
        if self._served(model):
            getattr(self.engines.engine(model), op)(task_id, version)
        else:
            self.pins[model].append((op, task_id, version))

    def pop_retired(self) -> list[AdapterRef]:
        out, self.retired = self.retired, []
        return out + self.engines.pop_retired()

    def pop_switches(self) -> list[SwitchCost]:
        out, self.switched = self.switched, []
        return out

    def close(self) -> None:
        self.engines.close()

    # ---- whose turn ----
    def _dwelling(self) -> bool:
        """The awake model is within its dwell (it keeps taking new requests while others wait)."""
        dwell = self.dwell_s
        if dwell is None:
            switches = self.engines.switches
            dwell = DWELL_SWITCHES * switches[-1].total_s if switches else 0.0
        return self.clock() - self.woke_at < dwell

    def _others_wait(self, model: str) -> bool:
        return any(other != model for other in self.turns)

    def _wait(self, model: str, request: GenerationRequest) -> None:
        self.pending[model].append(request)
        if model not in self.turns:
            self.turns.append(model)

    def _turn(self) -> None:
        """Once the awake engine is idle: the model that has waited longest wakes (a switch if it sleeps) and
        its waiting versions, pins and requests go in (`_serve`). Assigned by rank 0: `_follow`."""
        if self.assigned is not None:
            self._follow()
            return
        awake = self.awake
        if not self.turns or (awake is not None and self.engines.engine(awake).has_unfinished()):
            return
        model = self.turns.pop(0)
        if model != awake:
            self.switched.append(self.engines.switch(model))
            self.woke_at = self.clock()
        self._serve(model)

    def _follow(self) -> None:
        """Rank 0's assignment: switch to it once the awake engine is idle, then its waiting work goes in."""
        model, awake = self.assigned, self.awake
        if model != awake:
            if awake is not None and self.engines.engine(awake).has_unfinished():
                return
            self.switched.append(self.engines.switch(model))
            self.woke_at = self.clock()
        if self.pending[model] or self.deferred[model] or self.pins[model]:
            self._serve(model)
        if model in self.turns:
            self.turns.remove(model)

    def _serve(self, model: str) -> None:
        """The model's waiting work into its (awake) engine, in an order that keeps every request's version:
        requests on versions the engine holds, then each waiting version followed by its requests and pins;
        unpins last."""
        engine = self.engines.engine(model)
        requests, self.pending[model] = self.pending[model], []
        deferred, self.deferred[model] = self.deferred[model], []
        ops, self.pins[model] = self.pins[model], []
        coming = {(ref.task_id, ref.version) for ref in deferred}
        now = [r for r in requests if (r.task_id, r.adapter_version) not in coming]
        pins = [(task, version) for op, task, version in ops if op == "pin"]
        for task, version in pins:
            if (task, version) not in coming:
                engine.pin(task, version)
        if now:
            engine.submit(now)
        for i, ref in enumerate(deferred):
            key = (ref.task_id, ref.version)
            needed = key in pins or any((r.task_id, r.adapter_version) == key for r in requests)
            newer = any(later.task_id == ref.task_id for later in deferred[i + 1:])
            if newer and not needed:
                self.retired.append(ref)
                continue
            engine.add_adapter(ref)
            for _ in range(pins.count(key)):
                engine.pin(*key)
            batch = [r for r in requests if (r.task_id, r.adapter_version) == key]
            if batch:
                engine.submit(batch)
        for op, task, version in ops:
            if op == "unpin":
                engine.unpin(task, version)
