"""`marlaas tasks add|ls|cancel|close --run RUN_DIR`: talk to a running job through its run dir (on the shared
filesystem, so the same commands work for local and Slurm jobs)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import yaml

from marlaas_hpc.service.identity import user_name
from marlaas_hpc.service.intake import JOB_FILE, IntakeRules, check_spec
from marlaas_hpc.service.queue import TaskQueue
from marlaas_hpc.service.quotas import TaskRecord
from marlaas_hpc.tasks.spec import SpecError

ENDED = ("done", "failed", "cancelled")


def _fail(message: str, code: int = 2) -> int:
    print(f"marlaas: {message}", file=sys.stderr)
    return code


def job_state(run_dir: Path) -> dict:
    """The job's task table: summary.json once finished, else the live status.json ({} before any)."""
    for name in ("summary.json", "status.json"):
        path = run_dir / name
        if path.is_file():
            return json.loads(path.read_text())
    return {}


def known_tasks(run_dir: Path) -> list[TaskRecord]:
    """Tasks of the run (status.json) plus those queued but not yet in it (pending or just accepted)."""
    records = {task_id: TaskRecord(task_id, t["tenant"], t["total_steps"], t["status"])
               for task_id, t in job_state(run_dir).get("tasks", {}).items()}
    for spec in waiting_specs(TaskQueue(run_dir)):
        task_id = str(spec.get("task_id"))
        if task_id not in records:
            records[task_id] = TaskRecord(task_id, str(spec.get("tenant", "default")),
                                          int(spec.get("total_steps", 0) or 0), "pending")
    return list(records.values())


def waiting_specs(queue: TaskQueue) -> list[dict]:
    """Specs in the queue that the job's status may not list yet: pending, then accepted by rank 0. Read after the
    status and in this order, none is missed while rank 0 takes it: a spec moves from pending to accepted, and
    accepted files stay."""
    waiting = [e.data["spec"] for e in queue.pending() if e.data and isinstance(e.data.get("spec"), dict)]
    return waiting + [r["spec"] for r in queue.records("accepted") if isinstance(r.get("spec"), dict)]


def job_finished(run_dir: Path) -> bool:
    """The job that wrote job.json has written its summary (an older summary of a reused run dir does not count)."""
    summary = run_dir / "summary.json"
    return summary.is_file() and summary.stat().st_mtime >= (run_dir / JOB_FILE).stat().st_mtime


def cmd_add(args) -> int:
    run_dir, spec_path = Path(args.run), Path(args.spec)
    if not (run_dir / JOB_FILE).is_file():
        return _fail(f"{run_dir} has no {JOB_FILE}: no job has started there yet (rank 0 writes it at start)")
    if job_finished(run_dir) or TaskQueue(run_dir).closed(owners={IntakeRules.load(run_dir).owner_uid, 0}):
        return _fail(f"the job of {run_dir} has {'finished' if job_finished(run_dir) else 'been closed'}"
                     "; it takes no more tasks")
    try:
        data = yaml.safe_load(spec_path.read_text())
        rules = IntakeRules.load(run_dir)
        spec = check_spec(data, rules, known_tasks(run_dir), base_dir=spec_path.resolve().parent,
                          owner_uid=os.getuid())
        from marlaas_hpc.env.tenant_code import check_reward_code
        from marlaas_hpc.env import build_task_data

        # a missing or malformed data file is refused now, not later
        build_task_data(spec.dataset, spec.prompt.format, sandbox=rules.sandbox)
        check_reward_code(spec.dataset, rules.sandbox)  # loaded in a sandboxed worker, never here
    except (OSError, yaml.YAMLError) as exc:
        return _fail(f"cannot read spec {spec_path}: {exc}")
    except (SpecError, ValueError) as exc:
        return _fail(f"spec {spec_path} refused, nothing queued: {exc}")
    path = TaskQueue(run_dir).add(spec.to_dict(), source=str(spec_path.resolve()))
    print(f"queued task {spec.task_id!r} (tenant {spec.tenant!r}): {path}")
    return 0


