"""A replay rollout engine: completions come from a policy function instead of a model.

For env-side tests and env-rank benchmarks (episodes/s without a GPU or model): it honours the RolloutEngine
contract (submit/step/has_unfinished, version book-keeping, per-request max_new_tokens, eos handling) and
finishes requests after a configurable number of `step` calls so turns of different episodes interleave.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from marlaas_hpc.rollout.base import AdapterRef, AdapterVersions, Generation, GenerationRequest, RolloutEngine

if TYPE_CHECKING:  # marlaas_hpc.model imports torch
    from marlaas_hpc.model.codec import TextCodec

Policy = Callable[[GenerationRequest, str], str]
"""(request, decoded context with special tokens as text, e.g. '<bos>c4+7=?<eos>23+7=') -> completion text."""


@dataclass
class _Pending:
    request: GenerationRequest
    steps_left: int


class ScriptedEngine(RolloutEngine):
    def __init__(self, codec: TextCodec, policy: Policy, *, logprob: float = -0.5,
                 steps: Callable[[GenerationRequest], int] = lambda request: 1, check_versions: bool = False,
                 supports_pin: bool = True):
        self.codec, self.policy, self.logprob, self.steps = codec, policy, logprob, steps
        self.check_versions = check_versions
        """If True, a request must name a registered, live adapter version (like the real engines)."""
        self.versions = AdapterVersions()
        self.requests: list[GenerationRequest] = []
        """Every request submitted, in order (tests inspect versions, prompts, caps)."""
        self._pending: list[_Pending] = []
        if not supports_pin:  # behave like an engine without the pin/unpin extension
            self.pin = self.unpin = None

    def add_adapter(self, adapter: AdapterRef) -> None:
        self.versions.add(adapter)

    def submit(self, requests: list[GenerationRequest]) -> None:
        for req in requests:
            if self.check_versions and req.adapter_version is not None:
                self.versions.acquire(req.task_id, req.adapter_version)
                self.versions.release(req.task_id, req.adapter_version)
            self.requests.append(req)
            self._pending.append(_Pending(req, max(1, self.steps(req))))

    def step(self) -> list[Generation]:
        done, still = [], []
        for item in self._pending:
            item.steps_left -= 1
            (done if item.steps_left <= 0 else still).append(item)
        self._pending = still
        return [self._complete(item.request) for item in done]

    def has_unfinished(self) -> bool:
        return bool(self._pending)

    def _complete(self, req: GenerationRequest) -> Generation:
        context = self.codec.tokenizer.decode(req.prompt_ids, skip_special_tokens=False)
        ids = self.codec.encode_completion(self.policy(req, context))
        finish = "stop"
        if len(ids) > req.max_new_tokens:
            ids, finish = ids[: req.max_new_tokens], "length"
        return Generation(req.request_id, req.task_id, req.adapter_version, list(req.prompt_ids), ids,
                          [self.logprob] * len(ids), finish)
