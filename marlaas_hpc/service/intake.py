"""Checking a spec against the running job (shared by `marlaas tasks add` and rank 0), and rank 0's side of
the queue: taking pending specs and cancel requests, and deciding how long a serving job stays up."""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from marlaas_hpc.config_loader import SpecError, load_config
from marlaas_hpc.env.tenant_code import SandboxConfig
from marlaas_hpc.rundir import atomic_write_text
from marlaas_hpc.service.identity import TenantOwners, check_tenant, user_name
from marlaas_hpc.service.isolation import (allowed_roots, check_data_paths, check_reward_file, check_unique_id,
                                          resolve_data_paths)
from marlaas_hpc.service.queue import QueueEntry, TaskQueue
from marlaas_hpc.service.quotas import TaskRecord, TenantQuota, check_quota
from marlaas_hpc.tasks.spec import TaskSpec, check_base_model, check_trained

JOB_FILE = "job.json"


@dataclass
class IntakeRules:
    """What a spec entering a running job is checked against (rank 0 writes them to RUN_DIR/job.json)."""

    model: str
    """The job's (first) base model's path."""
    max_lora_rank: int
    data_roots: list[str]
    models: dict[str, str] = field(default_factory=dict)
    """The job's base models by name (JobConfig.model_names); a spec's base_model must name one (or be None).
    Empty (a job.json written before models existed): the one model `model`."""
    trainer_group_models: list[str] = field(default_factory=list)
    """The model each trainer group loads (JobConfig.group_models): a spec's model must have one. Empty (a
    job.json written before groups owned a model): not checked."""
    tenant_quotas: dict[str, TenantQuota] = field(default_factory=dict)
    run_dir: str = "."
    serve_idle_s: float = 0.0
    owner_uid: int = field(default_factory=os.getuid)
    """The job's owner (the uid running rank 0): may add and cancel tasks of every tenant."""
    tenants: dict[str, TenantOwners] = field(default_factory=dict)
    """Tenant -> the Unix users / groups that may act as it (JobConfig.tenants)."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """How tenant code is checked at intake (the env ranks run it under the same settings)."""

    @classmethod
    def from_job(cls, job, run_dir: str | Path) -> "IntakeRules":
        return cls(model=job.model, models=job.model_names(), trainer_group_models=job.group_models(),
                   max_lora_rank=job.max_lora_rank,
                   data_roots=list(job.data_roots),
                   tenant_quotas=dict(job.tenant_quotas), run_dir=str(Path(run_dir).resolve()),
                   serve_idle_s=job.serve_idle_s, tenants=dict(job.tenants), sandbox=job.sandbox)

    def save(self) -> None:
        atomic_write_text(Path(self.run_dir) / JOB_FILE, json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, run_dir: str | Path) -> "IntakeRules":
        return load_config(cls, json.loads((Path(run_dir) / JOB_FILE).read_text()), root=JOB_FILE)

    def check_owner(self, uid: int, tenant: str, doing: str = "add tasks as") -> None:
        """SpecError (field `tenant`) unless the Unix user `uid` may act as `tenant`."""
        check_tenant(uid, tenant, self.tenants, self.owner_uid, doing)


def check_spec(data: Any, rules: IntakeRules, existing: Iterable[TaskRecord], base_dir: str | Path,
               owner_uid: int | None = None) -> TaskSpec:
    """The validated spec, its data paths made absolute against base_dir; SpecError (naming the field) if the
    spec is malformed, names another base model, escapes the data roots, reuses an id, breaks a quota or
    (with owner_uid: who submits it) names a tenant that user may not act as. A spec without a tenant is
    the submitter's own (their user name). Tenant code is only located here, never loaded."""
    if owner_uid is not None and isinstance(data, dict) and "tenant" not in data:
        data = {**data, "tenant": user_name(owner_uid)}
    spec = resolve_data_paths(TaskSpec.from_dict(data), base_dir)
    if owner_uid is not None:
        rules.check_owner(owner_uid, spec.tenant)
    model = check_base_model(spec.base_model, rules.models or {rules.model: rules.model})
    if rules.trainer_group_models:
        check_trained(model, rules.trainer_group_models)
    if spec.lora.rank > rules.max_lora_rank:
        raise SpecError("lora.rank", f"{spec.lora.rank} exceeds the job's max_lora_rank {rules.max_lora_rank}")
    existing = list(existing)
    check_unique_id(spec, [t.task_id for t in existing])
    roots = allowed_roots(rules.data_roots, rules.run_dir)
    check_data_paths(spec, roots)
    check_reward_file(spec, roots)
    check_quota(spec, rules.tenant_quotas, existing)
    return spec


