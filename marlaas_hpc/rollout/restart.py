"""A rollout engine that survives its own failure: when the engine raises (a vLLM engine error: CUDA out of
memory, an illegal memory access, its engine core gone), it is closed and built again, the adapter versions it
held are registered again, the versions multi-turn episodes pinned are pinned again, and every request in flight
is submitted again with the same id and seed. So the rollout rank's groups are re-issued where they were, and
an engine error costs a restart (seconds), not the job. Only `max_restarts` failures in a row (no successful
step between) give up: the error is raised and the rank dies (the job stops and resumes from its checkpoints).

Errors that are the caller's (an unknown adapter version, a bad request: KeyError, ValueError) pass through
untouched: a fresh engine would refuse them too.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable

from marlaas_hpc.rollout.base import AdapterRef, Generation, GenerationRequest, RolloutEngine

CALLER_ERRORS = (KeyError, ValueError, FileNotFoundError)


class EngineFailed(RuntimeError):
    """The engine failed `max_restarts` times in a row."""


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
        self._guarded(self.engine.add_adapter, adapter)

    def submit(self, requests: list[GenerationRequest]) -> None:
        self._guarded(self.engine.submit, requests)
        self._pending.update((r.request_id, r) for r in requests)

    def step(self) -> list[Generation]:
        try:
            done = self.engine.step()
        except CALLER_ERRORS:
            raise
        except Exception as exc:
            self._restart(exc)
            return []
        self._failures_in_a_row = 0
        for gen in done:
            self._pending.pop(gen.request_id, None)
        return done

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

    def close(self) -> None:
        self.engine.close()

    def _guarded(self, call, *args) -> None:
        """Runs an engine call; if the engine itself fails, restarts it and runs the call once more."""
        try:
            call(*args)
        except CALLER_ERRORS:
            raise
        except Exception as exc:
            self._restart(exc)
            getattr(self.engine, call.__name__)(*args)

    def _restart(self, exc: Exception) -> None:
        self._failures_in_a_row += 1
        if self._failures_in_a_row > self.max_restarts:
            raise EngineFailed(f"rollout engine failed {self._failures_in_a_row} times in a row; last error: "
                               f"{type(exc).__name__}: {exc}") from exc
        old = self.engine
        # in-memory adapters keep their tensors in the ref (host memory) until retired: they serve this too
        adapters = [old.versions.ref[key] for key in sorted(old.versions.int_id)]
        self._retired += old.pop_retired()
        try:
            old.close()
        except Exception:  # noqa: BLE001 - a failed engine may fail to close too; it is dropped either way
            pass
        self.engine = self.factory()
        self.restarts += 1
        self._restore(adapters)
        if self.on_restart is not None:
            self.on_restart(f"{type(exc).__name__}: {exc}", self.restarts, len(self._pending))

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
