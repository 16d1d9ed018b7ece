"""Rank 0's records: what a resume restarts from, kept as an append-only journal of keyed records.

    RUN_DIR/checkpoint/records.jsonl        the journal: rank 0 appends one line per change
    RUN_DIR/checkpoint/records.jsonl.prev   the journal as it was before its last compaction

A line is `<crc32 of the JSON text, 8 hex digits> <JSON object>\\n`, the object

    {"seq": 812, "at": 1795624901.2, "kind": "task", "id": "add", "value": {...}}

- `seq` counts the records up (a resumed run goes on from the highest it read), `at` is the unix time;
- (`kind`, `id`) is the record's key; its `value` replaces the value of every older record of that key.

The state a resume starts from is, per key, the value of the valid record with the highest seq, read from both
files (`read_records`); `REPLAY` turns each kind into its part of the state:

    kind          id                 value                                    state
    format        "records"          FORMAT                                   checked: another format is refused
    task          task id            {"spec", "saved", "previous"}            tasks[id]: TaskState.checkpoint()
                                                                              at the newest save and the one before
    eval          "<task>/<when>"    {"task_id", "when", "scores"}            evals (when: before / after)
    rejected      task id or file    the reason                               rejected[id]
    runs          "job"              earlier runs, oldest first               runs
    current_run   "job"              this run's start, or None                current_run (a crash's history)
    finished      "job"              true once the job has ended              finished: nothing to resume
    rank_lost     its own seq        {"rank", "role", "at", "cause", ...}     ranks_lost (a history: every one kept)
    rank_joined   its own seq        {"rank", "role", "at", "start_s"}        ranks_joined (history)
    rank_left     its own seq        {"rank", "role", "at", "why"}            ranks_left (history: drained ranks)

Why a journal. A change (a task submitted, saved, ended or rolled back; an eval done; a spec refused) is one
line, so its cost does not grow with the number of tasks; the whole file used to be encoded and rewritten on
each (1.7 MB at 1024 tasks, most of rank 0's time). Per-task files would be O(1) too, but cost a file create and
two renames per change (metadata operations, slow on a shared filesystem), and events that are not about one
task (a rank lost or joined, issue 25) would have no file of their own: here they are one more kind.

Crash safety. A record is written with one `os.write` before any command that depends on it goes out, so a
rank that dies keeps every record the others may have acted on (no fsync per record: like the whole-file write
before it, the journal is safe against a process crash, and a node crash may lose its newest lines). A line that
is cut short (a crash mid-write) or damaged (crc or JSON) is skipped with a warning: its key falls back to its
record before, as a damaged scheduler.json fell back to its `.prev` copy, but per key: a task falls back to its
previous save, whose shards the trainers keep (KEEP_SHARDS).

Compaction. Once more lines were appended than twice the number of keys (and at least COMPACT_MIN), rank 0
writes the newest line of each key (kept in memory as written: nothing is encoded again) to a new file, fsyncs
it, renames the journal to `.prev` and the new file to the journal. Its cost, O(keys), is paid at most once per
2 x keys appended lines: O(1) per change. A crash between the renames leaves `.prev` holding every record; a
crash before them leaves the files as they were. The start of a run and its end each compact once.

Extending it. A new kind is a name in REPLAY with the function that applies its value to the state, and the
code that appends its records; a kind whose records are a history rather than a state (e.g. a rank lost)
gives each record its own id (say its seq), so that compaction keeps them all.
"""
from __future__ import annotations

import json
import os
import time
import zlib
from pathlib import Path
from typing import Callable

FORMAT = 3
JOURNAL = "records.jsonl"
COMPACT_MIN = 1024
"""Lines appended before a compaction is considered (small jobs never compact between their start and end)."""


def checkpoint_file(run_dir: Path) -> Path:
    """Rank 0's journal (what a resume starts from)."""
    return Path(run_dir) / "checkpoint" / JOURNAL


def _previous_file(path: Path) -> Path:
    return path.with_name(path.name + ".prev")


def encode_line(seq: int, at: float, kind: str, record_id: str, value) -> str:
    text = json.dumps({"seq": seq, "at": at, "kind": kind, "id": record_id, "value": value})
    return f"{zlib.crc32(text.encode()):08x} {text}\n"


def decode_line(line: str) -> dict:
    """The record of one journal line; ValueError says why a line is not one (cut short, damaged)."""
    if not line.endswith("\n"):
        raise ValueError("cut short (no end of line)")
    crc, _, text = line[:-1].partition(" ")
    if len(crc) != 8 or f"{zlib.crc32(text.encode()):08x}" != crc:
        raise ValueError("crc mismatch")
    record = json.loads(text)
    if not isinstance(record, dict) or not {"seq", "kind", "id", "value"} <= record.keys():
        raise ValueError("not a record")
    return record


