"""Which rank took the job down, and why: a liveness line from every rank to the job's supervisor.

The supervisor (`marlaas run` in local mode, the step guard under Slurm: launch/supervise.py) listens on a TCP
port and starts the launcher (mpirun / srun) with MARLAAS_MONITOR=host:port. Every rank connects at start and
says who it is (rank, role, pid, host); it says `bye` when it ends normally, or `crash` with the error when it
dies of an exception. A rank killed outright (SIGKILL, the out-of-memory killer, a segfault) says nothing, but
the kernel closes its socket at once, so the supervisor sees that rank's connection end first: before the
launcher takes the other ranks down (mpirun: about 1-2 s later). The first failure that is not a consequence of
another (`peer_lost`: a collective whose other end died) names the rank, its role and the cause.

Hangs (a rank alive but stuck: in a collective, a deadlocked engine, a hung worker pool) are the heartbeat's:
once its loop runs, each rank's reporter beats once a second from a thread of its own, saying how long ago its
loop last turned (`turned`, called on every probe for messages: runtime/membership.py) and what it is doing
(`doing`: its BusyClock span). The supervisor's watchdog (`RankMonitor.watch`) counts a rank hung when its loop
has not turned for its `hang_timeout_s` (hello), or when it has sent no beat for that long (a stopped process);
it names the rank with what it was doing and kills it, and the rank is then handled as a dead one.

Protocol: one JSON object per line, rank -> supervisor only.
    {"kind": "hello", "rank": 3, "role": "trainer leader", "pid": 123, "host": "n1", "hang_timeout_s": 600, ...}
    {"kind": "beat", "loop_s": 0.01, "doing": "train", "tasks": ["add"], "doing_s": 0.3}
    {"kind": "crash", "cause": "OSError: [Errno 28] No space left on device", "peer_lost": false,
     "traceback": "RUN_DIR/crash/rank3.txt"}
    {"kind": "bye"}
"""
from __future__ import annotations

import json
import os
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field

MONITOR_ENV = "MARLAAS_MONITOR"


@dataclass
class RankFailure:
    rank: int
    role: str
    kind: str
    """'crash' (an exception, reported by the rank) or 'died' (the connection ended without a word)."""
    cause: str
    time: float
    peer_lost: bool = False
    """The error was a consequence of another rank's death (a collective's other end gone)."""
    info: dict = field(default_factory=dict)
    """The rank's hello (pid, host, ...) and crash report (traceback file)."""


@dataclass
class _Peer:
    """The supervisor's view of one rank's connection."""

    buffer: bytes = b""
    hello: dict | None = None
    ended: bool = False
    """It said bye or crash (or was found hung): the end of its connection is no failure of its own."""
    beat: dict | None = None
    """Its latest heartbeat (none before its loop runs)."""
    beat_at: float = 0.0
    """When it arrived (time.monotonic)."""


def tolerated(failure: RankFailure) -> bool:
    """The job goes on without this rank: a worker (not rank 0) of a job that survives a rank's loss (its hello
    says so: runtime/membership.py)."""
    return failure.rank != 0 and bool(failure.info.get("tolerant"))


