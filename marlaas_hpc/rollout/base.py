"""Rollout engine interface: one base model, many (task, version) adapters, mixed-adapter batches.

Every sampled token comes back with its behaviour logprob (at the request's temperature) and the adapter
version that produced it. A request stays pinned to the adapter version it was submitted with, even if a
newer version of its task is registered while it runs. A multi-turn episode pins its version between turns
too (`pin` / `unpin`): while an env step runs, no request of the episode is in flight, and without the pin
a superseded version would be retired before the episode's next turn.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class AdapterRef:
    """A task's adapter at one policy version: a PEFT directory at `path`, or its tensors in memory (`tensors`
    + `lora`, as the trainer broadcasts them: rollout ranks never write a directory)."""

    task_id: str
    version: int
    path: str | None = None
    """PEFT adapter directory (adapter_config.json + adapter_model.safetensors); None for an in-memory adapter."""
    tensors: dict[str, Any] | None = field(default=None, compare=False, repr=False)
    """PEFT-named LoRA tensors (`base_model.model.model.layers.{i}....lora_{A|B}.weight`); None: read `path`."""
    lora: Any = field(default=None, compare=False)
    """The adapter's LoraSpec (rank, alpha, targets); required with `tensors`."""

    def __post_init__(self):
        if (self.path is None) == (self.tensors is None):
            raise ValueError(f"adapter {self.task_id} v{self.version}: give exactly one of a path or tensors")
        if self.tensors is not None and self.lora is None:
            raise ValueError(f"adapter {self.task_id} v{self.version}: in-memory tensors need their LoraSpec")

    @property
    def in_memory(self) -> bool:
        return self.tensors is not None


@dataclass
class GenerationRequest:
    request_id: str
    """Unique across the engine's lifetime."""
    task_id: str
    """Task whose adapter samples this request."""
    adapter_version: int | None
    """Policy version to sample with; it must have been registered. None = base model (no adapter)."""
    prompt_ids: list[int]
    """Prompt token ids (tokenised once, by TextCodec)."""
    temperature: float = 1.0
    """Sampling temperature (0 = greedy); behaviour logprobs are of softmax(logits / temperature)."""
    max_new_tokens: int = 16
    """Completion length cap."""
    seed: int | None = None
    """Per-request sampling seed (None: engine's generator)."""
    ignore_stop: bool = False
    """Sample exactly max_new_tokens tokens: a stop token is sampled like any other and does not end the request
    (vLLM's ignore_eos; a kind that sets its completions' lengths, tasks/synthetic.py `long_tail`)."""
    partial_ids: list[int] = field(default_factory=list)
    """A continuation (issue #29's repack): completion tokens already sampled under `adapter_version`, by this
    engine or another (`RolloutEngine.abort`). The engine prefills prompt + these and samples the rest, up to
    max_new_tokens in all; the Generation's completion starts with them."""
    partial_logprobs: list[float] = field(default_factory=list)
    """The behaviour logprobs of `partial_ids`, as sampled: returned as they are, first in the Generation's."""
    return_routes: bool = False
    """Routing replay (`algo.routing_replay`): return the experts chosen for every position fed (Generation
    `routes`). A continuation's come from the step that finishes it (its prefill routes prompt + partial again)."""

    @property
    def remaining_tokens(self) -> int:
        return self.max_new_tokens - len(self.partial_ids)


@dataclass
class Generation:
    request_id: str
    task_id: str
    adapter_version: int | None
    """The version that actually produced every token (== the request's)."""
    prompt_ids: list[int]
    completion_ids: list[int]
    """Sampled tokens, including the final eos if one was sampled."""
    logprobs: list[float]
    """Behaviour logprob of each completion token, one per id."""
    finish_reason: str = "stop"
    """'stop' (eos) or 'length'."""
    meta: dict = field(default_factory=dict)
    routes: Any = None
    """With `return_routes`: the chosen experts of every position fed (prompt, partial, sampled tokens but the
    last), an int16 numpy array [positions, MoE layers, top k] (rollout/routes.py); else None."""


