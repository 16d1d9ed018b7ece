"""Tenant code: a reward function a tenant brings as a file next to their spec.

    dataset:
      reward_fn: rewards/score.py:exact      # FILE.py:FUNCTION, relative to the spec, under the data roots

The file is read once (a snapshot: later edits do not change a running task) and never imported by the
process that reads it. It is loaded and called only inside a sandboxed worker process (sandbox.py, level and
limits from the job's `sandbox:` section): one worker per task and process that calls it (an env rank, or
each of its env-pool processes), started on first use, restarted after it failed. A call that raises, answers
something that is not a number, runs past `reward_timeout_s` or past `reward_memory_mb` raises RewardError:
the env rank fails that task alone. Intake (`marlaas tasks add`, rank 0) only asks a sandboxed worker to
load the file and find the function (`check`).

`marlaas_hpc.<module>:<function>` names a function of this package instead (project code, trusted: it runs
in the calling process). Any other module name is refused: tenant code is a file.
"""
from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from marlaas_hpc.env.sandbox import (ISOLATION_CHOICES, FunctionWorker, SandboxLimits, SandboxUnavailable, WorkerDied,
                                     WorkerTimeout)
from marlaas_hpc.tasks.base import RewardError, Sample
from marlaas_hpc.config_loader import SpecError, bounded, check_bounds, load_config

PACKAGE_PREFIX = "marlaas_hpc."
FIELD = "dataset.reward_fn"
IDLE_STOP_S = 120.0
"""A worker not called for this long is stopped (the next call starts it again): a serving job's ended tasks
must not keep a process each."""


@dataclass(frozen=True)
class CodeRef:
    """A parsed `dataset.reward_fn`: a tenant file (path) or a module of this package, and a function."""

    function: str
    path: str | None = None
    module: str | None = None

    @classmethod
    def parse(cls, value: str, field_name: str = FIELD) -> "CodeRef":
        where, sep, function = value.rpartition(":") if isinstance(value, str) else ("", "", "")
        if not sep or not where or not function.isidentifier():
            raise SpecError(field_name, f"{value!r} is not of the form 'path/to/file.py:function'")
        if is_file_ref(where):
            if not where.endswith(".py"):
                raise SpecError(field_name, f"{where!r} is not a Python file (.py)")
            return cls(function, path=where)
        if not where.startswith(PACKAGE_PREFIX):
            raise SpecError(field_name, f"{where!r} names a module; tenant code is a file: give "
                                        f"'path/to/file.py:{function}' (relative to the spec)")
        return cls(function, module=where)

    def __str__(self) -> str:
        return f"{self.path or self.module}:{self.function}"


def is_file_ref(where: str) -> bool:
    return where.endswith(".py") or "/" in where


def with_path(value: str, path: str) -> str:
    """`value` (FILE.py:FUNCTION) pointing at `path` instead."""
    return f"{path}:{value.rpartition(':')[2]}"


@dataclass(kw_only=True, frozen=True)
class SandboxConfig:
    """The job's `sandbox:` section: how tenant code (reward functions) runs on env ranks and at intake."""

    isolation: str = bounded("auto", choices=ISOLATION_CHOICES)
    """'auto' (the strongest this node offers), 'bwrap', 'landlock' or 'rlimits' (env/sandbox.py)."""
    allow_unisolated: bool = bounded(False)
    """Run tenant code even where only 'rlimits' is available (no file isolation: other tenants' files and
    the run dir are then readable to it). Off: such tasks fail with a message saying what is missing."""
    uid_range: tuple[int, int] | None = SandboxLimits().uid_range
    """When the job runs as root: each worker runs as its own uid from [lo, hi). null: uid 0 without
    capabilities."""
    reward_timeout_s: float = bounded(10.0, gt=0, le=3600, unit="seconds")
    """Wall-clock limit of one reward call (and at least 60 s for a worker to load its file)."""
    reward_memory_mb: int = bounded(2048, ge=64, le=2**20, unit="MiB")
    """Address-space limit of a reward worker, in MiB."""

    def validate(self, prefix: str = "sandbox") -> "SandboxConfig":
        check_bounds(self, prefix)
        try:  # what the bounds above do not say, the uid range
            self.reward_limits().validate()
        except SpecError as exc:
            raise SpecError(f"{prefix}.{exc.field.split('.')[-1]}", exc.reason) from None
        return self

    def reward_limits(self) -> SandboxLimits:
        uid_range = tuple(self.uid_range) if self.uid_range is not None else None
        return SandboxLimits(cpu_seconds=None, wall_seconds=float(self.reward_timeout_s),
                             memory_bytes=self.reward_memory_mb * 2**20, file_bytes=16 * 2**20,
                             isolation=self.isolation, allow_unisolated=self.allow_unisolated, uid_range=uid_range)

    @classmethod
    def from_dict(cls, data: Any, prefix: str = "sandbox") -> "SandboxConfig":
        return load_config(cls, data, prefix)


