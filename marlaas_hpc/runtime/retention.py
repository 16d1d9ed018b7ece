"""Retention of adapter versions: which of a task's `adapters/vNNNN` directories the run dir keeps.

The trainer leader writes every version it publishes (a PEFT dir under tasks/<tenant>/<task>/adapters); without
a policy they pile up (a few hundred steps x tens of tasks x tens of MB each at Qwen3-0.6B). After each of a
task's steps the leader deletes the versions that the job's policy (`adapters:`, `RetentionConfig`) and the
task's pins (`TaskSpec.keep_versions`) drop, but never one that is still in flight:
- the newest version, and the version the step started from (the scheduler issues groups at it until it
  hears of the step);
- every version from the oldest one a group of the task still outstanding at the scheduler was issued at
  (generating, in a multi-turn episode waiting on a tool, being scored, buffered for the trainer:
  `Train.in_use_from`) to the newest: a rollout rank samples such a group with any of them;
- the staleness window (v - k .. v): versions whose samples the next steps may still train;
- the version of the task's newest periodic checkpoint (a resume restarts there; its adapter dir then
  matches the shard).
When the task ends, nothing of it can be trained any more (groups still open are discarded): the last pruning
keeps only what the policy keeps and the final version. A rollout rank writes no directory at all: it hands each
version's broadcast tensors to its engine, which holds them in host memory until it retires that version
(rollout/vllm_engine.py).
"""
from __future__ import annotations

import re
import shutil
import uuid
from pathlib import Path
from typing import Iterable

from marlaas_hpc.rundir import RetentionConfig

__all__ = ["RetentionConfig", "in_flight_versions", "prune_adapters", "remove_dir", "version_dirs"]

_VERSION_DIR = re.compile(r"v(\d{4,})$")


def version_dirs(folder: Path) -> dict[int, Path]:
    """version -> its directory, for the `vNNNN` directories of `folder` (staging dirs are dot-named)."""
    if not folder.is_dir():
        return {}
    out = {}
    for path in folder.iterdir():
        match = _VERSION_DIR.match(path.name)
        if match and path.is_dir():
            out[int(match.group(1))] = path
    return out


def remove_dir(path: Path) -> None:
    """Renames a directory out of the way first, so that nobody ever reads a half-deleted adapter."""
    trash = path.with_name(f".{path.name}.del-{uuid.uuid4().hex[:8]}")
    try:
        path.rename(trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def prune_adapters(folder: Path, config: RetentionConfig, newest: int, pinned: Iterable[int] = (),
                   in_flight: Iterable[int] = ()) -> list[int]:
    """Deletes the version dirs of `folder` that neither the policy, the pins nor `in_flight` keep (versions
    above `newest` included: left by an earlier job in the run dir, or by a run that crashed and was rolled
    back). Returns the versions deleted, in order."""
    pinned, in_flight = set(pinned), set(in_flight)
    deleted = []
    for version, path in sorted(version_dirs(folder).items()):
        if version in in_flight or (version <= newest and config.keeps(version, newest, pinned)):
            continue
        remove_dir(path)
        deleted.append(version)
    return deleted


def in_flight_versions(newest: int, from_version: int | None, in_use_from: int | None, bound: int,
                       checkpointed: int | None) -> set[int]:
    """The versions of a task that must stay after its step to `newest` (see the module docstring): a group
    issued at `in_use_from` may be sampled with any version up to the newest."""
    oldest = newest - bound
    for version in (from_version, in_use_from):
        if version is not None:
            oldest = min(oldest, version)
    keep = set(range(max(0, oldest), newest + 1))
    if checkpointed is not None:
        keep.add(checkpointed)
    return keep