@dataclass
class DecodeOccupancy:
    """How full an engine's decode steps ran (issue #29: what long tails cost). A decode step is one token for
    every row still running; `running` counts the steps by how many rows they ran."""

    running: dict[int, int] = field(default_factory=dict)
    """Rows still running in a decode step -> decode steps that ran that many."""
    row_steps: int = 0
    """Rows x decode steps of the batches (what a batch that keeps its finished rows computes)."""

    def add_batch(self, lengths: list[int]) -> None:
        """One batch that started `len(lengths)` rows together and decoded until the longest ended."""
        steps = max(lengths, default=0)
        for s in range(steps):
            rows = sum(1 for n in lengths if n > s)
            self.running[rows] = self.running.get(rows, 0) + 1
        self.row_steps += len(lengths) * steps

    def sparse_steps(self, slots: int) -> int:
        """Decode steps that ran under a quarter of `slots` sequences (the rank's sequence slots)."""
        return sum(steps for rows, steps in self.running.items() if 4 * rows < slots)

    def as_dict(self) -> dict:
        return {"running": {str(rows): steps for rows, steps in sorted(self.running.items())},
                "decode_steps": sum(self.running.values()), "row_steps": self.row_steps,
                "token_steps": sum(rows * steps for rows, steps in self.running.items())}


class RolloutEngine(ABC):
    """Continuous-batching interface: submit requests, step until they finish. `generate` = both."""

    @abstractmethod
    def add_adapter(self, adapter: AdapterRef) -> None:
        """Registers a task's new version (from its PEFT directory, or from its tensors in memory). Older
        versions stay usable by requests already submitted on them and are dropped once superseded and unused."""

    @abstractmethod
    def submit(self, requests: list[GenerationRequest]) -> None:
        """Queues requests; raises KeyError if a request names an adapter version that was never registered
        or has been dropped."""

    @abstractmethod
    def step(self) -> list[Generation]:
        """Advances generation; returns the requests that finished during this step."""

    @abstractmethod
    def has_unfinished(self) -> bool:
        """True while any submitted request has not been returned by `step`."""

    def generate(self, requests: list[GenerationRequest]) -> list[Generation]:
        """Blocking convenience: submit, step until done, return results in request order."""
        self.submit(requests)
        done: dict[str, Generation] = {}
        wanted = {r.request_id for r in requests}
        while not wanted.issubset(done):
            for gen in self.step():
                done[gen.request_id] = gen
        return [done[r.request_id] for r in requests]

    def pin(self, task_id: str, version: int) -> None:
        """Keeps (task, version) live until `unpin`, even once superseded and unused by requests (an episode
        between turns). Pins are counted; raises KeyError if the version is not live."""
        self.versions.pin(task_id, version)

    def unpin(self, task_id: str, version: int) -> None:
        """Drops one pin; the version is retired now if it is superseded and nothing else uses it."""
        self._retire(self.versions.unpin(task_id, version))

    def _retire(self, keys: list[tuple[str, int]]) -> None:
        """Frees retired (task, version) adapters in the engine (engines that hold adapters override it)."""

    def pop_retired(self) -> list[AdapterRef]:
        """Adapters retired since the last call: the engine never reads them again (a path-based one's files
        may be deleted; an in-memory one's tensors are freed). Engines that hold adapters override it."""
        return []

    def abort(self, request_ids: list[str]) -> list[GenerationRequest]:
        """Takes requests out of the engine before they finish (issue #29: a rollout rank held by a few long
        sequences hands them to a tail rank) and releases their versions. Returns, for each one still in flight,
        its continuation: the request with `partial_ids` / `partial_logprobs` holding what was sampled so far,
        which an engine holding the same `adapter_version` continues (`submit`) as if it had never moved. Ids
        not in flight are ignored. Engines that cannot stop a request mid-way raise NotImplementedError."""
        raise NotImplementedError(f"{type(self).__name__} cannot abort requests")

    def progress(self) -> dict[str, int]:
        """Tokens sampled so far by each request in flight, by request id (what `abort` would hand over).
        Engines that cannot say raise NotImplementedError."""
        raise NotImplementedError(f"{type(self).__name__} does not report requests' progress")

    def occupancy(self) -> dict:
        """The engine's DecodeOccupancy so far, as a dict; {} where the engine does not count it (only HfEngine
        does: each `step` is whole batches, so its decode steps are known exactly)."""
        return {}

    def close(self) -> None:
        """Releases engine resources."""


