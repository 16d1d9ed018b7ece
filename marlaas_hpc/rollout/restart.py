"""A rollout engine that survives its own failure: when the engine raises (a vLLM engine error: CUDA out of
memory, an illegal memory access, its engine core gone), it is closed and built again, the adapter versions it
held are registered again, the versions multi-turn episodes pinned are pinned again, and every request in flight
is submitted again with the same id and seed. So the rollout rank's groups are re-issued where they were, and
an engine error costs a restart (seconds), not the job. Only `max_restarts` failures in a row (no successful
step between) give up: the error is raised and the rank dies (the job stops and resumes from its checkpoints).

Errors that are the caller's (an unknown adapter version, a bad request: KeyError, ValueError) pass through
untouched: a fresh engine would refuse them too.

The old engine is gone before the new one is built: vLLM starts only if the device's free memory covers its
gpu_memory_utilization, and the failed engine's weights and KV cache would still hold theirs. So the rebuild runs
after the `except` clause (the exception's traceback holds the frames of the failed call, and through them the
engine), no local or attribute keeps the old engine, the garbage collector runs (vLLM freezes its start-up heap,
and a failed engine may never have unfrozen it) and torch's CUDA cache is emptied.

A CUDA error (an illegal memory access, a device-side assert, a failed launch) is not restarted: it leaves the
process's CUDA context unusable, so a new engine in it would fail or compute garbage. EngineFailed ends the rank,
and the job's crash path resumes from the checkpoints. An out-of-memory error leaves the context usable: restarted.
"""
from __future__ import annotations

import gc
from collections import Counter
from typing import Callable

from marlaas_hpc.rollout.base import AdapterRef, Generation, GenerationRequest, RolloutEngine

CALLER_ERRORS = (KeyError, ValueError, FileNotFoundError)

CUDA_POISON_MARKERS = ("CUDA error", "illegal memory access", "device-side assert", "unspecified launch failure",
                       "CUBLAS_STATUS_EXECUTION_FAILED", "misaligned address", "illegal instruction")
"""Text of the errors torch raises (C10_CUDA_CHECK: 'CUDA error: <cudaGetErrorString>', torch.AcceleratorError)
when a kernel has failed; such errors are sticky: every later CUDA call of the process fails."""