def cmd_ls(args) -> int:
    run_dir = Path(args.run)
    state = job_state(run_dir)
    queue = TaskQueue(run_dir)
    if not state and not (run_dir / "queue").is_dir():
        return _fail(f"{run_dir} is not a run dir (no status.json, summary.json or queue/)")
    print(f"{'task':<16} {'tenant':<10} {'state':<10} {'version':>9} {'reward':>7} {'TTFS_s':>7}")
    for task_id, t in state.get("tasks", {}).items():
        reward = "-" if t["reward_last"] is None else f"{t['reward_last']:.3f}"
        ttfs = "-" if t["ttfs_s"] is None else f"{t['ttfs_s']:.1f}"
        print(f"{task_id:<16} {t['tenant']:<10} {t['status']:<10} {t['steps_done']:>4}/{t['total_steps']:<4} "
              f"{reward:>7} {ttfs:>7}" + (f"  {t['error']}" if t.get("error") else ""))
    listed = set(state.get("tasks", {}))
    for spec in waiting_specs(queue):
        if spec.get("task_id") not in listed:
            listed.add(spec.get("task_id"))
            print(f"{spec['task_id']:<16} {spec.get('tenant', 'default'):<10} {'queued':<10} "
                  f"{0:>4}/{spec.get('total_steps', '?'):<4} {'-':>7} {'-':>7}  (not yet in the job's status)")
    for record in queue.records("rejected"):
        spec = record.get("spec") if isinstance(record.get("spec"), dict) else {}
        print(f"{str(spec.get('task_id', '?')):<16} {str(spec.get('tenant', '?')):<10} {'rejected':<10} "
              f"{'-':>9} {'-':>7} {'-':>7}  {record.get('reason')}")
    return 0


def cmd_cancel(args) -> int:
    run_dir = Path(args.run)
    known = {t.task_id: t for t in known_tasks(run_dir)}
    if args.task_id not in known:
        return _fail(f"no task {args.task_id!r} in {run_dir}")
    if known[args.task_id].state in ENDED:
        return _fail(f"task {args.task_id!r} has already ended ({known[args.task_id].state})", 1)
    if (run_dir / JOB_FILE).is_file():
        try:
            IntakeRules.load(run_dir).check_owner(os.getuid(), known[args.task_id].tenant, "cancel tasks of")
        except SpecError as exc:
            return _fail(f"cancel of {args.task_id!r} refused: {exc}")
    TaskQueue(run_dir).request_cancel(args.task_id)
    print(f"cancel of {args.task_id!r} requested: it stops at its next step boundary and keeps its last adapter")
    return 0


def cmd_close(args) -> int:
    run_dir = Path(args.run)
    if not (run_dir / JOB_FILE).is_file():
        return _fail(f"{run_dir} has no {JOB_FILE}: not a started run dir")
    owner = IntakeRules.load(run_dir).owner_uid
    if os.getuid() not in (owner, 0):
        return _fail(f"only the job's owner ({user_name(owner)!r}) may close it")
    TaskQueue(run_dir).close()
    print(f"{run_dir}: closed; the job takes no more tasks and ends once its tasks have ended")
    return 0


def add_tasks_parser(sub) -> None:
    """Registers `marlaas tasks ...` on the main parser's subcommands."""
    tasks = sub.add_parser("tasks", help="add / list / cancel tasks of a running job, or close it")
    verbs = tasks.add_subparsers(dest="verb", required=True)
    for name, func, helptext in (("add", cmd_add, "validate a TaskSpec YAML and queue it into the job"),
                                 ("ls", cmd_ls, "each task's tenant, state, version, reward, TTFS"),
                                 ("cancel", cmd_cancel, "stop a task at its next step boundary"),
                                 ("close", cmd_close, "stop serving: the job ends once its tasks have ended")):
        verb = verbs.add_parser(name, help=helptext)
        if name == "add":
            verb.add_argument("spec", help="TaskSpec YAML (fields of marlaas_hpc.tasks.TaskSpec)")
        if name == "cancel":
            verb.add_argument("task_id")
        verb.add_argument("--run", required=True, help="the job's run dir")
        verb.set_defaults(func=func)
