"""Per-tenant quotas: how many tasks a tenant may have queued or running at once, and how many optimizer
steps all its tasks of the run may ask for in total. Checked by `marlaas tasks add` (as far as the run dir
shows) and again, authoritatively, by rank 0 when it takes a spec from the queue."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from marlaas_hpc.config_loader import SpecError, load_config
from marlaas_hpc.tasks.spec import TaskSpec

LIVE_STATES = ("pending", "queued", "running")
"""Task states that hold a place in the max_tasks quota (pending = in the queue dir, not yet seen by rank 0)."""


@dataclass(kw_only=True)
class TenantQuota:
    max_tasks: int | None = None
    """Tasks the tenant may have pending, queued or running at once (None: no limit)."""
    max_total_steps: int | None = None
    """Sum of total_steps over all the tenant's tasks in this run, ended ones included (None: no limit)."""

    def validate(self, prefix: str) -> "TenantQuota":
        for name in ("max_tasks", "max_total_steps"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise SpecError(f"{prefix}.{name}", f"must be an integer >= 1 or null, got {value!r}")
        return self

    @classmethod
    def from_dict(cls, data: Any, prefix: str) -> "TenantQuota":
        return load_config(cls, data, prefix)


def quota_of(quotas: dict[str, TenantQuota], tenant: str) -> TenantQuota:
    """The tenant's own quota, else the 'default' entry, else no limit."""
    return quotas.get(tenant) or quotas.get("default") or TenantQuota()


@dataclass(frozen=True)
class TaskRecord:
    """What quota and duplicate checks need to know of a task already in the run (or in its queue)."""

    task_id: str
    tenant: str
    total_steps: int
    state: str


def check_quota(spec: TaskSpec, quotas: dict[str, TenantQuota], existing: Iterable[TaskRecord]) -> None:
    """Raises SpecError if admitting `spec` would exceed its tenant's quota."""
    quota = quota_of(quotas, spec.tenant)
    mine = [t for t in existing if t.tenant == spec.tenant]
    live = sum(t.state in LIVE_STATES for t in mine)
    if quota.max_tasks is not None and live + 1 > quota.max_tasks:
        raise SpecError("tenant", f"tenant {spec.tenant!r} already has {live} task(s) queued or running; "
                                  f"its quota is max_tasks={quota.max_tasks}")
    steps = sum(t.total_steps for t in mine)
    if quota.max_total_steps is not None and steps + spec.total_steps > quota.max_total_steps:
        raise SpecError("total_steps", f"tenant {spec.tenant!r} has {steps} steps in this run; {spec.total_steps} "
                                       f"more would exceed its quota max_total_steps={quota.max_total_steps}")
