"""The run's intake queue: a directory on the shared filesystem that submitters write and rank 0 drains.

    RUN_DIR/queue/<ns>-<task_id>.json      pending specs, one per file, written tmp + rename (never half-read)
    RUN_DIR/queue/accepted/<same name>     taken by rank 0 and submitted to the scheduler
    RUN_DIR/queue/rejected/<same name>     refused by rank 0; the file gains a "reason"
    RUN_DIR/queue/cancel/<task_id>@<ns>    cancel requests (one file per request); moved to cancel/done/ once
                                           applied or refused
    RUN_DIR/queue/CLOSE                    stop marker: the job stops serving once its tasks have ended
    RUN_DIR/job.json                       the running job's config (written by rank 0): what `tasks add` checks against

Names sort in submission order (nanosecond prefix), so rank 0 sees pending specs first come, first served.
Every move is a rename within the queue dir, so a file is never lost and never admitted twice. queue/ and
queue/cancel/ are sticky and world-writable (service/identity.py): the owner of a file is who asked."""
from __future__ import annotations

import json
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from marlaas_hpc.rundir import atomic_write_text


@dataclass
class QueueEntry:
    path: Path
    """The pending file."""
    data: dict | None
    """{"spec": {...}, "added_at": unix seconds, "source": spec file}; None if unreadable."""
    error: str | None = None
    owner_uid: int | None = None
    """Who created the file (fstat of the opened file): the identity its tenant is checked against."""

    @property
    def name(self) -> str:
        return self.path.name


class TaskQueue:
    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / "queue"

    # ---- submitter side ----
    def add(self, spec: dict, source: str | None = None) -> Path:
        """Drops a validated spec into the queue atomically; returns the pending file."""
        name = f"{time.time_ns():020d}-{spec['task_id']}.json"
        path = self.root / name
        atomic_write_text(path, json.dumps({"spec": spec, "added_at": time.time(), "source": source}, indent=1))
        return path

    def request_cancel(self, task_id: str) -> Path:
        path = self.root / "cancel" / f"{task_id}@{time.time_ns()}"
        atomic_write_text(path, json.dumps({"requested_at": time.time()}))
        return path

    def close(self) -> Path:
        path = self.root / "CLOSE"
        atomic_write_text(path, json.dumps({"closed_at": time.time()}))
        return path

    def closed(self, owners: set[int] | None = None) -> bool:
        """The stop marker is there (and, with `owners`, was written by one of those uids: nobody else may
        close the job)."""
        path = self.root / "CLOSE"
        if owners is None:
            return path.is_file()
        try:
            return read_owned(path)[1] in owners
        except OSError:
            return False

    # ---- rank 0 side ----
    def prepare(self) -> None:
        """Creates the dirs submitters write to: sticky and world-writable, like /tmp."""
        for folder in (self.root, self.root / "cancel"):
            folder.mkdir(parents=True, exist_ok=True)
            os.chmod(folder, 0o1777)

    def pending(self) -> list[QueueEntry]:
        """Pending specs in submission order (temporary files of writers in progress are skipped)."""
        if not self.root.is_dir():
            return []
        entries = []
        for path in sorted(p for p in self.root.iterdir() if p.suffix == ".json" and not p.name.startswith(".")
                           and (p.is_symlink() or p.is_file())):
            try:
                text, owner = read_owned(path)
                entries.append(QueueEntry(path, json.loads(text), owner_uid=owner))
            except (OSError, ValueError) as exc:
                entries.append(QueueEntry(path, None, f"unreadable queue file: {exc}"))
        return entries

    def accept(self, entry: QueueEntry) -> None:
        self._move(entry.path, self.root / "accepted" / entry.name)

    def reject(self, entry: QueueEntry, reason: str) -> None:
        record = dict(entry.data or {}, reason=reason, rejected_at=time.time())
        atomic_write_text(self.root / "rejected" / entry.name, json.dumps(record, indent=1))
        entry.path.unlink(missing_ok=True)

    def cancel_requests(self) -> list[str]:
        """Task ids with a pending cancel request."""
        return sorted({task_id for _, task_id, _ in self.cancel_entries()})

    def cancel_entries(self) -> list[tuple[Path, str, int | None]]:
        """(file, task id, owner uid or None if unreadable) of every pending cancel request, oldest first."""
        folder = self.root / "cancel"
        if not folder.is_dir():
            return []
        out = []
        for path in sorted(folder.iterdir(), key=lambda p: p.name.partition("@")[2]):
            if path.name.startswith(".") or not (path.is_symlink() or path.is_file()):
                continue
            try:
                owner = read_owned(path)[1]
            except OSError:
                owner = None
            out.append((path, path.name.partition("@")[0], owner))
        return out

    def cancel_done(self, path: Path) -> None:
        self._move(path, self.root / "cancel" / "done" / f"{path.name}-{time.time_ns()}")

    def records(self, folder: str) -> list[dict]:
        """Accepted or rejected entries (for `tasks ls`)."""
        where = self.root / folder
        if not where.is_dir():
            return []
        out = []
        for path in sorted(where.glob("*.json")):
            try:
                out.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
        return out

    @staticmethod
    def _move(src: Path, dst: Path) -> None:
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.replace(src, dst)


def read_owned(path: Path, limit: int = 1 << 20) -> tuple[str, int]:
    """(text, owner uid) of a regular file, owner and content from the same open file; a symlink or anything
    but a regular file is refused (OSError), so nobody can pass another user's file off as their own."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{path.name} is not a regular file")
        data = os.read(fd, limit + 1)
        if len(data) > limit:
            raise OSError(f"{path.name} is larger than {limit} bytes")
        return data.decode("utf-8"), info.st_uid
    finally:
        os.close(fd)