def scheduler_records(tasks: dict) -> list[TaskRecord]:
    """TaskRecords of the scheduler's tasks (rank 0's authoritative view)."""
    return [TaskRecord(t.task_id, t.spec.tenant, t.spec.total_steps, t.status) for t in tasks.values()]


class QueueIntake:
    """Rank 0's side of RUN_DIR/queue. `due()` rate-limits the directory scans (a stat or two every poll_s);
    `take()` checks each pending spec; the caller submits it and then calls `settle()`."""

    def __init__(self, job, run_dir: str | Path, poll_s: float = 0.5, clock: Callable[[], float] = time.time):
        self.rules = IntakeRules.from_job(job, run_dir)
        self.queue = TaskQueue(run_dir)
        self.queue.prepare()
        self.rules.save()
        (self.queue.root / "CLOSE").unlink(missing_ok=True)  # a previous job's stop marker in a reused run dir
        self.poll_s, self.clock = poll_s, clock
        self.next_poll = 0.0
        self.closed = False
        self.idle_since: float | None = None

    def due(self) -> bool:
        now = self.clock()
        if now < self.next_poll:
            return False
        self.next_poll = now + self.poll_s
        self.closed = self.queue.closed(owners={self.rules.owner_uid, 0})
        return True

    def take(self, tasks: dict) -> list[tuple[QueueEntry, TaskSpec | None, str | None]]:
        """(entry, checked spec or None, reason it is refused or None) for every pending file, in order."""
        out, records = [], None
        for entry in self.queue.pending():
            if entry.error is not None or not isinstance(entry.data, dict) or "spec" not in entry.data:
                out.append((entry, None, entry.error or "queue file has no 'spec'"))
                continue
            if records is None:  # once per scan, not once per spec: a thousand specs queued at once
                records = scheduler_records(tasks)
            try:
                out.append((entry, check_spec(entry.data["spec"], self.rules, records, self.rules.run_dir,
                                              owner_uid=entry.owner_uid), None))
            except SpecError as exc:
                out.append((entry, None, str(exc)))
        if out:
            self.idle_since = None
        return out

    def settle(self, entry: QueueEntry, reason: str | None, task=None, job_start: float = 0.0) -> None:
        """Moves the file to accepted/ or rejected/. An accepted task's TTFS counts from `tasks add` (or from
        the job's start, for a spec queued before the job ran)."""
        if reason is not None:
            self.queue.reject(entry, reason)
            return
        self.queue.accept(entry)
        if task is not None:
            task.submitted_at = max(float(entry.data.get("added_at", task.submitted_at)), job_start)

    def cancels(self, tasks: dict) -> list[tuple[str, str | None]]:
        """(task id, None or why the request is refused) of each cancel request: only the task's owner (a user
        who may act as its tenant) or the job's owner may cancel it."""
        out = []
        for path, task_id, uid in self.queue.cancel_entries():
            self.queue.cancel_done(path)
            task = tasks.get(task_id)
            reason = None
            if uid is None:
                reason = "unreadable request file"
            elif task is not None:
                try:
                    self.rules.check_owner(uid, task.spec.tenant, doing="cancel tasks of")
                except SpecError as exc:
                    reason = str(exc)
            out.append((task_id, reason))
        return out

    def keep_serving(self) -> bool:
        """Asked once every task has ended: stay up for more until closed or idle for serve_idle_s."""
        if self.rules.serve_idle_s <= 0 or self.closed:
            return False
        now = self.clock()
        if self.idle_since is None:
            self.idle_since = now
        return now - self.idle_since < self.rules.serve_idle_s
