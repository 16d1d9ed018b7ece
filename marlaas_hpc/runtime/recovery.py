"""Resume after a preemption or a crash: which checkpoint each task restarts from, and rolling the run dir's
append-only outputs (audit.jsonl, each task's metrics.jsonl) back to it, so that every version appears exactly
once however many runs it took.

    every rank:   choose_resume_points(comm, ...)   rank 0 names each unfinished task's candidate versions
                                                    (its `saved` record, then its `previous` one); every
                                                    trainer rank checks its own shards of them (sha256);
                                                    rank 0 keeps per task the newest candidate valid everywhere
    rank 0:       rollback_outputs(run_dir, state)  audit.jsonl and metrics.jsonl cut back to those versions
"""
from __future__ import annotations

import json
from pathlib import Path

from marlaas_hpc.runtime.checkpoint import CorruptCheckpoint, read_verified, trainer_shard_path
from marlaas_hpc.rundir import atomic_write_text

CRASH_FILE = "crash.json"
"""RUN_DIR/crash.json: the last crash, written by the supervisor (launch/supervise.py)."""


def _unfinished(entry: dict) -> bool:
    return entry["saved"]["status"] in ("queued", "running")


def shard_candidates(state: dict) -> dict[str, tuple[dict, list[int]]]:
    """task -> (spec, versions to try, newest first) for every unfinished task that has shards."""
    out = {}
    for task_id, entry in state["tasks"].items():
        if not _unfinished(entry):
            continue
        versions = [r["version"] for r in (entry["saved"], entry.get("previous")) if r and r["version"] is not None]
        if versions:
            out[task_id] = (entry["spec"], versions)
    return out


def check_my_shards(run_dir: Path, candidates: dict, shard: str) -> dict[str, dict[int, str | None]]:
    """On a trainer rank: task -> version -> None (its shard verifies) or why not."""
    from marlaas_hpc.tasks import TaskSpec

    out: dict[str, dict[int, str | None]] = {}
    for task_id, (spec, versions) in candidates.items():
        spec = TaskSpec.from_dict(spec)
        out[task_id] = {}
        for version in versions:
            try:
                read_verified(trainer_shard_path(run_dir, spec, shard, version))
                out[task_id][version] = None
            except CorruptCheckpoint as exc:
                out[task_id][version] = str(exc)
    return out


def choose_resume_points(comm, run_dir: Path, state: dict | None, trainer_ranks: list[int], shard: str | None,
                         log=print) -> dict | None:
    """Collective over the world (a resume only). Rank 0 returns `state` with each unfinished task's `saved`
    record replaced by the newest one whose shards verify on every trainer rank; a task with none fails alone
    (no other task is held back)."""
    rank = comm.Get_rank()
    candidates = comm.bcast(shard_candidates(state) if rank == 0 else None, root=0)
    mine = check_my_shards(run_dir, candidates, shard) if rank in trainer_ranks else None
    reports = comm.gather(mine, root=0)
    if rank != 0:
        return None
    reports = [r for r in reports if r is not None]
    for task_id, (_, versions) in candidates.items():
        problems = {v: [r[task_id][v] for r in reports if r[task_id][v]] for v in versions}
        _resume_point(state["tasks"][task_id], task_id, versions, problems, log)
    return state


def _resume_point(entry: dict, task_id: str, versions: list[int], problems: dict[int, list[str]], log) -> None:
    if not problems[versions[0]]:
        return
    previous = entry.get("previous")
    if previous is not None and (previous["version"] is None or not problems.get(previous["version"])):
        start = "its start (v0)" if previous["version"] is None else f"its previous checkpoint v{previous['version']}"
        log(f"[job] {problems[versions[0]][0]}: {task_id} resumes from {start}")
        entry["saved"], entry["previous"] = previous, None
        return
    reason = "; ".join(p for v in versions for p in problems.get(v, []))
    log(f"[job] {task_id}: no usable checkpoint ({reason}); the task fails, the others go on")
    entry["saved"] = {**entry["saved"], "status": "failed", "error": f"no usable checkpoint: {reason}"}


def resumed_versions(state: dict) -> dict[str, int]:
    """task -> the version it resumes at (or ended at): what the outputs are rolled back to."""
    return {task_id: entry["saved"]["version"] or 0 for task_id, entry in state["tasks"].items()}


def rollback_outputs(run_dir: Path, state: dict) -> list:
    """Cuts audit.jsonl and every task's metrics.jsonl back to the versions resumed from (steps trained after a
    task's checkpoint by a run that then crashed are trained again, and must appear once). Returns the audit
    records kept, one per trained group, in file order."""
    from marlaas_hpc.rundir import task_dir
    from marlaas_hpc.tasks import TaskSpec

    versions = resumed_versions(state)
    records = _rollback_audit(Path(run_dir) / "audit.jsonl", versions)
    for task_id, entry in state["tasks"].items():
        cut_jsonl(task_dir(run_dir, TaskSpec.from_dict(entry["spec"])) / "metrics.jsonl",
                   lambda row, v=versions[task_id]: row.get("version", 0) <= v)
    return records


def _rollback_audit(path: Path, versions: dict[str, int]) -> list:
    from marlaas_hpc.scheduler import AuditRecord

    kept = cut_jsonl(path, lambda row: row.get("trained_into", 0) <= versions.get(row.get("task_id"), -1))
    records: dict[tuple[str, str], AuditRecord] = {}
    for row in kept:
        key = (row["task_id"], row["group_id"])
        if key not in records:
            records[key] = AuditRecord(row["task_id"], row["group_id"], row["behaviour_version"],
                                       row["trained_into"], row["bound"])
    return list(records.values())


def cut_jsonl(path: Path, keep) -> list[dict]:
    """Keeps the rows of a JSONL file for which keep(row) holds (a torn last line, cut by a crash mid-write, is
    dropped); rewrites the file atomically if anything went. Returns the rows kept."""
    if not path.is_file():
        return []
    rows, dropped = [], False
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            dropped = True
            continue
        if keep(row):
            rows.append(row)
        else:
            dropped = True
    if dropped:
        atomic_write_text(path, "".join(json.dumps(row) + "\n" for row in rows))
    return rows


def crashed_run(state: dict, run_dir: Path) -> dict | None:
    """The run the checkpoint was last written by, if it did not end by a preemption (it crashed): its record
    for the history of runs, with the cause the supervisor wrote to crash.json when there is one."""
    current = state.get("current_run")
    if not current:
        return None
    ended, cause = state["saved_at"], "unknown (no crash report: the job was killed from outside, or its " \
                                      "launcher died)"
    path = Path(run_dir) / CRASH_FILE
    if path.is_file():
        try:
            crash = json.loads(path.read_text())
        except json.JSONDecodeError:
            crash = {}
        if crash.get("time", 0) >= current["started"]:
            ended, cause = crash["time"], crash.get("message", cause)
    return {**current, "wall_time_s": max(0.0, ended - current["started"]), "ended": "crashed", "cause": cause}
