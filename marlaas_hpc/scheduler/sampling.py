"""Dynamic sampling (DAPO, arXiv 2503.14476 §3.2), the scheduler's side: a scored prompt group whose G training
rewards are all equal has every advantage 0 and teaches nothing, so a task with `algo.dynamic_sampling` drops it
(Discard) instead of training it. Its slot in the task's outstanding groups frees, so the mode's quota issues a
new prompt in its place at the task's current version: the step still trains B groups, all informative, and the
replacement sits inside the same admission window (k+1)·B as any group (scheduler/staleness.py), so the bound
holds as before.

A task whose rewards saturate (every sample right, or every one wrong) would draw prompts for ever: after
`dynamic_sampling_patience` x B uninformative groups in a row, the filter lets them through (they train as zero
advantages do: a step of Adam on a zero gradient) until an informative one arrives.

The env rank decides what is informative (env/shaping.py `score_group`, `Scored.informative`); this module only
decides what is dropped.
"""
from __future__ import annotations

from marlaas_hpc.scheduler.state import TaskState


def drops(task: TaskState, informative: bool) -> bool:
    """Whether dynamic sampling drops this scored group of `task` (and counts it in the task's run of
    uninformative groups). `task`: a TaskState, or the single-process driver's DriverTask (the same three
    attributes: filters_groups, filter_patience, uninformative_run)."""
    if informative:
        task.uninformative_run = 0
        return False
    if not task.filters_groups:
        return False
    task.uninformative_run += 1
    return task.uninformative_run <= task.filter_patience