class RankMonitor:
    """Supervisor side: accepts one connection per rank and keeps each rank's hello and failure."""

    def __init__(self, host: str | None = None, on_failure=None):
        self.on_failure = on_failure
        """Called (on the monitor's thread) with each failure as it is recorded."""
        self._server = socket.create_server(("", 0))
        self.address = f"{host or socket.gethostname()}:{self._server.getsockname()[1]}"
        self.hellos: dict[int, dict] = {}
        self.statuses: dict[int, int] = {}
        """Rank -> the status it said the job ends with (rank 0's bye)."""
        self.failures: list[RankFailure] = []
        self._lock = threading.Lock()
        self._closed = False
        self.failed = threading.Event()
        """Set at the first failure that is not a consequence of another (the supervisor then makes sure the
        launcher ends)."""
        self._peers: dict[socket.socket, _Peer] = {}
        threading.Thread(target=self._serve, name="rank-monitor", daemon=True).start()

    def _serve(self) -> None:
        """One thread reads every rank's line in turn. Within one wake-up, every line that arrived is handled
        before any connection's end: a rank that fails sends its crash report and then aborts the job, and the
        launcher kills the others at once; their ends must not overtake the report (with a thread per
        connection they did, now and then, on a loaded node: a killed bystander was named instead)."""
        selector = selectors.DefaultSelector()
        selector.register(self._server, selectors.EVENT_READ)
        peers = self._peers
        while not self._closed:
            try:
                events = selector.select(timeout=0.5)
            except (OSError, ValueError):  # the server socket was closed
                return
            ended = []
            for key, _ in events:
                if key.fileobj is self._server:
                    try:
                        conn, _ = self._server.accept()
                    except OSError:
                        return
                    conn.setblocking(False)
                    selector.register(conn, selectors.EVENT_READ)
                    with self._lock:
                        peers[conn] = _Peer()
                    continue
                try:
                    data = key.fileobj.recv(65536)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if data:
                    self._lines(peers[key.fileobj], data)
                else:
                    ended.append(key.fileobj)
            for conn in ended:
                selector.unregister(conn)
                conn.close()
                with self._lock:
                    peer = peers.pop(conn)
                if peer.hello is not None and not peer.ended and not self._closed:
                    self._record(RankFailure(peer.hello["rank"], peer.hello["role"], "died",
                                             "ended without an error report", time.time(), False, dict(peer.hello)))

    def _lines(self, peer: "_Peer", data: bytes) -> None:
        peer.buffer += data
        *lines, peer.buffer = peer.buffer.split(b"\n")
        for line in lines:
            try:
                message = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if message.get("kind") == "hello":
                peer.hello = message
                with self._lock:
                    self.hellos[message["rank"]] = message
            elif message.get("kind") == "crash" and peer.hello is not None:
                hello = peer.hello
                self._record(RankFailure(hello["rank"], hello["role"], "crash", message["cause"], time.time(),
                                         bool(message.get("peer_lost")), {**hello, **message}))
                peer.ended = True
            elif message.get("kind") == "beat":
                peer.beat, peer.beat_at = message, time.monotonic()
            elif message.get("kind") == "bye":
                peer.ended = True
                if peer.hello is not None and "status" in message:
                    with self._lock:
                        self.statuses[peer.hello["rank"]] = message["status"]

    def _record(self, failure: RankFailure) -> None:
        with self._lock:
            self.failures.append(failure)
        if self.on_failure is not None:
            self.on_failure(failure)
        if not failure.peer_lost and not tolerated(failure):
            self.failed.set()

    def first_failure(self) -> RankFailure | None:
        """The failure that took the job down: the earliest one that is not a consequence of another and that the
        job did not go on without; else the last loss it went on without before rank 0 gave up (no rank of that
        kind left; the ranks the launcher killed after that are bystanders); else the earliest of all (every
        failure reported a lost peer: the dead peer never connected)."""
        with self._lock:
            failures = sorted(self.failures, key=lambda f: f.time)
        causes = [f for f in failures if not f.peer_lost and not tolerated(f)]
        if causes:
            return causes[0]
        gave_up = next((f.time for f in failures if f.rank == 0), None)
        survived = [f for f in failures if tolerated(f) and (gave_up is None or f.time <= gave_up)]
        survived = survived or [f for f in failures if tolerated(f)]
        return survived[-1] if survived else (failures or [None])[0]

    def job_status(self) -> int | None:
        """The status rank 0 said the job ends with, if every failure was one the job went on without; None
        otherwise (the launcher's status stands)."""
        with self._lock:
            if 0 not in self.statuses or not all(tolerated(f) or f.peer_lost for f in self.failures):
                return None
            return self.statuses[0]

    def hello(self, rank: int) -> dict | None:
        with self._lock:
            return self.hellos.get(rank)

    # ---- hangs ----
    def hung(self, now: float | None = None) -> list[RankFailure]:
        """Ranks found hung now (each once): their loop has not turned, or they have not beaten, for their
        hang_timeout_s. They are recorded as failures (kind 'hang') whose connection's end is then no news."""
        now = time.monotonic() if now is None else now
        found = []
        with self._lock:
            peers = [peer for peer in self._peers.values()
                     if peer.beat is not None and not peer.beat.get("done") and not peer.ended]
        for peer in peers:
            timeout = float(peer.hello.get("hang_timeout_s") or 0)
            silent = now - peer.beat_at
            stuck = float(peer.beat.get("loop_s", 0.0)) + silent
            if not timeout or max(silent, stuck) < timeout:
                continue
            peer.ended = True
            found.append(RankFailure(peer.hello["rank"], peer.hello["role"], "hang",
                                     describe_hang(peer.beat, silent, stuck), time.time(), False,
                                     {**peer.hello, "beat": peer.beat}))
        return found

    def record_hang(self, failure: RankFailure) -> None:
        self._record(failure)

    def watch(self, on_hang, period_s: float = 1.0) -> None:
        """Checks for hung ranks every `period_s` on a thread of its own; `on_hang(failure)` acts on each."""
        def loop():
            while not self._closed:
                for failure in self.hung():
                    on_hang(failure)
                time.sleep(period_s)

        threading.Thread(target=loop, name="hang-watch", daemon=True).start()

    def wait_ended(self, timeout_s: float) -> bool:
        """Waits until every rank that said hello has ended its connection (or `timeout_s`); True if all have."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                open_ = any(peer.hello is not None for peer in self._peers.values())
            if not open_ or time.monotonic() >= deadline:
                return not open_
            time.sleep(0.05)

    def close(self) -> None:
        self._closed = True
        self._server.close()


def describe_hang(beat: dict, silent_s: float, stuck_s: float) -> str:
    """'hung: its loop has not turned for 31 s (in 'train' of add for 30 s); killed with SIGKILL'."""
    doing, tasks = beat.get("doing"), beat.get("tasks") or []
    if doing:
        where = f"in '{doing}'" + (f" of {', '.join(tasks[:4])}" if tasks else "") \
            + f" for {beat.get('doing_s', 0.0) + silent_s:.0f} s"
    else:
        where = "between its steps"
    heard = f"; no heartbeat for {silent_s:.0f} s: stopped?" if silent_s > 2.5 else ""
    return f"hung: its loop has not turned for {stuck_s:.0f} s ({where}{heard}); killed with SIGKILL"


class RankReporter:
    """Rank side. Inert when the job has no supervisor (MARLAAS_MONITOR unset, or unreachable)."""

    BEAT_S = 1.0

    def __init__(self, sock: socket.socket | None):
        self.sock = sock
        self._lock = threading.Lock()
        self._turned_at = time.monotonic()
        self._doing: tuple[str, list, float] | None = None
        self._beating = False
        if sock is not None:  # a forked child must not hold the line open after this rank dies
            os.register_at_fork(after_in_child=self._drop)

    # ---- heartbeat (module doc) ----
    def start_heartbeat(self) -> None:
        """Beats once a second from now on (the rank's loop runs: start-up is over)."""
        if self.sock is None or self._beating:
            return
        self._beating = True
        self._turned_at = time.monotonic()
        threading.Thread(target=self._beat_loop, name="heartbeat", daemon=True).start()

    def stop_heartbeat(self) -> None:
        """The rank's loop is over (what is left is the end of the job): a last beat says so, and none follow."""
        if self._beating:
            self._beating = False
            self._send({"kind": "beat", "loop_s": 0.0, "done": True})

    def turned(self) -> None:
        """The rank's loop went round (it probed for messages)."""
        self._turned_at = time.monotonic()

    def doing(self, stage: str | None, tasks=()) -> None:
        """The span the rank is in (None: out of it): the hang message says it."""
        self._doing = None if stage is None else (stage, list(tasks)[:8], time.monotonic())

    def _beat_loop(self) -> None:
        while self.sock is not None and self._beating:
            now = time.monotonic()
            beat = {"kind": "beat", "loop_s": round(now - self._turned_at, 3)}
            doing = self._doing
            if doing is not None:
                beat.update(doing=doing[0], tasks=doing[1], doing_s=round(now - doing[2], 3))
            self._send(beat)
            time.sleep(self.BEAT_S)

    @classmethod
    def connect(cls, hello: dict, environ=os.environ, timeout_s: float = 10.0) -> "RankReporter":
        address = environ.get(MONITOR_ENV)
        if not address:
            return cls(None)
        host, _, port = address.rpartition(":")
        try:
            sock = socket.create_connection((host, int(port)), timeout=timeout_s)
            sock.settimeout(timeout_s)
            sock.sendall((json.dumps({"kind": "hello", "pid": os.getpid(), "host": socket.gethostname(),
                                      **hello}) + "\n").encode())
        except (OSError, ValueError):
            return cls(None)
        return cls(sock)

    @property
    def connected(self) -> bool:
        return self.sock is not None

    def _send(self, message: dict) -> None:
        with self._lock:  # the heartbeat thread and the rank's own thread share the line
            if self.sock is None:
                return
            try:
                self.sock.sendall((json.dumps(message) + "\n").encode())
            except OSError:
                pass

    def crash(self, cause: str, peer_lost: bool, traceback_file: str | None = None) -> None:
        self._send({"kind": "crash", "cause": cause, "peer_lost": peer_lost, "traceback": traceback_file})

    def bye(self, status: int | None = None) -> None:
        """The rank ends normally; rank 0 says with which status the job ends."""
        self._send({"kind": "bye", **({"status": status} if status is not None else {})})
        self._drop()

    def _drop(self) -> None:
        self._lock = threading.Lock()  # after a fork the child's copy may be held by a thread it does not have
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
            self.sock = None
