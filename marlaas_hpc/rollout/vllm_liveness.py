"""Seeing at once that a vLLM engine core running in a process of its own (`vllm.engine_process: own`) died.

vLLM 0.32's synchronous client (`SyncMPClient`) waits for the core's outputs in `outputs_queue.get()` and for a
utility call's answer (`collective_rpc`, `add_lora`) in `Future.result()`, both without a timeout. Its own monitor
thread notices the core's death (the process sentinel) but only marks the client dead and closes the output
socket's thread, which then ends without putting anything in the queue: a rank stepping the engine waited there
until the job's hang watchdog killed it (600 s by default; seen after a USR2 killed the core). `CoreWatch` waits on
the same sentinels and, when a core ends while the engine is open, fails every call waiting on it with
`EngineCoreDied`, so `RestartingEngine` (rollout/restart.py) rebuilds the engine within seconds of the death,
whatever killed it (a signal, the out-of-memory killer, a crash in native code).

It holds no reference to the client or the engine (only the client's queue, its pending utility calls, its
resources record and the processes), so a failed engine that RestartingEngine drops is freed as before.
"""
from __future__ import annotations

import signal
import threading
from concurrent.futures import InvalidStateError
from multiprocessing import connection


class EngineCoreDied(RuntimeError):
    """The engine's core process ended while the engine was open (not a caller's error: the engine is rebuilt)."""


def describe_exit(exitcode: int | None) -> str:
    """'killed by signal 9 (SIGKILL)', 'exit status 1'; None: reaped by another thread (vLLM's own monitor)."""
    if exitcode is None:
        return "ended (exit status not known here)"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "unknown"
        return f"killed by signal {-exitcode} ({name})"
    return f"exit status {exitcode}"


class CoreWatch:
    """A daemon thread that fails the engine's pending calls when one of its core processes ends."""

    POLL_S = 0.5
    """How often it looks at its stop flag between waits (a death wakes it at once)."""

    def __init__(self, processes: list, outputs_queue, utility_results: dict, resources):
        self.cause: str | None = None
        """Why the engine is dead ('engine core VLLM::EngineCore (pid 123) died: killed by signal 9 (SIGKILL)'),
        once it is."""
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(list(processes), outputs_queue, utility_results,
                                                                   resources), daemon=True, name="marlaas-core-watch")
        self._thread.start()

    @classmethod
    def of(cls, llm) -> "CoreWatch | None":
        """The watch of an `LLM` whose core runs in processes of its own; None when it has none (in process)."""
        client = llm.llm_engine.engine_core
        manager = getattr(getattr(client, "resources", None), "engine_manager", None)
        if manager is None or not getattr(manager, "processes", None):
            return None
        return cls(manager.processes, client.outputs_queue, client.utility_results, client.resources)

    def stop(self) -> None:
        """The engine is being shut down: the cores' ends that follow are expected."""
        self._stopped.set()

    def check(self) -> None:
        """Raises EngineCoreDied once a core died."""
        if self.cause is not None:
            raise EngineCoreDied(self.cause)

    def _watch(self, processes, outputs_queue, utility_results: dict, resources) -> None:
        by_sentinel = {proc.sentinel: proc for proc in processes}
        while not self._stopped.is_set():
            ended = connection.wait(list(by_sentinel), timeout=self.POLL_S)
            if not ended or self._stopped.is_set():
                continue
            proc = by_sentinel[ended[0]]
            proc.join(timeout=1)  # reaps it: exitcode is known once the sentinel fired
            self.cause = f"engine core {proc.name} (pid {proc.pid}) died: {describe_exit(proc.exitcode)}"
            error = EngineCoreDied(self.cause)
            resources.engine_dead = True  # the client's next request raises at once (ensure_alive)
            for future in list(utility_results.values()):
                try:
                    future.set_exception(error)
                except InvalidStateError:  # answered before the core died
                    pass
            outputs_queue.put_nowait(error)  # wakes a step waiting in get_output
            return
