"""A joining rollout rank takes the base model's files from a live rollout rank instead of the disk (issue 25,
Build 5: λScale's fast start from peers), `layout.join_weights: peer`.

    rank 0:  WeightsPlan to each joiner of a batch (its feeder, the port of the next one), FeedWeights to one live
             rollout rank (the chain's head); it carries no byte of the model itself
    live rollout rank ──link──► joiner 1 ──link──► joiner 2 ──► ...     (a chain: each link carries the model once)
             each link: manifest [(file, size)], then every file in CHUNK_BYTES chunks in manifest order (raw
             bytes, MPI point-to-point, at most WINDOW chunks in flight), then the sender's crc32 per file

A link is an intercommunicator of its own (MPI_Comm_connect to the port the receiver opened: runtime/membership.py
`connect_link` / `accept_links`), disconnected once the transfer is done. A joiner forwards each chunk to the
next one as it receives it (it does not wait for the whole file), writes it to its local directory (node-local
tmp: `local_weights_dir`), and checks every file's size and crc32 against the live rank's (passed down the chain
unchanged); a file whose crc32 differs is copied from the disk instead. The live rollout rank
sends from its own model directory a few chunks per turn of its loop (`PeerFeed.progress`), so its engine goes on
generating meanwhile.

A feeder that dies or stalls (nothing for STALL_S) mid-transfer: the joiner says so in one line and reads the
rest from the disk (the job's model directory), which it writes and forwards the same way, so a chain behind it
goes on. A joiner with no live rollout rank to feed it (none, or `join_weights: disk`) reads the disk as before.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import time
import zlib
from pathlib import Path

CHUNK_BYTES = 4 << 20
"""Bytes per chunk (the last chunk of a file is shorter)."""
WINDOW = 16
"""Chunks a sender keeps in flight (64 MiB): the live rank posts this many per turn of its loop at most."""
STALL_S = 60.0
"""A feeder that sends nothing for this long counts as lost (its death is normally reported at once by MPI)."""
TAG_MANIFEST, TAG_CHUNK, TAG_SUMS = 23, 24, 25


def manifest(model_dir: Path) -> list[tuple[str, int]]:
    """Every regular file under `model_dir` (relative path, size), in a fixed order."""
    model_dir = Path(model_dir)
    return [(str(p.relative_to(model_dir)), p.stat().st_size)
            for p in sorted(model_dir.rglob("*")) if p.is_file() and not p.is_symlink()]


def local_weights_dir(run_dir: Path, rank: int) -> Path:
    """Where a joiner keeps the files it received: node-local tmp ($TMPDIR, else /tmp), one dir per run and rank
    (removed when the rank ends)."""
    tag = hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:10]
    return Path(os.environ.get("TMPDIR") or "/tmp") / f"marlaas-base-{tag}-rank{rank}"


def chunks_of(model_dir: Path, files: list[tuple[str, int]], start: tuple[int, int] = (0, 0), ring=None):
    """(file index, chunk) over `files` read from `model_dir`, from file index / offset `start` on; each chunk read
    into the next buffer of `ring` (a _Ring: no allocation per chunk), or a new bytes object without one."""
    first, offset = start
    for index in range(first, len(files)):
        name, size = files[index]
        with open(Path(model_dir) / name, "rb") as f:
            f.seek(offset)
            position = offset
            while position < size:
                want = min(CHUNK_BYTES, size - position)
                if ring is None:
                    chunk = f.read(want)
                    got = len(chunk)
                else:
                    chunk = ring.take(want)
                    got = f.readinto(chunk)
                    chunk = chunk[:got]
                if not got:
                    raise OSError(f"{name} is shorter than {size} bytes")
                position += got
                yield index, chunk
        offset = 0


class _Ring:
    """WINDOW + 1 chunk buffers used in turn (allocating and zeroing a 4 MiB buffer per chunk cost more than the
    crc32 of it); a buffer is taken again only once the send that last carried it is done."""

    def __init__(self, sender: "WeightSender"):
        self.sender = sender
        self.buffers: list[bytearray | None] = [None] * (WINDOW + 1)
        self.requests: list = [None] * (WINDOW + 1)
        self.slot = -1

    def take(self, nbytes: int) -> memoryview:
        self.slot = (self.slot + 1) % len(self.buffers)
        request = self.requests[self.slot]
        while request is not None and not self.sender.completed(request):
            time.sleep(0.0002)
        if self.buffers[self.slot] is None or len(self.buffers[self.slot]) < nbytes:
            self.buffers[self.slot] = bytearray(max(nbytes, min(CHUNK_BYTES, 1 << 20)))
        return memoryview(self.buffers[self.slot])[:nbytes]

    def hold(self, request) -> None:
        """The send carrying the buffer taken last."""
        self.requests[self.slot] = request


class WeightSender:
    """One sender's side of a link: the manifest, the chunks in order (at most WINDOW in flight), the crc32s.
    A receiver that dies makes it `failed` (nothing more is sent)."""

    def __init__(self, link, peer: int = 0):
        self.link, self.peer = link, peer
        self.pending: list = []
        """(request, buffer): a buffer stays alive until its send completes."""
        self.failed: BaseException | None = None
        self.sent_bytes = 0

    def start(self, files: list[tuple[str, int]]) -> None:
        self._post(self.link.isend(files, dest=self.peer, tag=TAG_MANIFEST), None)

    def room(self) -> bool:
        """Completes what it can; True if another chunk may go out now."""
        if self.failed is not None:
            return True
        try:
            self.pending = [(req, buf) for req, buf in self.pending if not req.Test()]
        except Exception as exc:  # the receiver died: MPI_ERR_PROC_FAILED
            self.failed, self.pending = exc, []
        return len(self.pending) < WINDOW

    def push(self, chunk):
        """Sends one chunk, waiting for room first; returns its request (None once failed)."""
        from mpi4py import MPI

        while not self.room():
            time.sleep(0.0002)
        if self.failed is not None:
            return None
        request = self.link.Isend([chunk, MPI.BYTE], dest=self.peer, tag=TAG_CHUNK)
        self._post(request, chunk)
        self.sent_bytes += len(chunk)
        return request

    def completed(self, request) -> bool:
        """Whether one posted send is done (a failed link: every send counts as done)."""
        if self.failed is not None:
            return True
        try:
            return request.Test()
        except Exception as exc:  # the receiver died
            self.failed, self.pending = exc, []
            return True

    def finish(self, sums: list[int]) -> None:
        self._post(self.link.isend(sums, dest=self.peer, tag=TAG_SUMS), None)

    def done(self) -> bool:
        self.room()
        return not self.pending

    def wait(self) -> None:
        while not self.done():
            time.sleep(0.0005)

    def _post(self, request, buffer) -> None:
        if self.failed is None:
            self.pending.append((request, buffer))


class PeerFeed:
    """A live rollout rank sends its model directory to a joiner (`FeedWeights`), a few chunks per loop turn."""

    def __init__(self, link, model_dir: Path, peer: int = 0):
        self.link, self.model_dir = link, Path(model_dir)
        self.files = manifest(self.model_dir)
        self.sender = WeightSender(link, peer)
        self.sender.start(self.files)
        self.ring = _Ring(self.sender)
        self.chunks = chunks_of(self.model_dir, self.files, ring=self.ring)
        self.sums = [0] * len(self.files)
        self.all_posted = False

    def progress(self) -> bool:
        """Posts chunks while the window has room, at most WINDOW per call (a fast receiver must not keep the live
        rank's loop, and its engine, in one call for the whole model); True once everything is sent (or the joiner
        is gone)."""
        posted = 0
        while not self.all_posted and posted < WINDOW and self.sender.room() and self.sender.failed is None:
            item = next(self.chunks, None)
            if item is None:
                self.sender.finish(self.sums)
                self.all_posted = True
                break
            index, chunk = item
            self.sums[index] = zlib.crc32(chunk, self.sums[index])
            self.ring.hold(self.sender.push(chunk))
            posted += 1
        return self.sender.failed is not None or (self.all_posted and self.sender.done())

    def close(self) -> None:
        """The link ends (both sides disconnect); a joiner that died is just left."""
        if self.sender.failed is None:
            try:
                self.link.Disconnect()
            except Exception:  # it died after the last chunk
                pass


class WeightsReceived:
    """What a joiner got: where the files are, from whom, how many bytes from the peer, whether it fell back."""

    def __init__(self, path: Path, peer_bytes: int, fell_back: str | None, seconds: float):
        self.path, self.peer_bytes, self.fell_back, self.seconds = path, peer_bytes, fell_back, seconds


def receive_weights(link, out_dir: Path, disk_dir: Path, forward: WeightSender | None = None, peer: int = 0,
                    log=print, feeder: str = "the peer") -> WeightsReceived:
    """A joiner: receives the files over `link` into `out_dir`, forwarding each chunk to `forward` (the next joiner)
    as it comes, and checks sizes and crc32s. The feeder lost or stalled: one line, and the rest from `disk_dir`."""
    from mpi4py import MPI

    t0 = time.time()
    out_dir = Path(out_dir)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    fell_back, files, peer_bytes = None, None, 0
    try:
        files = _wait_obj(link, peer, TAG_MANIFEST)
    except _FeederLost as lost:
        fell_back = lost.why
        files = manifest(disk_dir)
    if forward is not None:
        forward.start(files)
    sums = [0] * len(files)
    at = (0, 0)  # the next file index and offset to be received
    status = MPI.Status()
    ring = _Ring(forward if forward is not None else WeightSender(None))
    for index, (name, size) in enumerate(files):
        target = out_dir / name
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "wb", buffering=0) as f:
            got = 0
            while got < size and fell_back is None:
                try:
                    _wait_probe(link, peer, TAG_CHUNK, status)
                    chunk = ring.take(status.Get_count(MPI.BYTE))
                    link.Recv([chunk, MPI.BYTE], source=peer, tag=TAG_CHUNK)
                except _FeederLost as lost:
                    fell_back = lost.why
                    break
                except Exception as exc:
                    fell_back = f"{type(exc).__name__}: {exc}"
                    break
                f.write(chunk)
                got += len(chunk)
                peer_bytes += len(chunk)
                sums[index] = zlib.crc32(chunk, sums[index])
                if forward is not None:
                    ring.hold(forward.push(chunk))
            at = (index, got)
            if fell_back is not None:
                break
    if fell_back is not None:
        log(f"[join] {feeder} lost while sending the base weights ({fell_back}; {peer_bytes / 2**20:.1f} of "
            f"{sum(s for _, s in files) / 2**20:.1f} MiB received): the rest from the disk ({disk_dir})")
        _rest_from_disk(disk_dir, files, at, out_dir, sums, forward, ring)
    else:
        try:
            theirs = _wait_obj(link, peer, TAG_SUMS)
        except _FeederLost as lost:  # every byte came, its crc32s did not: the sizes are checked below
            log(f"[join] {feeder} lost after the last chunk ({lost.why}): the base weights are checked by size only")
            theirs, fell_back = sums, lost.why
        bad = [name for (name, _), a, b in zip(files, sums, theirs) if a != b]
        if bad:  # the first sender's crc32s travel down the chain: a joiner checks what the live rank read
            log(f"[join] base weights from {feeder}: crc32 differs for {bad}: those files from the disk ({disk_dir})")
            for name in bad:
                shutil.copyfile(Path(disk_dir) / name, out_dir / name)
        sums = theirs
    for name, size in files:
        if (out_dir / name).stat().st_size != size:
            raise RuntimeError(f"base weights from {feeder}: {name} has {(out_dir / name).stat().st_size} bytes, "
                               f"not {size}")
    if forward is not None:
        forward.finish(sums)  # the feeder's crc32s (its own, after a fallback: part of it came from the disk)
    return WeightsReceived(out_dir, peer_bytes, fell_back, time.time() - t0)


def _rest_from_disk(disk_dir, files, at, out_dir, sums, forward, ring) -> None:
    """After a lost feeder: file `at[0]` from offset `at[1]` on, and every later file, from the disk."""
    for index, chunk in chunks_of(disk_dir, files, at, ring):
        target = Path(out_dir) / files[index][0]
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "ab", buffering=0) as f:
            f.write(chunk)
        sums[index] = zlib.crc32(chunk, sums[index])
        if forward is not None:
            ring.hold(forward.push(chunk))


class _FeederLost(Exception):
    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


def _wait_probe(link, peer: int, tag: int, status) -> None:
    """Waits until a message of `tag` is there; the feeder's death (an MPI error) or STALL_S of silence raise
    _FeederLost."""
    deadline = time.monotonic() + STALL_S
    while True:
        try:
            if link.Iprobe(source=peer, tag=tag, status=status):
                return
        except Exception as exc:
            raise _FeederLost(f"{type(exc).__name__}: {exc}") from None
        if time.monotonic() > deadline:
            raise _FeederLost(f"nothing for {STALL_S:.0f} s")
        time.sleep(0.0002)


def _wait_obj(link, peer: int, tag: int):
    from mpi4py import MPI

    _wait_probe(link, peer, tag, MPI.Status())
    try:
        return link.recv(source=peer, tag=tag)
    except Exception as exc:
        raise _FeederLost(f"{type(exc).__name__}: {exc}") from None