class Journal:
    """The writing side: appends records, keeps each key's newest line, compacts when due."""

    def __init__(self, path: Path, seq: int = 0, clock: Callable[[], float] = time.time):
        self.path, self.seq, self.clock = Path(path), seq, clock
        self.latest: dict[tuple[str, str], tuple[int, str]] = {}
        """(kind, id) -> the seq and line of its newest record, as written."""
        self.appended = 0
        """Lines appended since the last compaction."""
        self.bytes_written = 0
        self.fd: int | None = None

    def put(self, kind: str, record_id: str, value, write: bool = True) -> None:
        """Records the key's new value; write=False keeps it for the next compaction only (a start's tasks,
        written together once they are all in)."""
        self.seq += 1
        line = encode_line(self.seq, self.clock(), kind, record_id, value)
        self.latest[(kind, record_id)] = (self.seq, line)
        if write:
            if self.fd is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            data = line.encode()
            os.write(self.fd, data)  # one call: never interleaved with another record
            self.bytes_written += len(data)
            self.appended += 1

    def compaction_due(self) -> bool:
        return self.appended >= max(COMPACT_MIN, 2 * len(self.latest))

    def compact(self) -> None:
        """The newest line of each key, in seq order, as the new journal (see the module docstring)."""
        data = "".join(line for _, line in sorted(self.latest.values())).encode()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        with open(tmp, "wb") as sink:
            sink.write(data)
            sink.flush()
            os.fsync(sink.fileno())
        self.close()
        if self.path.exists():
            os.replace(self.path, _previous_file(self.path))
        os.replace(tmp, self.path)
        self.bytes_written += len(data)
        self.appended = 0

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


# ---- reading ----
def _empty_state() -> dict:
    return {"format": FORMAT, "saved_at": 0.0, "finished": False, "runs": [], "current_run": None, "tasks": {},
            "evals": [], "rejected": {}, "ranks_lost": [], "ranks_joined": [], "ranks_left": [], "seq": 0,
            "records": {}}


def _check_format(state: dict, record_id: str, value) -> None:
    if value != FORMAT:
        raise ValueError(f"checkpoint format {value}, this version reads {FORMAT}")


REPLAY: dict[str, Callable[[dict, str, object], None]] = {
    "format": _check_format,
    "task": lambda state, task_id, value: state["tasks"].__setitem__(task_id, value),
    "eval": lambda state, _, value: state["evals"].append(value),
    "rejected": lambda state, key, reason: state["rejected"].__setitem__(key, reason),
    "runs": lambda state, _, runs: state.__setitem__("runs", list(runs)),
    "current_run": lambda state, _, run: state.__setitem__("current_run", run),
    "finished": lambda state, _, finished: state.__setitem__("finished", bool(finished)),
    "rank_lost": lambda state, _, loss: state["ranks_lost"].append(loss),
    "rank_joined": lambda state, _, join: state["ranks_joined"].append(join),
    "rank_left": lambda state, _, left: state["ranks_left"].append(left),
}
"""Record kind -> how its value enters the state (records are applied in seq order, newest per key only)."""


def read_records(run_dir: Path, warn: Callable[[str], None] | None = None) -> dict | None:
    """Every key's newest valid record from the journal and its `.prev`, as the state dict (finished or not;
    `records`: (kind, id) -> value of every key, in seq order); None if neither file exists. A damaged line
    is skipped (its key keeps its record before) with a warning."""
    path = checkpoint_file(run_dir)
    newest: dict[tuple[str, str], dict] = {}
    problems, found = [], False
    for candidate in (_previous_file(path), path):
        if not candidate.is_file():
            continue
        found = True
        with open(candidate, encoding="utf-8", errors="replace", newline="") as source:
            for number, line in enumerate(source, 1):
                try:
                    record = decode_line(line)
                except ValueError as exc:  # json.JSONDecodeError is one
                    problems.append(f"{candidate} line {number} is unreadable ({exc})")
                    continue
                key = (record["kind"], str(record["id"]))
                if key not in newest or newest[key]["seq"] < record["seq"]:
                    newest[key] = record
    if not found:
        return None
    if problems and warn:
        warn(f"{problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
             + ": skipped; what it recorded falls back to the record before it")
    if newest and ("format", "records") not in newest:
        raise ValueError(f"{path}: no format record (not a journal of this tool, or every copy is damaged)")
    state = _empty_state()
    for record in sorted(newest.values(), key=lambda r: r["seq"]):
        replay = REPLAY.get(record["kind"])
        if replay is None:
            raise ValueError(f"{path}: record kind {record['kind']!r} is unknown to this version")
        try:
            replay(state, str(record["id"]), record["value"])
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        state["records"][(record["kind"], str(record["id"]))] = record["value"]
        state["saved_at"] = max(state["saved_at"], float(record.get("at", 0.0)))
        state["seq"] = record["seq"]
    return state