def poisons_cuda(exc: BaseException) -> bool:
    """The error, or one it was raised from, is a CUDA error that leaves the process's CUDA context unusable (an
    out-of-memory error does not)."""
    import torch

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc)
        if not isinstance(exc, torch.OutOfMemoryError) and "out of memory" not in text and (
                isinstance(exc, torch.AcceleratorError) or any(marker in text for marker in CUDA_POISON_MARKERS)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def release_device_memory() -> None:
    """Frees what no object holds any more: cycles included (vLLM freezes its start-up heap, `gc.freeze`, and a
    failed engine may never have unfrozen it), and torch's cached CUDA blocks."""
    import torch

    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class EngineFailed(RuntimeError):
    """The engine failed `max_restarts` times in a row, or with a CUDA error."""


class RestartingEngine(RolloutEngine):
    def __init__(self, factory: Callable[[], RolloutEngine], max_restarts: int = 3,
                 on_restart: Callable[[str, int, int], None] | None = None):
        self.factory = factory
        self.engine = factory()
        self.max_restarts = max_restarts
        self.on_restart = on_restart
        """Called after a restart with (cause, restarts so far, requests re-submitted)."""
        self.restarts = 0
        self._failures_in_a_row = 0
        self._pending: dict[str, GenerationRequest] = {}
        self._pins: Counter = Counter()
        self._retired: list[AdapterRef] = []
        """Retired by an engine that was replaced before they were popped."""

    @property
    def versions(self):
        return self.engine.versions

    def add_adapter(self, adapter: AdapterRef) -> None:
        self._guarded("add_adapter", adapter)

    def submit(self, requests: list[GenerationRequest]) -> None:
        self._guarded("submit", requests)
        self._pending.update((r.request_id, r) for r in requests)

    def step(self) -> list[Generation]:
        try:
            done = self.engine.step()
        except CALLER_ERRORS:
            raise
        except Exception as exc:  # noqa: BLE001 - an engine failure: judged by _failed
            cause = self._failed(exc)
        else:
            self._failures_in_a_row = 0
            for gen in done:
                self._pending.pop(gen.request_id, None)
            return done
        self._restart(cause)  # out of the except clause: its traceback no longer holds the old engine
        return []

    def has_unfinished(self) -> bool:
        return bool(self._pending)

    def pin(self, task_id: str, version: int) -> None:
        self.engine.pin(task_id, version)
        self._pins[(task_id, version)] += 1

    def unpin(self, task_id: str, version: int) -> None:
        self.engine.unpin(task_id, version)
        self._pins[(task_id, version)] -= 1
        if not self._pins[(task_id, version)]:
            del self._pins[(task_id, version)]

    def pop_retired(self) -> list[AdapterRef]:
        out, self._retired = self._retired + self.engine.pop_retired(), []
        return out

    def occupancy(self) -> dict:
        return self.engine.occupancy()

    def progress(self) -> dict[str, int]:
        return self.engine.progress()

    def abort(self, request_ids: list[str]) -> list[GenerationRequest]:
        out = self.engine.abort(request_ids)
        for req in out:  # no longer re-issued on a restart
            self._pending.pop(req.request_id, None)
        return out

    def close(self) -> None:
        self.engine.close()

    def _guarded(self, method: str, *args) -> None:
        """Runs an engine call (by name: a bound method would hold the old engine); if the engine itself fails,
        restarts it and runs the call once more."""
        try:
            getattr(self.engine, method)(*args)
            return
        except CALLER_ERRORS:
            raise
        except Exception as exc:  # noqa: BLE001 - an engine failure: judged by _failed
            cause = self._failed(exc)
        self._restart(cause)
        getattr(self.engine, method)(*args)

    def _failed(self, exc: Exception) -> str:
        """Counts a failure; raises EngineFailed if the engine must not be rebuilt (a CUDA error, or too many
        failures in a row), else returns its cause for the restart."""
        self._failures_in_a_row += 1
        if poisons_cuda(exc):
            raise EngineFailed(f"rollout engine hit a CUDA error, which leaves this process's CUDA context unusable: "
                               f"not rebuilt in it; {type(exc).__name__}: {exc}") from exc
        if self._failures_in_a_row > self.max_restarts:
            raise EngineFailed(f"rollout engine failed {self._failures_in_a_row} times in a row; last error: "
                               f"{type(exc).__name__}: {exc}") from exc
        return f"{type(exc).__name__}: {exc}"

    def _restart(self, cause: str) -> None:
        adapters = self._drop_engine()
        self.engine = self.factory()
        self.restarts += 1
        self._restore(adapters)
        if self.on_restart is not None:
            self.on_restart(cause, self.restarts, len(self._pending))

    def _drop_engine(self) -> list[AdapterRef]:
        """Closes the failed engine and lets go of it, so that its device memory is free before the next one is
        built; returns its live versions (in-memory adapters keep their tensors in the ref, host memory, until
        retired: they serve the new engine too)."""
        old, self.engine = self.engine, None
        adapters = [old.versions.ref[key] for key in sorted(old.versions.int_id)]
        self._retired += old.pop_retired()
        try:
            old.close()
        except Exception:  # noqa: BLE001 - a failed engine may fail to close too; it is dropped either way
            pass
        del old
        release_device_memory()
        return adapters

    def _restore(self, adapters: list[AdapterRef]) -> None:
        """Registers the old engine's live versions (oldest first, each held by a pin while a newer one is added,
        else adding the newer would retire it), its episodes' pins, then the requests in flight."""
        held = []
        for adapter in adapters:
            self.engine.add_adapter(adapter)
            self.engine.pin(adapter.task_id, adapter.version)
            held.append((adapter.task_id, adapter.version))
        for (task_id, version), count in self._pins.items():
            for _ in range(count):
                self.engine.pin(task_id, version)
        self.engine.submit(list(self._pending.values()))
        for task_id, version in held:
            self.engine.unpin(task_id, version)
