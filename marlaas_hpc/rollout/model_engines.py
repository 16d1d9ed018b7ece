"""A rollout rank of a job with several base models: its EngineSet (rollout/engine_set.py, one engine per model,
one awake) behind the one-engine interface the rank's loop drives (issue #28, item 2).

Each request goes to its task's model engine. A task's model comes with its work (GenerateWork.model) and its
adapter versions (DeltaAnnounce.model: a trainer group loads one model), and is set once per adapter key
(`assign`). Which model the rank serves is rank 0's decision, never the rank's own: rank 0's model pool
(scheduler/rank_models.py `RankModels`, the ModelPool policy of scheduler/multiplex.py) sends only the assigned
model's groups to a rank and tells it with `Serve`, which calls `follow(model)`. Until then the rank serves the
model whose engine is awake. Requests of the assigned model go into its engine at once; requests of another
model wait here (none should come but evals held back, and rank 0 sends those only to a rank serving their
model). The rank switches to the assigned model once its awake engine holds nothing (rank 0 assigns it only
once its groups there ended): that model's engine wakes (adapter versions published while it slept are installed
then) and its waiting requests go in. A switch never happens with a request in flight (its KV cache would be
lost), so a running sequence or an open group's turn never changes engine.

Versions. An engine retires a version once a newer one is installed and no request uses it, so a request that
waits here must not lose its version meanwhile. A model's new versions go into its engine at once only while it
is awake with nothing waiting; otherwise they wait here too (`deferred`, every version in order, not EngineSet's
queue, which keeps only the newest), and the model's turn interleaves them with its requests: first the requests
on versions its engine holds, then each waiting version followed by the requests on it (a version no request
and no pin needs, superseded by a newer one waiting, is skipped and retired unread). Pins of a model that is not
being served apply in that same order (a pin right after its version, unpins at the end).

`switches` keeps each switch's measured cost; the rank's timeline notes each one and rank 0 gets it with
`Served` (runtime/rollout_rank.py).
"""
from __future__ import annotations

from marlaas_hpc.rollout.base import AdapterRef, Generation, GenerationRequest, RolloutEngine
from marlaas_hpc.rollout.engine_set import EngineSet, SwitchCost


class ModelEngines(RolloutEngine):
    def __init__(self, engines: EngineSet):
        self.engines = engines
        self.model_of: dict[str, str] = {}
        """Adapter key -> its task's base model (`assign`)."""
        self.pending: dict[str, list[GenerationRequest]] = {model: [] for model in engines.models}
        """Per model: requests waiting for its engine (asleep, or draining for a model that waits)."""
        self.pins: dict[str, list[tuple[str, str, int]]] = {model: [] for model in engines.models}
        """Per model not being served: (pin | unpin, adapter key, version) to apply on its turn, in order."""
        self.deferred: dict[str, list[AdapterRef]] = {model: [] for model in engines.models}
        """Per model not being served: adapter versions to install on its turn, in arrival order."""
        self.retired: list[AdapterRef] = []
        """Deferred versions skipped unread (superseded before their turn, unused)."""
        self.switched: list[SwitchCost] = []
        """Switches not yet taken by `pop_switches` (the rank's timeline)."""
        self.assigned: str = engines.awake
        """The model rank 0 assigned this rank (`follow`); until then the one awake."""

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
            if model == self.assigned and self._served(model):
                now.append(request)
            else:
                self.pending[model].append(request)
        if now:
            self.engines.engine(awake).submit(now)

    def step(self) -> list[Generation]:
        self._follow()
        awake = self.awake
        if awake is None or not self.engines.engine(awake).has_unfinished():
            return []
        return self.engines.engine(awake).step()

    def has_unfinished(self) -> bool:
        awake = self.awake
        busy = awake is not None and self.engines.engine(awake).has_unfinished()
        model = self.assigned  # a switch to make, or the assigned model's work waiting
        return busy or model != awake or bool(self.pending[model] or self.deferred[model] or self.pins[model])

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

    # ---- rank 0's assignment ----
    def _follow(self) -> None:
        """Rank 0's assignment: switch to it once the awake engine is idle, then its waiting work goes in."""
        model, awake = self.assigned, self.awake
        if model != awake:
            if awake is not None and self.engines.engine(awake).has_unfinished():
                return
            self.switched.append(self.engines.switch(model))
        if self.pending[model] or self.deferred[model] or self.pins[model]:
            self._serve(model)

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
