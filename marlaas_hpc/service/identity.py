"""Who may act as a tenant: identity from the uid that owns a file on the shared filesystem.

A spec in RUN_DIR/queue/ (and a cancel request in RUN_DIR/queue/cancel/) is the file of whoever created it:
rank 0 reads its owner with fstat on the opened file (no symlinks followed), so the name a spec gives in
`tenant` is checked against a real Unix identity, not taken on trust. The job config's `tenants` maps a
tenant to Unix users and/or groups; a tenant it does not name belongs to the user of the same name. The job's
owner (the uid running rank 0) and root act for every tenant. The queue directories are sticky and
world-writable (like /tmp): anyone who can reach the run dir may drop a file, nobody may replace or remove
another user's file, and rank 0 decides.
"""
from __future__ import annotations

import grp
import os
import pwd
from dataclasses import dataclass, field
from typing import Any

from marlaas_hpc.config_loader import SpecError, load_config


@dataclass(kw_only=True)
class TenantOwners:
    """The Unix identities that may act as one tenant (job config: `tenants: {NAME: {users, groups}}`)."""

    users: list[str] = field(default_factory=list)
    """User names that may add and cancel this tenant's tasks."""
    groups: list[str] = field(default_factory=list)
    """Groups whose members (primary or supplementary) may add and cancel this tenant's tasks."""

    def validate(self, prefix: str) -> "TenantOwners":
        for name in ("users", "groups"):
            value = getattr(self, name)
            if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
                raise SpecError(f"{prefix}.{name}", f"must be a list of names, got {value!r}")
        return self

    @classmethod
    def from_dict(cls, data: Any, prefix: str) -> "TenantOwners":
        return load_config(cls, data, prefix)


def user_name(uid: int) -> str:
    """The login name of `uid` (its number as text if it has none)."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def group_names(uid: int) -> set[str]:
    """Every group `uid` belongs to: its primary group and the supplementary ones of /etc/group (or NSS)."""
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        return set()
    names = set()
    for gid in os.getgrouplist(entry.pw_name, entry.pw_gid):
        try:
            names.add(grp.getgrgid(gid).gr_name)
        except KeyError:
            continue
    return names


def may_act_as(uid: int, tenant: str, owners: dict[str, TenantOwners], job_owner_uid: int) -> bool:
    if uid in (0, job_owner_uid):
        return True
    entry = owners.get(tenant)
    if entry is None:
        return user_name(uid) == tenant
    return user_name(uid) in entry.users or bool(group_names(uid) & set(entry.groups))


def check_tenant(uid: int, tenant: str, owners: dict[str, TenantOwners], job_owner_uid: int,
                 doing: str = "add tasks as") -> None:
    """SpecError (field `tenant`) unless `uid` may act as `tenant`."""
    if may_act_as(uid, tenant, owners, job_owner_uid):
        return
    entry = owners.get(tenant)
    who = f"users {entry.users} and members of groups {entry.groups}" if entry is not None else \
        f"the Unix user {tenant!r} (and the job's owner {user_name(job_owner_uid)!r})"
    raise SpecError("tenant", f"user {user_name(uid)!r} (uid {uid}) may not {doing} tenant {tenant!r}: only {who} "
                              "may (JobConfig.tenants)")