def load_job_checkpoint(run_dir: Path, warn: Callable[[str], None] | None = None) -> dict | None:
    """The state a resume starts from (`read_records`). None: nothing to resume (no records, or the job
    finished)."""
    state = read_records(run_dir, warn)
    return None if state is None or state["finished"] else state


# ---- rank 0's book ----
class JobRecords:
    """Rank 0's book of what a resume restarts from, updated as things happen: a task submitted, saved, ended;
    an eval done; a spec refused. Each change appends one record (O(1)); `compact` writes the whole state."""

    def __init__(self, run_dir: Path, resume: dict | None = None, clock: Callable[[], float] = time.time):
        self.run_dir = Path(run_dir)
        self.journal = Journal(checkpoint_file(run_dir), seq=resume.get("seq", 0) if resume else 0, clock=clock)
        self.tasks: dict[str, dict] = dict(resume["tasks"]) if resume else {}
        self.runs: list[dict] = list(resume["runs"]) if resume else []
        """Earlier runs of this job (each ended by a preemption or a crash), oldest first."""
        self.current_run: dict | None = None
        self.journal.put("format", "records", FORMAT, write=False)
        for (kind, record_id), value in (resume or {}).get("records", {}).items():
            if kind != "format":  # every key read goes on, kinds this class never writes included
                self.journal.put(kind, record_id, value, write=False)

    def _task(self, task_id: str) -> None:
        self.journal.put("task", task_id, self.tasks[task_id])

    def submitted(self, task) -> None:
        if task.task_id not in self.tasks:
            self.tasks[task.task_id] = {"spec": task.spec.to_dict(), "saved": task.checkpoint(), "previous": None}
            self._task(task.task_id)

    def saved(self, task) -> None:
        """The task's shards at its current version are on disk (every TP rank)."""
        entry = self.tasks[task.task_id]
        entry["previous"], entry["saved"] = entry["saved"], task.checkpoint()
        self._task(task.task_id)

    def ended(self, task) -> None:
        self.tasks[task.task_id]["saved"] = task.checkpoint()
        self._task(task.task_id)

    def eval_done(self, task_id: str, when: str, scores: list[float]) -> None:
        self.journal.put("eval", f"{task_id}/{when}", {"task_id": task_id, "when": when, "scores": list(scores)})

    def rejected(self, key: str, reason: str) -> None:
        self.journal.put("rejected", key, reason)

    def rank_lost(self, loss: dict) -> None:
        """A rank lost in the live job (runtime/scheduler_rank.py): a record of its own (`loss["id"]`, given the
        first time), written again under that id once its cause is known."""
        self.history("rank_lost", loss)

    def history(self, kind: str, record: dict) -> None:
        """A record of a history kind (rank_lost, rank_joined, rank_left): its own id, its seq the first time."""
        record.setdefault("id", str(self.journal.seq + 1))
        self.journal.put(kind, record["id"], record)

    def open_run(self, started: float, startup_s: float) -> None:
        """This run's start on record (a crash's history needs it), with what the resume read (choose_resume_points
        may have sent a task back to its previous save): one compaction, a resume's one pass over its tasks."""
        self.current_run = {"started": started, "startup_s": startup_s}
        self.journal.put("runs", "job", self.runs, write=False)
        self.journal.put("current_run", "job", self.current_run, write=False)
        self.journal.put("finished", "job", False, write=False)
        self.journal.compact()

    def maybe_compact(self) -> bool:
        if not self.journal.compaction_due():
            return False
        self.journal.compact()
        return True

    def close_run(self, run: dict, finished: bool) -> None:
        """The end of this run (finished, or preempted: resumable): its history, then one compaction."""
        self.runs.append(run)
        self.current_run = None
        for kind, value in (("runs", self.runs), ("current_run", None), ("finished", finished)):
            self.journal.put(kind, "job", value, write=False)
        self.journal.compact()
        self.journal.close()
