"""Small MPI helpers. Waiting ranks poll with Iprobe + a short sleep instead of a blocking recv: a rank
spinning in MPI on the same cores slows generation (FACTS.md)."""
from __future__ import annotations

import time


def poll(comm, tag, source=None, idle_sleep: float = 0.002):
    """Returns (message, source) if one is waiting, else (None, None). Never blocks."""
    from mpi4py import MPI

    status = MPI.Status()
    src = MPI.ANY_SOURCE if source is None else source
    if comm.Iprobe(source=src, tag=tag, status=status):
        return comm.recv(source=status.Get_source(), tag=tag), status.Get_source()
    return None, None


def recv_wait(comm, tag, source=None, idle_sleep: float = 0.002):
    """Blocking receive that sleeps between probes."""
    while True:
        message, src = poll(comm, tag, source)
        if src is not None:
            return message, src
        time.sleep(idle_sleep)


class BusyClock:
    """Accumulates the seconds a rank spends doing real work (for busy fractions)."""

    def __init__(self):
        self.start = time.time()
        self.busy = 0.0
        self.intervals: list[tuple[float, float, str]] = []

    def track(self, label: str = ""):
        clock = self

        class _Span:
            def __enter__(self):
                self.t0 = time.time()

            def __exit__(self, *exc):
                t1 = time.time()
                clock.busy += t1 - self.t0
                clock.intervals.append((self.t0, t1, label))

        return _Span()

    def wall(self) -> float:
        return time.time() - self.start


class Outbox:
    """Non-blocking sends. A blocking send of a large pickle waits for its receiver; with the data plane
    rollout -> env -> trainer and the delta broadcast trainer -> rollout, blocking sends could deadlock in
    a cycle. Every rank sends through its outbox and calls `progress()` in its loop."""

    def __init__(self, comm):
        self.comm = comm
        self.pending: list = []

    def send(self, message, dest: int, tag: int) -> None:
        self.pending.append(self.comm.isend(message, dest=dest, tag=tag))
        self.progress()

    def progress(self) -> None:
        self.pending = [req for req in self.pending if not req.Test()]

    def flush(self) -> None:
        from mpi4py import MPI

        MPI.Request.Waitall(self.pending)
        self.pending = []
