"""The staleness rule, the heart of the design, written once.

A task's version v counts the optimizer steps applied to its adapter; every sample records the version b that
generated it (its behaviour version). With the task's staleness bound k (`TaskSpec.max_staleness`):

    the step that turns version v into v+1 may train only samples with  v - k <= b <= v.

k = 0 is on-policy. The audit measures a trained sample's staleness as (v+1) - 1 - b, which must be <= k.

Why admitting (k+1)·B groups is enough: groups are trained oldest first, B per step. If a task at version v has
at most (k+1)·B groups outstanding (issued, generating, being scored or waiting to train), a group issued at v
that is scored in time is trained in one of the steps from v, v+1, ..., v+k. A slow group (a long-tail
generation, a slow tool) that B newer groups overtake can still fall behind the bound: it is dropped, never
trained.

Where it is enforced, each place through this module:
- admission (async mode's quota, scheduler/modes.py): at most `admission_window` groups outstanding;
- the scheduler's train pass (core.py `_drop_stale`, and `_touch` filing a task that holds a stale group): ready
  groups older than `oldest_allowed` are discarded and counted;
- the trainer (runtime/trainer_rank.py `check_bound`), which re-checks every sample of every order it runs;
- the audits of the simulator (sim/report.py) and of the tests (`AuditRecord.staleness`; the scheduler tests'
  trainer in tests/support/simloop.py re-checks every order as the runtime's does).
A rollout rank may sample a group with a newer version than the one issued (the older one is gone), never an
older one: never staler.
"""
from __future__ import annotations


def oldest_allowed(version: int, bound: int) -> int:
    """The oldest behaviour version the step from `version` may train."""
    return version - bound


def within_bound(behaviour_version: int, from_version: int, bound: int) -> bool:
    """Whether a sample of `behaviour_version` may be trained in the step from `from_version`."""
    return oldest_allowed(from_version, bound) <= behaviour_version <= from_version


def admission_window(bound: int, batch: int) -> int:
    """The most prompt groups a task may have outstanding: (k+1)·B."""
    return (bound + 1) * batch