class AdapterVersions:
    """Book-keeping shared by the engines: which (task, version) adapters are live, their int ids for
    vLLM, how many in-flight requests use each and how many episodes pin each. A version is retired
    (returned by `release`/`unpin`/`add`) once a newer version of its task exists and nothing uses it."""

    def __init__(self):
        self._next_int_id = 1
        self.int_id: dict[tuple[str, int], int] = {}
        self.ref: dict[tuple[str, int], AdapterRef] = {}
        """The live versions' adapters (an engine restart registers them again)."""
        self.in_flight: dict[tuple[str, int], int] = {}
        self.pins: dict[tuple[str, int], int] = {}
        """Multi-turn episodes holding a version between their turns."""
        self.latest: dict[str, int] = {}

    def check_new(self, adapter: AdapterRef) -> int:
        """Raises ValueError where `add(adapter)` would; else returns the int id `add` will give it. Engines
        call it before loading the adapter so that a failed load leaves the book-keeping untouched."""
        key = (adapter.task_id, adapter.version)
        if key in self.int_id:
            raise ValueError(f"adapter {adapter.task_id} v{adapter.version} is already registered")
        if adapter.version < self.latest.get(adapter.task_id, -1):
            raise ValueError(f"adapter {adapter.task_id} v{adapter.version} is older than the latest "
                             f"registered v{self.latest[adapter.task_id]}")
        return self._next_int_id

    def add(self, adapter: AdapterRef) -> list[tuple[str, int]]:
        key = (adapter.task_id, adapter.version)
        self.check_new(adapter)
        self.int_id[key] = self._next_int_id
        self._next_int_id += 1
        self.ref[key] = adapter
        self.in_flight[key] = 0
        self.latest[adapter.task_id] = adapter.version
        return self._retirable(adapter.task_id)

    def acquire(self, task_id: str, version: int) -> int:
        """Pins a version for one request; returns its int id."""
        key = (task_id, version)
        if key not in self.int_id:
            raise KeyError(f"adapter {task_id} v{version} is not registered (never added, or retired once "
                           f"superseded and unused); live versions of {task_id!r}: {self.live(task_id)}")
        self.in_flight[key] += 1
        return self.int_id[key]

    def release(self, task_id: str, version: int) -> list[tuple[str, int]]:
        self.in_flight[(task_id, version)] -= 1
        return self._retirable(task_id)

    def pin(self, task_id: str, version: int) -> None:
        key = (task_id, version)
        self.acquire(task_id, version)  # same checks; the pin holds it like a request would
        self.in_flight[key] -= 1
        self.pins[key] = self.pins.get(key, 0) + 1

    def unpin(self, task_id: str, version: int) -> list[tuple[str, int]]:
        key = (task_id, version)
        if self.pins.get(key, 0) < 1:
            raise KeyError(f"adapter {task_id} v{version} is not pinned")
        self.pins[key] -= 1
        if self.pins[key] == 0:
            del self.pins[key]
        return self._retirable(task_id)

    def pinned(self, task_id: str) -> dict[int, int]:
        """version -> episodes pinning it."""
        return {v: n for (t, v), n in self.pins.items() if t == task_id}

    def live(self, task_id: str) -> list[int]:
        return sorted(v for (t, v) in self.int_id if t == task_id)

    def _retirable(self, task_id: str) -> list[tuple[str, int]]:
        latest = self.latest[task_id]
        old = [key for key in self.int_id if key[0] == task_id and key[1] < latest and self.in_flight[key] == 0
               and key not in self.pins]
        for key in old:
            del self.int_id[key], self.ref[key], self.in_flight[key]
        return old
