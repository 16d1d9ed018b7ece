"""Tenant isolation: a task's names cannot leave tasks/<tenant>/<task_id>/, its data files and reward file come
only from allowed roots, and its id is unique in the run.

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


def allowed_roots(data_roots: Iterable[str], run_dir: str | Path) -> list[Path]:
    """The job's data_roots (the config's directory is one, see JobConfig.load), the run dir and the fixtures."""
    return [Path(root).resolve() for root in data_roots] + [Path(run_dir).resolve(), PROJECT_FIXTURES]


def resolve_data_paths(spec: TaskSpec, base_dir: str | Path) -> TaskSpec:
    """Makes the spec's relative data paths and reward file absolute against base_dir (the spec file's
    directory): rank 0 runs elsewhere, so a queued spec must not depend on the submitter's working directory."""
    from marlaas_hpc.env.tenant_code import is_file_ref, with_path

    for name in PATH_FIELDS:
        value = getattr(spec.dataset, name)
        if value:
            setattr(spec.dataset, name, str((Path(base_dir) / Path(value).expanduser()).resolve()))
    reward = spec.dataset.reward_fn
    if isinstance(reward, str) and ":" in reward and is_file_ref(reward.rpartition(":")[0]):
        path = reward.rpartition(":")[0]
        spec.dataset.reward_fn = with_path(reward, str((Path(base_dir) / Path(path).expanduser()).resolve()))
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


def check_reward_file(spec: TaskSpec, roots: list[Path]) -> None:
    """A tenant reward function is a readable .py file under an allowed root ('path/to/file.py:function',
    made absolute by resolve_data_paths); `marlaas_hpc.<module>:<function>` names the project's own code.
    Only located here: the file is loaded and run in sandboxed workers only (env/tenant_code.py)."""
    from marlaas_hpc.env.tenant_code import CodeRef

    if not spec.dataset.reward_fn:
        return
    ref = CodeRef.parse(spec.dataset.reward_fn)
    if ref.path is None:
        return
    real = Path(ref.path).resolve()
    if not any(root in real.parents for root in roots):
        raise SpecError("dataset.reward_fn", f"{ref.path!r} resolves to {str(real)!r}, outside the job's allowed "
                                             f"data roots {[str(r) for r in roots]} (JobConfig.data_roots)")
    if not real.is_file():
        raise SpecError("dataset.reward_fn", f"reward file not found: {ref.path}")