class TenantFunction:
    """Callable (sample, completion) -> float that runs a tenant file's function in a sandboxed worker.
    Thread-safe (calls of one task are serialised on its worker); pickles as its source (a process pool's
    copy starts its own worker)."""

    def __init__(self, ref: CodeRef, limits: SandboxLimits, read_files: tuple[str, ...] = (),
                 source: str | None = None, display_name: str | None = None):
        self.ref, self.limits, self.read_files = ref, limits, tuple(read_files)
        self.display_name = display_name or f"{Path(ref.path).name}:{ref.function}"
        if source is None:
            try:
                source = Path(ref.path).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise SpecError(FIELD, f"cannot read {ref.path}: {exc}") from None
        self.source = source
        self._setup()

    def _setup(self) -> None:
        self._lock = threading.Lock()
        self._worker = FunctionWorker(self.source, Path(self.ref.path).name, self.ref.function, self.limits,
                                      self.read_files, display_name=Path(self.ref.path).name)
        self._last_call = time.monotonic()
        weakref.finalize(self, self._worker.stop)
        _reaper.watch(self)

    def __getstate__(self) -> dict:
        return {"ref": self.ref, "limits": self.limits, "read_files": self.read_files, "source": self.source,
                "display_name": self.display_name}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._setup()

    def __call__(self, sample: Sample, completion: str) -> float:
        request = {"sample": {"index": sample.index, "prompt": sample.prompt, "answer": sample.answer,
                              "meta": sample.meta}, "completion": completion}
        with self._lock:
            self._last_call = time.monotonic()
            try:
                reply = self._worker.call(request)
            except WorkerTimeout:
                raise RewardError(f"reward function {self.display_name} did not return within "
                                  f"{self.limits.wall_seconds:g} s (sandbox.reward_timeout_s); its worker was "
                                  "killed") from None
            except (WorkerDied, SandboxUnavailable) as exc:
                raise RewardError(f"reward function {self.display_name}: {exc}") from None
        if not reply.get("ok"):
            raise RewardError(f"reward function {self.display_name} failed: {reply.get('error')}")
        return reply["value"]

    def check(self) -> None:
        """Loads the file in a sandboxed worker and finds the function (intake); SpecError if it cannot."""
        worker = replace(self._worker, limits=self.limits)
        try:
            worker.start()
        except (WorkerDied, WorkerTimeout, SandboxUnavailable) as exc:
            raise SpecError(FIELD, f"{self.ref.path}: {exc}") from None
        finally:
            worker.stop()

    def close(self) -> None:
        with self._lock:
            self._worker.stop()

    def stop_if_idle(self, idle_s: float) -> None:
        if self._worker.proc is not None and self._lock.acquire(blocking=False):
            try:
                if time.monotonic() - self._last_call > idle_s:
                    self._worker.stop()
            finally:
                self._lock.release()


class _IdleReaper:
    """One daemon thread per process that stops idle workers (started with the first TenantFunction)."""

    def __init__(self):
        self._functions: weakref.WeakSet = weakref.WeakSet()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, function: TenantFunction) -> None:
        with self._lock:
            self._functions.add(function)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="tenant-code-reaper", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(IDLE_STOP_S / 4)
            with self._lock:
                functions = list(self._functions)
            for function in functions:
                function.stop_if_idle(IDLE_STOP_S)


_reaper = _IdleReaper()


def reward_function(value: str, limits: SandboxLimits, read_files: tuple[str, ...] = ()) -> Callable:
    """The callable for a spec's reward_fn: a TenantFunction for a file, the function itself for this
    package's modules."""
    ref = CodeRef.parse(value)
    if ref.path is not None:
        return TenantFunction(ref, limits, tuple(f for f in read_files if f))
    return _package_function(ref)


def _package_function(ref: CodeRef) -> Callable:
    import importlib

    try:
        function = getattr(importlib.import_module(ref.module), ref.function)
    except (ImportError, AttributeError) as exc:
        raise SpecError(FIELD, f"cannot import {ref}: {exc}") from None
    if not callable(function):
        raise SpecError(FIELD, f"{ref} is not callable")
    return function


def check_reward_code(dataset, sandbox: SandboxConfig | None = None) -> None:
    """Intake's check of a spec's tenant reward file (DatasetSpec): loaded by a sandboxed worker, which must
    find the function; SpecError naming dataset.reward_fn if not. Nothing of it runs in the caller."""
    if not dataset.reward_fn:
        return
    ref = CodeRef.parse(dataset.reward_fn)
    if ref.path is not None:
        limits = (sandbox or SandboxConfig()).reward_limits()
        TenantFunction(ref, limits, tuple(f for f in (dataset.path, dataset.corpus) if f)).check()
