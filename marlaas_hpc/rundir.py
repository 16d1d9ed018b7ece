"""The run dir: where each output of a job lives, and how its files are written. Every part of the package that
reads or writes a run dir takes its paths from here (the scheduler, env, rollout and trainer ranks, the
single-process driver, the service, the simulator's report).

    RUN_DIR/tasks/<tenant>/<task>/        task_dir: everything a task writes (tenant isolation)
        adapters/v0007/                   adapter_dir: its PEFT adapter at one version
        metrics.jsonl, checkpoint/, ...
    RUN_DIR/status.json, summary.json     task_record: what they say of one task

How long adapter versions stay (RetentionConfig, the job's `adapters:`) and how often tasks are checkpointed
(CheckpointConfig, `checkpoint:`) are run-dir settings too; runtime/retention.py and runtime/checkpoint.py act
on them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from marlaas_hpc.config_loader import bounded, check_bounds, load_config


def task_dir(run_dir: str | Path, spec) -> Path:
    """Everything a task (a TaskSpec: tenant, task_id) writes lives here (tenant isolation)."""
    return Path(run_dir) / "tasks" / spec.tenant / spec.task_id


def adapter_dir(run_dir: str | Path, spec, version: int) -> Path:
    """The task's PEFT adapter at `version`."""
    return task_dir(run_dir, spec) / "adapters" / f"v{version:04d}"


def atomic_write_text(path: Path, text: str) -> None:
    """Writes aside, then renames over `path`: a reader sees the old file or the new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def task_record(task) -> dict:
    """What summary.json and status.json say of one task (a scheduler TaskState: its state only)."""
    group_size = task.spec.algo.group_size
    return {
        "tenant": task.spec.tenant, "base_model": task.spec.base_model, "kind": task.spec.dataset.kind, "objective": task.spec.algo.loss,
        "status": task.status, "error": task.error,
        "steps_done": max(task.version, 0), "total_steps": task.spec.total_steps,
        "staleness_bound": task.bound, "max_staleness_trained": task.max_trained_staleness,
        "dropped_groups": task.dropped_groups, "dropped_samples": task.dropped_groups * group_size,
        "preempted_groups": task.preempted_groups, "reissued_groups": task.reissued_groups,
        "filtered_groups": task.filtered_groups,
        "trained_samples": task.trained_groups * group_size,
        "reward_first": task.reward_history[0] if task.reward_history else None,
        "reward_last": task.reward_history[-1] if task.reward_history else None,
        "ttfs_s": task.ttfs(), "tpts_s": task.tpts(),
        "trainer_group": task.trainer_group, "trainer_moves": task.moves,
    }


@dataclass(kw_only=True)
class RetentionConfig:
    """Which adapter versions each task's `adapters/` directory keeps (job config `adapters:`). The final
    version, the versions a task pins (`keep_versions`) and versions still in flight are always kept."""

    keep_last: int = bounded(2, ge=0)
    """The newest this many versions of each task (0: only the newest, which is always kept)."""
    keep_every: int = bounded(10, ge=0)
    """Every version that is a multiple of this (v0, v10, v20, ...): a sparse history of the run.
    0: none; 1: every version (nothing is ever deleted)."""

    keep_final_checkpoint: bool = bounded(False)
    """Keep an ended task's newest checkpoint shards (adapter and optimizer state, tasks/<tenant>/<task>/
    checkpoint/) to train it further elsewhere. False: every trainer rank deletes them when the task ends (a
    resume never restarts an ended task; its final adapter stays in adapters/)."""

    def validate(self, prefix: str = "adapters") -> "RetentionConfig":
        check_bounds(self, prefix)
        return self

    @classmethod
    def from_dict(cls, data, prefix: str = "adapters") -> "RetentionConfig":
        return load_config(cls, data, prefix)

    def keeps(self, version: int, newest: int, pinned: Iterable[int] = ()) -> bool:
        """The policy's own answer for one version, in-flight protection aside."""
        return (version == newest or newest - version < self.keep_last
                or (self.keep_every > 0 and version % self.keep_every == 0) or version in pinned)


@dataclass(kw_only=True)
class CheckpointConfig:
    """When tasks are checkpointed while the job runs (job config `checkpoint:`), and how a crashed Slurm job
    restarts. Either trigger saves a task after its step; 0 turns a trigger off (both 0: only preemption
    checkpoints, and a crash restarts tasks from their start)."""

    every_steps: int = bounded(10, ge=0)
    """Save a task after every this many of its optimizer steps: a crash loses at most this many steps."""
    every_minutes: float = bounded(10.0, ge=0, unit="minutes")
    """... or after its first step once its last save is this old (slow tasks: bounds the lost wall time)."""
    max_crash_requeues: int = bounded(3, ge=0)
    """Under Slurm a job whose rank died or failed requeues itself and resumes, at most this many times."""

    def validate(self, prefix: str = "checkpoint") -> "CheckpointConfig":
        check_bounds(self, prefix)
        return self

    @classmethod
    def from_dict(cls, data, prefix: str = "checkpoint") -> "CheckpointConfig":
        return load_config(cls, data, prefix)
