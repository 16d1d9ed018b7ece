"""Small MPI helpers. Waiting ranks poll with Iprobe + a short sleep instead of a blocking recv: a rank
spinning in MPI on the same cores slows generation (FACTS.md)."""
from __future__ import annotations

import time
from collections import deque

from marlaas_hpc.runtime.faults import RankLostError


def poll(comm, tag, source=None, idle_sleep: float = 0.002):
    """Returns (message, source) if one is waiting, else (None, None). Never blocks. A message from anyone whose
    sender died before it was all sent is no message (a tolerant job: runtime/membership.py)."""
    from mpi4py import MPI

    status = MPI.Status()
    src = MPI.ANY_SOURCE if source is None else source
    if comm.Iprobe(source=src, tag=tag, status=status):
        sender = status.Get_source()
        try:
            return comm.recv(source=sender, tag=tag), sender
        except RankLostError:
            if source is not None:
                raise
    return None, None


def drain(comm, tag, source=None) -> list:
    """Every message waiting on `tag` (from `source`, or any), in arrival order. Never blocks."""
    messages = []
    while True:
        message, src = poll(comm, tag, source)
        if src is None:
            return messages
        messages.append(message)


def recv_wait(comm, tag, source=None, idle_sleep: float = 0.002):
    """Blocking receive that sleeps between probes."""
    while True:
        message, src = poll(comm, tag, source)
        if src is not None:
            return message, src
        time.sleep(idle_sleep)


def quiet_barrier(comm, idle_sleep: float = 0.002, timeout_s: float | None = None) -> bool:
    """A barrier whose waiting ranks sleep between tests. MPI's blocking collectives spin while they wait: at
    start-up the ranks that are ready early (env, scheduler, trainer) took up to a core from the one still
    starting its engine, on a machine whose ranks share cores. Put one before a collective that some ranks
    reach much later than others (the collective itself then finds everyone there). False: `timeout_s` passed
    first."""
    request = comm.Ibarrier()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not request.Test():
        if deadline is not None and time.monotonic() > deadline:
            return False
        time.sleep(idle_sleep)
    return True


class BusyClock:
    """Accumulates the seconds a rank spends doing real work (busy fractions) and keeps each span as a
    timeline record (stage, tasks, extra figures) for `timeline/rank<N>.jsonl`: the report's Gantt chart
    and the simulator's calibration read it. Consecutive spans of the same stage and tasks that touch
    (rollout engine steps) are merged so the file stays small."""

    def __init__(self):
        self.start = time.time()
        self.watch = None
        """Told of each span as it starts (stage, tasks) and ends (None): the rank's heartbeat says what it is
        doing (launch/monitor.py RankReporter.doing)."""
        self.busy = 0.0
        self.records: list[dict] = []
        self.stages: dict[str, list] = {}
        """stage -> [busy seconds, spans]: exact, where a merged timeline record also covers the short gaps
        between the spans it merges."""

    def track(self, stage: str, tasks=(), **extra):
        clock = self

        class _Span:
            def __enter__(self):
                self.t0 = time.time()
                if clock.watch is not None:
                    clock.watch(stage, tasks)
                return self

            def __exit__(self, *exc):
                t1 = time.time()
                if clock.watch is not None:
                    clock.watch(None)
                clock.busy += t1 - self.t0
                totals = clock.stages.setdefault(stage, [0.0, 0])
                totals[0] += t1 - self.t0
                totals[1] += 1
                clock.add(stage, tuple(tasks), self.t0, t1, extra)

        return _Span()

    def add(self, stage: str, tasks: tuple, t0: float, t1: float, extra: dict) -> None:
        last = self.records[-1] if self.records else None
        if (not extra and last is not None and last["stage"] == stage and tuple(last["tasks"]) == tasks
                and t0 - last["end"] < 0.005 and "steps" in last):
            last["end"] = t1
            last["steps"] += 1
            return
        record = {"stage": stage, "tasks": list(tasks), "start": t0, "end": t1, **extra}
        if not extra:
            record["steps"] = 1
        self.records.append(record)

    def note(self, stage: str, tasks: tuple, t0: float, t1: float, **extra) -> None:
        """A record that is not busy time of this rank (e.g. a prompt group's life in the engine)."""
        self.records.append({"stage": stage, "tasks": list(tasks), "start": t0, "end": t1, **extra})

    def wall(self) -> float:
        return time.time() - self.start


def write_timeline(run_dir, rank: int, role: str, clock: BusyClock) -> None:
    """RUN_DIR/timeline/rank<N>.jsonl: one line per busy span (absolute unix times, seconds)."""
    import json
    from pathlib import Path

    path = Path(run_dir) / "timeline" / f"rank{rank}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as sink:
        for record in clock.records:
            sink.write(json.dumps({"rank": rank, "role": role, **record}) + "\n")


def send_settled(comm, request, dest: int) -> bool:
    """Whether a posted send to `dest` is done. Through a LiveComm (runtime/membership.py `test_send`) a send that
    failed because `dest` died counts as done: it is dropped; a plain MPI communicator has no lost ranks."""
    test = getattr(comm, "test_send", None)
    return test(request, dest) if test is not None else request.Test()


class Outbox:
    """Non-blocking sends. A blocking send of a large pickle waits for its receiver; with the data plane
    rollout -> env -> trainer and the delta broadcast trainer -> rollout, blocking sends could deadlock in
    a cycle. Every rank sends through its outbox and calls `progress()` in its loop.

    Sends wait per (destination, tag) in the order they were posted, and `progress` tests only the oldest of
    each: MPI matches the messages of one sender, receiver and tag in order, so a newer one is rarely done
    before it, and if it is it is freed a little later. Testing every pending send on each call cost rank 0 of
    a 256-task job 42% of its time (thousands of prompts and admissions waiting for busy workers)."""

    def __init__(self, comm):
        self.comm = comm
        self.pending: dict[tuple[int, int], deque] = {}

    def send(self, message, dest: int, tag: int) -> None:
        queue = self.pending.get((dest, tag))
        if queue is None:
            queue = self.pending[(dest, tag)] = deque()
        queue.append(self.comm.isend(message, dest=dest, tag=tag))
        self._settle(dest, queue)

    def progress(self) -> None:
        for (dest, _), queue in self.pending.items():
            self._settle(dest, queue)

    def _settle(self, dest: int, queue: deque) -> None:
        """Frees the oldest sends to `dest` that are done (a send to a rank that died is dropped)."""
        while queue and send_settled(self.comm, queue[0], dest):
            queue.popleft()

    def flush(self) -> None:
        from mpi4py import MPI

        if getattr(self.comm, "test_send", None) is None:
            MPI.Request.Waitall([request for queue in self.pending.values() for request in queue])
        else:
            while any(self.pending.values()):
                self.progress()
                time.sleep(0.0005)
        self.pending.clear()
