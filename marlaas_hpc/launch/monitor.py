"""Which rank took the job down, and why: a liveness line from every rank to the job's supervisor.

The supervisor (`marlaas run` in local mode, the step guard under Slurm: launch/supervise.py) listens on a TCP
port and starts the launcher (mpirun / srun) with MARLAAS_MONITOR=host:port. Every rank connects at start and
says who it is (rank, role, pid, host); it says `bye` when it ends normally, or `crash` with the error when it
dies of an exception. A rank killed outright (SIGKILL, the out-of-memory killer, a segfault) says nothing, but
the kernel closes its socket at once, so the supervisor sees that rank's connection end first: before the
launcher takes the other ranks down (mpirun: about 1-2 s later). The first failure that is not a consequence of
another (`peer_lost`: a collective whose other end died) names the rank, its role and the cause.

Protocol: one JSON object per line, rank -> supervisor only.
    {"kind": "hello", "rank": 3, "role": "trainer leader", "pid": 123, "host": "n1", ...}
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
    """It said bye or crash: the end of its connection is no failure of its own."""


class RankMonitor:
    """Supervisor side: accepts one connection per rank and keeps each rank's hello and failure."""

    def __init__(self, host: str | None = None):
        self._server = socket.create_server(("", 0))
        self.address = f"{host or socket.gethostname()}:{self._server.getsockname()[1]}"
        self.hellos: dict[int, dict] = {}
        self.failures: list[RankFailure] = []
        self._lock = threading.Lock()
        self._closed = False
        self.failed = threading.Event()
        """Set at the first failure that is not a consequence of another (the supervisor then makes sure the
        launcher ends)."""
        threading.Thread(target=self._serve, name="rank-monitor", daemon=True).start()

    def _serve(self) -> None:
        """One thread reads every rank's line in turn. Within one wake-up, every line that arrived is handled
        before any connection's end: a rank that fails sends its crash report and then aborts the job, and the
        launcher kills the others at once; their ends must not overtake the report (with a thread per
        connection they did, now and then, on a loaded node: a killed bystander was named instead)."""
        selector = selectors.DefaultSelector()
        selector.register(self._server, selectors.EVENT_READ)
        peers: dict[socket.socket, _Peer] = {}
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
            elif message.get("kind") == "bye":
                peer.ended = True

    def _record(self, failure: RankFailure) -> None:
        with self._lock:
            self.failures.append(failure)
        if not failure.peer_lost:
            self.failed.set()

    def first_failure(self) -> RankFailure | None:
        """The failure that took the job down: the earliest one that is not a consequence of another; else the
        earliest of all (every failure reported a lost peer: the dead peer never connected)."""
        with self._lock:
            failures = sorted(self.failures, key=lambda f: f.time)
        causes = [f for f in failures if not f.peer_lost]
        return (causes or failures or [None])[0]

    def hello(self, rank: int) -> dict | None:
        with self._lock:
            return self.hellos.get(rank)

    def close(self) -> None:
        self._closed = True
        self._server.close()


class RankReporter:
    """Rank side. Inert when the job has no supervisor (MARLAAS_MONITOR unset, or unreachable)."""

    def __init__(self, sock: socket.socket | None):
        self.sock = sock
        if sock is not None:  # a forked child must not hold the line open after this rank dies
            os.register_at_fork(after_in_child=self._drop)

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
        if self.sock is None:
            return
        try:
            self.sock.sendall((json.dumps(message) + "\n").encode())
        except OSError:
            pass

    def crash(self, cause: str, peer_lost: bool, traceback_file: str | None = None) -> None:
        self._send({"kind": "crash", "cause": cause, "peer_lost": peer_lost, "traceback": traceback_file})

    def bye(self) -> None:
        self._send({"kind": "bye"})
        self._drop()

    def _drop(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
            self.sock = None
