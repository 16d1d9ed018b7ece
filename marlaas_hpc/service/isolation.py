"""Tenant isolation: a task's names cannot leave tasks/<tenant>/<task_id>/, its data files come only from
allowed roots, and its id is unique in the run.

TaskSpec.validate already restricts task_id and tenant to safe names (no '/', no '..', no leading dot);
this module adds what needs the run's context: duplicates (also those differing only in case, which
collide on case-insensitive shared filesystems) and where the spec's data paths really point
(symlinks resolved)."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

from marlaas_hpc.tasks.spec import SpecError, TaskSpec

PROJECT_FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures"
"""The project's own small data files (GSM8K / HotpotQA / corpus samples): always readable."""
PATH_FIELDS = ("path", "corpus")
"""DatasetSpec fields that name files."""
PACKAGE_DIR = Path(__file__).resolve().parents[1]
"""marlaas_hpc itself: its reward functions are always allowed."""


def allowed_roots(data_roots: Iterable[str], run_dir: str | Path) -> list[Path]:
    """The job's data_roots (the config's directory is one, see JobConfig.load), the run dir and the fixtures."""
    return [Path(root).resolve() for root in data_roots] + [Path(run_dir).resolve(), PROJECT_FIXTURES]


def resolve_data_paths(spec: TaskSpec, base_dir: str | Path) -> TaskSpec:
    """Makes the spec's relative data paths absolute against base_dir (the spec file's directory): rank 0
    runs elsewhere, so a queued spec must not depend on the submitter's working directory."""
    for name in PATH_FIELDS:
        value = getattr(spec.dataset, name)
        if value:
            setattr(spec.dataset, name, str((Path(base_dir) / Path(value).expanduser()).resolve()))
    return spec


def check_data_paths(spec: TaskSpec, roots: list[Path]) -> None:
    """Refuses a data path that resolves (after symlinks) outside every allowed root."""
    for name in PATH_FIELDS:
        value = getattr(spec.dataset, name)
        if not value:
            continue
        real = Path(value).resolve()
        if not any(real == root or root in real.parents for root in roots):
            raise SpecError(f"dataset.{name}", f"{value!r} resolves to {str(real)!r}, outside the job's allowed "
                                               f"data roots {[str(r) for r in roots]} (JobConfig.data_roots)")


def check_unique_id(spec: TaskSpec, existing_ids: Iterable[str]) -> None:
    """One task id per run, whatever the tenant; ids equal up to case collide too."""
    for task_id in existing_ids:
        if task_id.lower() == spec.task_id.lower():
            same = "is already used" if task_id == spec.task_id else f"collides with {task_id!r} (case)"
            raise SpecError("task_id", f"task id {spec.task_id!r} {same} in this run")


def check_reward_module(spec: TaskSpec, roots: list[Path]) -> None:
    """A custom reward function runs inside the env ranks: its module must be the tenant's own file under an
    allowed root (or marlaas_hpc's), not any installed module (`os:system`, ...). A module this process cannot
    find is left to rank 0, where loading the task's data imports it or refuses the spec."""
    import importlib.util

    if not spec.dataset.reward_fn:
        return
    module = spec.dataset.reward_fn.partition(":")[0]
    try:
        found = importlib.util.find_spec(module) if module else None
    except (ImportError, ValueError):
        found = None
    if found is None:
        return
    origin = Path(found.origin).resolve() if found.origin and found.origin not in ("built-in", "frozen") else None
    if origin is None or not any(root in origin.parents for root in [*roots, PACKAGE_DIR]):
        raise SpecError("dataset.reward_fn", f"module {module!r} ({found.origin}) is not a file under the job's "
                                             "allowed data roots (JobConfig.data_roots)")
