"""MultiLoraTrainer: many tasks' LoRA adapters, each trained with its own objective (GRPO, Dr. GRPO, DAPO, GSPO:
trainer/objectives.py) on one frozen megatron-core base (docs/architecture.md §10).

Every rank of the trainer's world (TP x DP) constructs the trainer and calls the same methods with the same
arguments (the methods are collective over the TP group; a training step also over the DP group: each DP replica
back-propagates its share of the rows and the LoRA gradients are summed over the replicas, `_all_reduce_dp`). Each task owns its adapter (one per `MultiLora` site), its own
`torch.optim.AdamW` over this rank's shards of it, and its version (= optimizer steps applied). A training step
may fuse several tasks' batches: the base forward is shared, rows pick their task's adapter, and each task's loss
is its own objective over its own batch.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from marlaas_hpc.config_loader import load_config
from marlaas_hpc.tasks.spec import AlgoSpec, LoraSpec, SpecError
from marlaas_hpc.trainer.cpu_shims import eager_on_cpu
from marlaas_hpc.trainer.lockstep import (EpForwards, filler_micro_batch, lockstep_forwards, max_over,
                                          split_expert_params, sum_grads)
from marlaas_hpc.trainer.objectives import OBJECTIVES, Objective, Tokens
from marlaas_hpc.trainer.lora import MultiLora
from marlaas_hpc.trainer.attention import (ATTENTION_KINDS, RowAttention, causal_segments, min_row_tokens,
                                           min_rows, resolve_attention, row_multiple, row_width)
from marlaas_hpc.trainer.lm_head import LmHead
from marlaas_hpc.trainer.model import (build_gpt_model, check_expert_parallel, final_hidden_states, init_distributed,
                                       training_mode)
from marlaas_hpc.trainer.packing import PackedBatch, pack
from marlaas_hpc.trainer import process_groups
from marlaas_hpc.trainer.peft_io import read_peft_adapter, write_peft_adapter
from marlaas_hpc.trajectory import Trajectory


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(kw_only=True)
class TrainerConfig:
    model_path: str
    """Local HF Qwen3 checkpoint directory (config.json + *.safetensors) of the shared base model."""
    tensor_parallel: int = 1
    """TP size; TP x DP must equal the size of the default torch.distributed group (the trainer group's ranks)."""
    data_parallel: int = 1
    """DP replicas: a step's rows are split over them and the LoRA gradients all-reduced over the DP group."""
    expert_parallel: int = 1
    """EP size of a mixture-of-experts model (trainer/experts_parallel.py): each MoE layer's experts are split over
    this many DP replicas (megatron-core carves EP out of the DP ranks), which send each token to its experts'
    rank with an all-to-all; their expert LoRA gradients are summed over the expert-data-parallel group (DP / EP
    replicas). Must divide the experts and `data_parallel`; > 1 runs at tensor_parallel 1 only."""
    seed: int = 0
    """Seeds megatron's RNG tracker and (with the task id) every adapter's lora_A init."""
    micro_batch_tokens: int = 0
    """Token budget of one forward/backward pass (rows x longest row, padding included); a step's rows are
    packed longest first into micro-batches within it and their gradients accumulate to one optimizer step.
    A row longer than the budget runs alone. 0 = the whole batch in one pass."""
    device: str = "auto"
    """'cpu', 'cuda' (the current CUDA device), 'cuda:N', or 'auto' (cuda when available)."""
    dtype: str = "auto"
    """Base weights: 'float32', 'bfloat16', or 'auto' (bfloat16 on CUDA, float32 on CPU). LoRA weights, optimizer
    state, logprobs and the loss are float32 whatever this is."""
    recompute: bool = False
    """Activation recompute (megatron 'full', one layer per unit): activations of a layer are recomputed in
    backward instead of stored, trading ~1/3 more compute for memory on long sequences."""
    load_weights: bool = True
    """False: the base parameters are allocated but not loaded (only config.json is read). For the GPU dry run
    (marlaas_hpc/plan/dry_run.py), which counts memory on fake tensors and has no weights to load."""
    attention: str = "auto"
    """Attention kernel of packed rows (trainer/attention.py): 'flex' (FlexAttention with a block mask: no score
    matrix; trains on CUDA only, torch 2.13 has no FlexAttention backward on CPU), 'dense' (megatron's unfused
    attention over a [rows, 1, s, s] mask: ~6 bytes per score kept for backward), or 'auto' (flex on CUDA, dense
    on CPU)."""

    def validate(self) -> "TrainerConfig":
        if not isinstance(self.model_path, (str, Path)) or not Path(self.model_path, "config.json").is_file():
            raise SpecError("model_path", f"{self.model_path!r} is not an HF checkpoint directory")
        for name, low in (("tensor_parallel", 1), ("data_parallel", 1), ("expert_parallel", 1),
                          ("micro_batch_tokens", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise SpecError(name, f"must be an integer >= {low}, got {value!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise SpecError("seed", f"must be an integer, got {self.seed!r}")
        if not isinstance(self.device, str) or not (self.device in ("auto", "cpu", "cuda")
                                                    or re.fullmatch(r"cuda:\d+", self.device)):
            raise SpecError("device", f"must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise SpecError("device", f"{self.device} requested but no CUDA device is available")
        if self.dtype not in ("auto", *DTYPES):
            raise SpecError("dtype", f"must be 'auto', 'float32' or 'bfloat16', got {self.dtype!r}")
        for name in ("recompute", "load_weights"):
            if not isinstance(getattr(self, name), bool):
                raise SpecError(name, f"must be true or false, got {getattr(self, name)!r}")
        if self.attention not in ATTENTION_KINDS:
            raise SpecError("attention", f"must be one of {', '.join(ATTENTION_KINDS)}, got {self.attention!r}")
        check_expert_parallel(self.expert_parallel, self.tensor_parallel, self.data_parallel, self.model_path)
        return self

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
                else torch.device("cpu")
        if self.device == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.device)

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]


@dataclass
class _Task:
    lora: LoraSpec
    algo: AlgoSpec
    optimizer: torch.optim.Optimizer
    version: int = 0
    bound: int = 0
    """The task's staleness bound k: a step from v trains samples of versions v - k .. v."""
    snapshots: list[int] = field(default_factory=list)
    """TIS, IcePop: the older versions whose adapters this rank keeps (`_keep_snapshot`), oldest first."""


def _snapshot_name(task_id: str, version: int) -> str:
    return f"{task_id}@v{version}"  # '@' is not in any task id (tasks/spec.py safe names)


@dataclass
class _StepCounts:
    """Per task of a fused step: its trained tokens, and its objective's units (trained tokens, or sequences with
    trained tokens: `Objective.unit`) over the whole batch and over the rows that run. A micro-batch's loss weighs
    its share of its task's units, its statistics their share of the units that run."""

    objectives: dict[str, Objective]
    tokens: dict[str, int]
    units: dict[str, int]
    ran_units: dict[str, int]
    ran_tokens: dict[str, int]
    ran_rows: dict[str, int]

    @classmethod
    def of(cls, batches: dict[str, Sequence[Trajectory]], items: list[tuple[str, Trajectory]],
           objectives: dict[str, Objective]) -> "_StepCounts":
        counts = cls(objectives, *({t: 0 for t in batches} for _ in range(5)))
        for task_id, trajs in batches.items():
            for traj in trajs:
                trained = sum(traj.mask())
                counts.tokens[task_id] += trained
                counts.units[task_id] += objectives[task_id].units(trained)
        for task_id, traj in items:
            trained = sum(traj.mask())
            counts.ran_tokens[task_id] += trained
            counts.ran_units[task_id] += objectives[task_id].units(trained)
            counts.ran_rows[task_id] += 1
        return counts

    def units_of(self, chunk: list[tuple[str, Trajectory]]) -> dict[str, int]:
        """Each task's units in a micro-batch."""
        units: dict[str, int] = {}
        for task_id, traj in chunk:
            units[task_id] = units.get(task_id, 0) + self.objectives[task_id].units(sum(traj.mask()))
        return units


@dataclass
class _MicroBatchInputs:
    """What a micro-batch's losses take besides the step's forward."""

    base: dict[float, torch.Tensor]
    """KL: the base model's logprobs of the trained tokens, per temperature."""
    lagged: dict[int, torch.Tensor]
    """TIS, IcePop: the trainer's logprobs of the trained tokens `lag` versions back (`_lagged_logprobs`)."""
    items: dict[str, tuple[int, int]]
    """Each task's items (first, end) in the micro-batch."""
    units: dict[str, int]
    """Each task's units in the micro-batch."""


def _item_ranges(chunk: list[tuple[str, Trajectory]]) -> dict[str, tuple[int, int]]:
    ranges: dict[str, tuple[int, int]] = {}
    for index, (task_id, _) in enumerate(chunk):  # a task's items are contiguous (packing keeps them so)
        ranges[task_id] = (ranges.get(task_id, (index, index))[0], index + 1)
    return ranges


def _to_host(value):
    """`value` with every tensor in it copied to host memory (new containers; other leaves shared). A CUDA tensor's
    copy is asynchronous, into pinned memory (torch pins the destination of a non-blocking copy to the host):
    the caller synchronises once for all of them."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", non_blocking=True) if value.is_cuda else value.detach().clone()
    if isinstance(value, dict):
        return {key: _to_host(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_host(item) for item in value)
    return value


def _scale(temperature: float) -> float:
    return temperature if temperature > 0 else 1.0


class MultiLoraTrainer:
    """RL trainer of many LoRA tasks, each on its own objective, over one frozen megatron-core GPTModel (TP x DP)."""

    def __init__(self, config: TrainerConfig, store=None):
        """`store`: the trainer group's rendezvous (a TCPStore; RANK / WORLD_SIZE in the environment), else
        torchrun's environment, else a world of one."""
        eager_on_cpu()
        from megatron.core import parallel_state

        self.config = config.validate()
        self.device = config.torch_device()
        if self.device.type == "cuda":  # before NCCL starts: the process group binds to the current device
            torch.cuda.set_device(self.device)
        init_distributed(config.tensor_parallel, seed=config.seed, data_parallel=config.data_parallel, store=store,
                         expert_parallel=config.expert_parallel)
        self.group_store = dist.distributed_c10d._get_default_store()
        """The trainer group's rendezvous: its groups are made again from it (`remake_groups`)."""
        self.group_rank, self.group_size, self.backend = dist.get_rank(), dist.get_world_size(), dist.get_backend()
        self.group_epoch = 0
        """How many times the groups were made again."""
        # the GPU dry run's fake process group (plan/dry_run.py) has a store no gloo group can meet over
        self.control_group = (process_groups.control_group(self.group_store, self.group_rank, self.group_size)
                              if self.backend != "fake" else None)
        """gloo over the same store, for the ranks' agreement after each section of an op (runtime/group_guard.py):
        never taken down, so it works whatever state the TP/DP communicators are in. None for a world of one (and
        for the dry run's fake group)."""
        loaded = build_gpt_model(config.model_path, device=self.device, dtype=config.torch_dtype(self.device),
                                 recompute=config.recompute, load_weights=config.load_weights)
        self.model, self.hf_config = loaded.model, loaded.hf_config
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.ep_size = config.expert_parallel
        self.ep_group, self.expert_dp_group = (parallel_state.get_expert_model_parallel_group(),
                                               parallel_state.get_expert_data_parallel_group())
        self.ep_rank = dist.get_rank(self.ep_group) if self.ep_size > 1 else 0
        """Which share of the experts this rank holds (its task state is that share's: runtime checkpoint shards)."""
        self.vocab_size = loaded.vocab_size
        self.head = LmHead(self.model, self.tp_group, self.vocab_size)
        self.attention = RowAttention(self.model, resolve_attention(config.attention, self.device))
        pad = getattr(self.hf_config, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else 0
        self.lora = MultiLora(self.model, tp_group=self.tp_group, ep_group=self.ep_group if self.ep_size > 1 else None)
        self.routes = None
        """Routing replay on a mixture-of-experts model (trainer/route_replay.py); None on a dense one."""
        if getattr(self.hf_config, "num_experts", None):
            from marlaas_hpc.trainer.route_replay import RouteReplay  # imports megatron: after the shims

            self.routes = RouteReplay(self.model)
        self.tasks: dict[str, _Task] = {}

    # -- tasks --------------------------------------------------------------------------------------------
    def add_task(self, task_id: str, lora: LoraSpec, algo: AlgoSpec, max_staleness: int = 0) -> None:
        """Creates the task's adapter (B = 0: starts as the base model) and its AdamW (lr from algo).
        `max_staleness` (the spec's k) says how many older adapter versions TIS or IcePop keeps (`algo.tis_cap`,
        `algo.icepop_band`)."""
        if task_id in self.tasks:
            raise KeyError(f"task {task_id!r} already exists")
        lora.validate()
        algo.validate()
        if algo.routing_replay and self.routes is None:
            raise SpecError("algo.routing_replay", "replays a mixture-of-experts model's routing; the base model is "
                                                   "dense")
        params = self.lora.add_adapter(task_id, lora, seed=self.config.seed)
        self.tasks[task_id] = _Task(lora=lora, algo=algo, optimizer=self._make_optimizer(params, algo),
                                    bound=max_staleness)

    def remove_task(self, task_id: str) -> None:
        self._drop_snapshots(self._task(task_id), task_id)
        self.lora.remove_adapter(task_id)
        del self.tasks[task_id]

    def version(self, task_id: str) -> int:
        """Optimizer steps applied to the task's adapter."""
        return self._task(task_id).version

    def task_ids(self) -> list[str]:
        return list(self.tasks)

    def _task(self, task_id: str) -> _Task:
        if task_id not in self.tasks:
            raise KeyError(f"unknown task {task_id!r}")
        return self.tasks[task_id]

    @staticmethod
    def _make_optimizer(params, algo: AlgoSpec) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=algo.lr, weight_decay=algo.weight_decay)

    # -- forward ------------------------------------------------------------------------------------------
    def _forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """float32 vocab-parallel logits [b, s, V_padded/tp] of unpacked rows (causal), with the adapters
        `self.lora.ctx` holds for the rows."""
        batch, seq = input_ids.shape
        positions = torch.arange(seq, device=self.device).unsqueeze(0).expand(batch, seq)
        with self.attention.use(self.attention.mask(*causal_segments(batch, seq, self.device))) as mask:
            hidden = final_hidden_states(self.model, input_ids, positions, mask)  # [s, b, h]
            return self.head(hidden.transpose(0, 1).reshape(batch * seq, -1)).view(batch, seq, -1)

    def _trained_hidden(self, batch: PackedBatch, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Final hidden states [trained tokens, hidden] of a packed batch: each trained token's logits come from
        where its predecessor sits (the LM head runs on those positions only). Runs inside `self.lora.ctx.use`
        (the rows' adapters) and `self.attention.use` (whose mask argument is `attention_mask`)."""
        hidden = final_hidden_states(self.model, batch.ids, batch.positions, attention_mask)  # [s, rows, h]
        return hidden[batch.token_source, batch.token_row]

    def _token_logprobs(self, hidden: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
        """float32 log softmax(logits / T)[label] of the tokens whose final hidden states are `hidden`, through
        the float32 vocab-parallel LM head (trainer/lm_head.py: no full-vocab gather, no [n, V] tensor kept)."""
        return self.head.logprobs(hidden, labels, _scale(temperature))

    def _rows(self, task: str | None | Sequence[str | None], batch: int) -> list[str | None]:
        rows = [task] * batch if task is None or isinstance(task, str) else list(task)
        if len(rows) != batch:
            raise ValueError(f"{len(rows)} adapter names for {batch} rows")
        for name in rows:
            if name is not None:
                self._task(name)
        return rows

    @torch.no_grad()
    def logits(self, task_id: str | None | Sequence[str | None], input_ids) -> torch.Tensor:
        """Full-vocab logits [b, s, V] (gathered over TP) of `input_ids` [b, s] with the task's adapter
        (None: base model; a list: one adapter per row)."""
        ids = torch.as_tensor(input_ids, dtype=torch.long, device=self.device)
        if ids.dim() != 2:
            raise ValueError("input_ids must be [batch, seq]")
        with self.lora.ctx.use(self._rows(task_id, ids.shape[0])):
            vp = self._forward(ids)
        if self.tp_size > 1:  # megatron's gather allocates on CUDA; a plain all_gather works on any backend
            shards = [torch.empty_like(vp) for _ in range(self.tp_size)]
            dist.all_gather(shards, vp, group=self.tp_group)
            vp = torch.cat(shards, dim=-1)
        return vp[..., : self.vocab_size]

    def _micro_batches(self, items: list, lengths: list[int]) -> list[list[int]]:
        """Indices into `items`, packed longest first into micro-batches of at most `micro_batch_tokens` padded
        tokens each (rows x longest row); one micro-batch of everything when the budget is 0."""
        budget = self.config.micro_batch_tokens
        if not budget:
            return [list(range(len(items)))] if items else []
        batches: list[list[int]] = []
        for index in sorted(range(len(items)), key=lambda i: -lengths[i]):
            current = batches[-1] if batches else None
            # longest first: the batch's first row is its longest, so adding a row costs one more of those
            if current and (len(current) + 1) * lengths[current[0]] <= budget:
                current.append(index)
            else:
                batches.append([index])
        return [sorted(batch) for batch in batches]  # items come grouped by task: keep each task's rows together

    def _length(self, traj: Trajectory) -> int:
        """What the trajectory takes in the micro-batch budget (trainer/attention.py `row_width`)."""
        return row_width(self.attention.kind, len(traj.prompt_ids) + len(traj.completion_ids))

    def _pack(self, items: Sequence[tuple[str | None, Trajectory]], replay: Sequence[str | None] = ()) -> PackedBatch:
        """A micro-batch packed into rows of one task each (trainer/packing.py), on this trainer's device, in as many
        rows as wide as the attention kernel wants (trainer/attention.py `min_row_tokens`, `flex_shape`), with the
        recorded routes of the tasks that replay them (`algo.routing_replay`, and `replay`)."""
        kind = self.attention.kind
        replay = [*replay, *(t for t, task in self.tasks.items() if task.algo.routing_replay)]
        return pack(items, min_row_tokens(kind), self.pad_id, width_multiple=row_multiple(kind),
                    min_rows=min_rows(kind), replay=replay if self.routes is not None else ()).to(self.device)

    def _replaying(self, batch: PackedBatch):
        """The batch's recorded routes in every MoE router for the forwards inside the block (and their
        recomputation in backward)."""
        if self.routes is None or batch.routes is None:
            return contextlib.nullcontext()
        return self.routes.use(batch.routes, batch.route_mask)

    @torch.no_grad()
    def logprobs(self, task_id: str | None, trajectories: Sequence[Trajectory],
                 temperature: float = 1.0, replay: bool = False) -> list[list[float]]:
        """Per-trajectory logprobs of the completion tokens at `temperature` (no grad); task None = base. `replay`:
        route through the trajectories' recorded experts (as a task with `algo.routing_replay` always does)."""
        trajectories = list(trajectories)
        out: list[list[float]] = [[] for _ in trajectories]
        for indices in self._micro_batches(trajectories, [self._length(t) for t in trajectories]):
            batch = self._pack([(task_id, trajectories[i]) for i in indices], [task_id] if replay else [])
            with self.lora.ctx.use(self._rows(task_id, len(batch.tasks))), self._replaying(batch), \
                    self.attention.use(self.attention.mask(batch.prompt_of, batch.own)) as mask:
                logp = self._token_logprobs(self._trained_hidden(batch, mask), batch.targets, temperature).cpu()
            for index, (start, n) in zip(indices, batch.item_spans):
                out[index] = logp[start: start + n].tolist()
        return out

    # -- training -----------------------------------------------------------------------------------------
    def train_step(self, task_id: str, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """One optimizer step of one task on its objective; returns its metrics (loss, clip_frac, ..., version)."""
        return self.train_steps({task_id: trajectories})[task_id]

    def train_steps(self, batches: dict[str, Sequence[Trajectory]]) -> dict[str, dict[str, float]]:
        """One optimizer step for each task in `batches`, sharing the base forward of the fused batch.

        Each task's loss is its own objective (trainer/objectives.py) over its whole batch, whatever the
        micro-batching and the other tasks of the step: a micro-batch's loss, normalised over its own units (its
        trained tokens, or its sequences), is weighted by its share of the task's units before backward
        (`_StepCounts`). Rows that add nothing to the loss are not run (`_contributes`); every task of the batch
        still takes its optimizer step.
        """
        if self.attention.kind == "flex" and self.device.type != "cuda":
            raise RuntimeError("attention 'flex' trains on CUDA only: torch has no FlexAttention backward on CPU "
                               "(use 'dense' or 'auto')")
        for task_id, trajs in batches.items():
            self._task(task_id)
            for traj in trajs:
                if traj.task_id != task_id:
                    raise ValueError(f"trajectory of task {traj.task_id!r} in the batch of {task_id!r}")
        items = [(task_id, traj) for task_id, trajs in batches.items() for traj in trajs
                 if self._contributes(task_id, traj)]
        counts = _StepCounts.of(batches, items, {t: OBJECTIVES[self.tasks[t].algo.loss] for t in batches})
        stats: dict[str, dict[str, float]] = {t: {} for t in batches}
        for task_id in batches:
            self.tasks[task_id].optimizer.zero_grad(set_to_none=True)
        mine = items[self.dp_rank::self.dp_size]  # this DP replica's rows (still grouped by task)
        plan = self._micro_batches(mine, [self._length(traj) for _, traj in mine])
        forced = lockstep_forwards(self, items) if self.ep_size > 1 else None
        # EP: the group's replicas run as many forwards and backwards (trainer/lockstep.py)
        fillers = max_over(len(plan), self.ep_group) - len(plan) if forced is not None else 0
        for indices in plan:
            self._accumulate_gradients([mine[i] for i in indices], counts, stats, forced)
        for _ in range(fillers):
            filler_micro_batch(self, items[0][1], forced)
        totals = counts.tokens
        self._zero_missing_grads(list(batches), totals)
        if self.dp_size > 1:
            self._all_reduce_dp(list(batches), totals, stats)
        return {task_id: self._optimizer_step(task_id, trajs, totals[task_id], stats[task_id],
                                              skipped=len(trajs) - counts.ran_rows[task_id])
                for task_id, trajs in batches.items()}

    def _contributes(self, task_id: str, traj: Trajectory) -> bool:
        """Whether a row's forward and backward can change the task's update. A row whose advantage is 0 (every
        sample of its prompt group got the same reward: a third of local-demo's groups) adds exactly 0 to the
        clipped surrogate and to its gradient; only a KL term to the base model would still pull on it. Its
        tokens still count in the loss's token mean (`totals`), so the update is the same without it."""
        return traj.advantage != 0 or self.tasks[task_id].algo.kl_beta > 0

    def _zero_missing_grads(self, task_ids: list[str], totals: dict[str, int]) -> None:
        """Zero gradients for the LoRA parameters of every task with trained tokens that got none here: all of its
        rows were skipped (`_contributes`), or sit on another DP replica. AdamW then steps it as it would a zero
        gradient (its moments decay and keep moving the weights). A task without trained tokens keeps none: its
        AdamW skips it, on every replica alike."""
        for task_id in task_ids:
            if totals[task_id] == 0:
                continue
            for param in self.lora.parameters(task_id):
                if param.grad is None:
                    param.grad = torch.zeros_like(param)

    def _base_logprobs(self, batch: PackedBatch, mask, forced: EpForwards | None = None) -> dict[float, torch.Tensor]:
        """Base-model (adapter off) logprobs of the trained tokens at each temperature a KL-regularised task of the
        batch uses (`forced.base`: the forward runs anyway, as on the other EP ranks)."""
        temperatures = {self.tasks[t].algo.temperature for t in set(batch.tasks) if self.tasks[t].algo.kl_beta > 0}
        if not temperatures and not (forced and forced.base):
            return {}
        with torch.no_grad(), self.lora.ctx.use([None] * len(batch.tasks)), self.attention.use(mask) as argument:
            hidden = self._trained_hidden(batch, argument)
            return {temp: self._token_logprobs(hidden, batch.targets, temp) for temp in temperatures}

    def _accumulate_gradients(self, chunk: list[tuple[str, Trajectory]], counts: "_StepCounts",
                              stats: dict[str, dict[str, float]], forced: EpForwards | None = None) -> None:
        """Forward and backward of one micro-batch, in train mode (megatron recomputes activations only then).
        The rows' adapters and the attention mask stay in place through backward: activation recompute re-runs
        each layer's forward (its LoRA hooks and attention) inside backward."""
        batch = self._pack(chunk)
        mask = self.attention.mask(batch.prompt_of, batch.own)
        with self._replaying(batch):  # every forward of the rows: base (KL), lagged (TIS, IcePop), trained
            self._accumulate_packed(batch, chunk, mask, counts, stats, forced)

    def _accumulate_packed(self, batch: PackedBatch, chunk: list[tuple[str, Trajectory]], mask, counts: "_StepCounts",
                           stats: dict[str, dict[str, float]], forced: EpForwards | None) -> None:
        """`_accumulate_gradients` of the packed micro-batch, its routes (if any) in place."""
        extra = _MicroBatchInputs(base=self._base_logprobs(batch, mask, forced),
                                  lagged=self._lagged_logprobs(batch, chunk, mask, forced),
                                  items=_item_ranges(chunk), units=counts.units_of(chunk))
        with training_mode(self.model), self.lora.ctx.use(batch.tasks), self.attention.use(mask) as argument:
            total_loss = self._micro_batch_loss(batch, argument, extra, counts, stats)
            if total_loss is not None:
                total_loss.backward()

    def _micro_batch_loss(self, batch: PackedBatch, attention_mask: torch.Tensor | None, extra: "_MicroBatchInputs",
                          counts: "_StepCounts", stats: dict[str, dict[str, float]]) -> torch.Tensor | None:
        """Sum over the micro-batch's tasks of (task loss x its share of the task's units); the statistics are
        weighted by the micro-batch's share of the units that run (`counts.ran_units`)."""
        hidden = self._trained_hidden(batch, attention_mask)
        changed = self.routes.mismatch() if self.routes is not None else None  # of this forward
        # EP: a backward on every rank even with no trained token here (the EP group's all-to-alls wait on it)
        total_loss = hidden.sum() * 0.0 if self.ep_size > 1 else None
        for task_id, first, end in batch.task_spans:
            units = extra.units[task_id]
            if units == 0:  # no trained token of this task here
                continue
            algo = self.tasks[task_id].algo
            tokens = self._task_tokens(task_id, batch, slice(first, end), hidden, extra)
            loss, mb_stats = OBJECTIVES[algo.loss].loss(tokens, algo)
            weight = units / counts.units[task_id]
            total_loss = loss * weight if total_loss is None else total_loss + loss * weight
            acc, share = stats[task_id], units / counts.ran_units[task_id]
            for key, value in mb_stats.items():
                if key == "loss":  # the objective over the whole batch (skipped rows add 0)
                    acc[key] = acc.get(key, 0.0) + value * weight
                elif key != "tokens":
                    acc[key] = acc.get(key, 0.0) + value * share
            with torch.no_grad():  # distance to the behaviour policy: ~0 on-policy at equal version
                diff = float(((tokens.logp - tokens.behaviour).abs() * tokens.mask).sum()) / counts.ran_tokens[task_id]
            acc["logp_diff_abs"] = acc.get("logp_diff_abs", 0.0) + diff
            rows, sources = batch.token_row[first:end], batch.token_source[first:end]
            if changed is not None and batch.route_mask[rows, sources].any():  # the task's tokens replay here
                flags = changed[sources, rows].float()  # trained tokens the trainer routes otherwise
                mismatched = float((flags * tokens.mask).sum()) / counts.ran_tokens[task_id]
                acc["route_mismatch"] = acc.get("route_mismatch", 0.0) + mismatched
        return total_loss

    def _task_tokens(self, task_id: str, batch: PackedBatch, span: slice, hidden: torch.Tensor,
                     extra: "_MicroBatchInputs") -> Tokens:
        """One task's trained tokens of the micro-batch, as its objective takes them."""
        task = self.tasks[task_id]
        algo = task.algo
        logp = self._token_logprobs(hidden[span], batch.targets[span], algo.temperature)
        first_item, end_item = extra.items[task_id]
        old = None
        if algo.mismatch_correction is not None:  # the trainer's logprobs at each token's behaviour version
            old = logp.detach()
            for lag, lagged in extra.lagged.items():
                old = torch.where(batch.versions[span] == task.version - lag, lagged[span], old)
        return Tokens(logp=logp, behaviour=batch.behaviour[span], advantages=batch.advantages[span],
                      mask=batch.mask[span], sequence=batch.sequence[span] - first_item,
                      n_sequences=end_item - first_item, old=old,
                      base=extra.base[algo.temperature][span] if algo.kl_beta > 0 else None)

    @torch.no_grad()
    def _lagged_logprobs(self, batch: PackedBatch, chunk: list[tuple[str, Trajectory]], mask,
                         forced: EpForwards | None = None) -> dict[int, torch.Tensor]:
        """TIS, IcePop: the trainer's logprobs of the trained tokens `lag` versions before their task's train
        version, for each lag > 0 that a TIS or IcePop task's sample in the micro-batch has: one forward per lag
        (no gradient), each row on its task's kept adapter of that version (`_keep_snapshot`). Lag 0 is the
        step's own forward. `forced.lags`: forwards the other EP ranks run too."""
        lags = set()
        for task_id, traj in chunk:
            task = self.tasks[task_id]
            lag = task.version - traj.behaviour_version
            if task.algo.mismatch_correction is not None and lag > 0:
                if traj.behaviour_version not in task.snapshots:
                    raise RuntimeError(f"{task_id}: {task.algo.mismatch_correction} needs the adapter of "
                                       f"v{traj.behaviour_version} for {traj.group_id}, kept: {task.snapshots} "
                                       f"(staleness bound {task.bound})")
                lags.add(lag)
        out = {}
        for lag in sorted(lags | (forced.lags if forced else set())):
            rows = [self._snapshot_at(task_id, lag) for task_id in batch.tasks]
            with self.lora.ctx.use(rows), self.attention.use(mask) as argument:
                hidden = self._trained_hidden(batch, argument)
                logp = torch.zeros_like(batch.behaviour)
                for task_id, first, end in batch.task_spans:
                    if self._snapshot_at(task_id, lag) is not None:
                        logp[first:end] = self._token_logprobs(hidden[first:end], batch.targets[first:end],
                                                               self.tasks[task_id].algo.temperature)
            out[lag] = logp
        return out

    def _snapshot_at(self, task_id: str, lag: int) -> str | None:
        """The kept adapter of the task's version `lag` steps back (None: none kept)."""
        task = self.tasks[task_id]
        version = task.version - lag
        return _snapshot_name(task_id, version) if version in task.snapshots else None

    def _keep_snapshot(self, task_id: str, task: _Task) -> None:
        """TIS, IcePop, before the step from v: keeps this rank's shards of the adapter at v (a few MB: an adapter,
        no optimizer state) under its own name, and drops those no later step may need (older than v + 1 - k)."""
        if task.algo.mismatch_correction is None or task.bound == 0:
            return
        self._add_snapshot(task_id, task, task.version, self.lora.local_state_dict(task_id))
        while task.snapshots and task.snapshots[0] < task.version + 1 - task.bound:
            self.lora.remove_adapter(_snapshot_name(task_id, task.snapshots.pop(0)))

    def _add_snapshot(self, task_id: str, task: _Task, version: int, shards: dict[str, torch.Tensor]) -> None:
        name = _snapshot_name(task_id, version)
        self.lora.add_adapter(name, task.lora, seed=self.config.seed)
        self.lora.load_local_state_dict(name, shards)
        for param in self.lora.parameters(name):
            param.requires_grad_(False)
        task.snapshots.append(version)

    def _drop_snapshots(self, task: _Task, task_id: str) -> None:
        for version in task.snapshots:
            self.lora.remove_adapter(_snapshot_name(task_id, version))
        task.snapshots.clear()

    def _all_reduce_dp(self, task_ids: list[str], totals: dict[str, int], stats: dict[str, dict[str, float]]) -> None:
        """Sums the DP replicas' LoRA gradients and loss statistics. Every replica weighted its rows' losses by the
        task's tokens over the whole batch, so the sums are the whole batch's gradient and statistics. Every task
        with trained tokens has gradients on every replica (`_zero_missing_grads`)."""
        params = [param for task_id in task_ids if totals[task_id] for param in self.lora.parameters(task_id)]
        experts, params = split_expert_params(params)  # [] at EP = 1
        sum_grads(params, self.dp_group)
        sum_grads(experts, self.expert_dp_group)  # the replicas of this rank's experts (trainer/experts_parallel.py)
        replicas: list = [None] * self.dp_size
        dist.all_gather_object(replicas, stats, group=self.dp_group)
        for task_id in stats:
            stats[task_id] = {key: sum(r[task_id].get(key, 0.0) for r in replicas)
                              for key in sorted({k for r in replicas for k in r[task_id]})}

    def _optimizer_step(self, task_id: str, trajs: Sequence[Trajectory], tokens: int,
                        stats: dict[str, float], skipped: int) -> dict[str, float]:
        task = self.tasks[task_id]
        grad_norm = float(self.lora.grad_norm(task_id))
        if task.algo.grad_clip > 0 and grad_norm > task.algo.grad_clip:
            coef = task.algo.grad_clip / (grad_norm + 1e-6)
            for param in self.lora.parameters(task_id):
                if param.grad is not None:
                    param.grad.mul_(coef)
        self._keep_snapshot(task_id, task)
        task.optimizer.step()
        task.version += 1
        metrics = {"loss": 0.0, "clip_frac": 0.0, "ratio_mean": 0.0, "logp_diff_abs": 0.0, **stats}
        metrics.update(tokens=float(tokens), trajectories=float(len(trajs)), skipped_rows=float(skipped),
                       grad_norm=grad_norm, lr=float(task.algo.lr), version=float(task.version),
                       reward_mean=sum(t.reward for t in trajs) / max(len(trajs), 1))
        return metrics

    def adapter_tensors(self, task_id: str, grads: bool = False) -> dict[str, torch.Tensor]:
        """Full PEFT-layout tensors of the task's adapter (or of its latest gradients). Collective over TP (and over
        EP: every rank's experts)."""
        self._task(task_id)
        return self.lora.hf_state_dict(task_id, grads=grads)

    # -- adapter files ------------------------------------------------------------------------------------
    def export_adapter(self, task_id: str, out_dir: str | Path) -> Path:
        """Writes the task's adapter as a PEFT directory (TP rank 0 writes; every TP rank, and with expert parallelism
        every rank of the EP group, must call this: the experts are gathered)."""
        task = self._task(task_id)
        tensors = self.lora.hf_state_dict(task_id)
        if self.tp_rank == 0:
            write_peft_adapter(out_dir, tensors, task.lora, base_model_name_or_path=str(self.config.model_path))
        if self.tp_size > 1:
            dist.barrier(group=self.tp_group)
        return Path(out_dir)

    def load_adapter(self, task_id: str, path: str | Path, algo: AlgoSpec | None = None,
                     version: int | None = None) -> None:
        """Loads a PEFT adapter into the task (created from the adapter's config and `algo` if absent).

        The task's optimizer state is reset; `version` (if given) sets its version.
        """
        spec, tensors = read_peft_adapter(path)
        if task_id not in self.tasks:
            self.add_task(task_id, spec, algo or AlgoSpec())
        task = self.tasks[task_id]
        have = (task.lora.rank, float(task.lora.alpha), set(task.lora.target_modules))
        if have != (spec.rank, float(spec.alpha), set(spec.target_modules)):
            raise ValueError(f"adapter at {path} (r={spec.rank}, alpha={spec.alpha}, "
                             f"targets={sorted(spec.target_modules)}) does not fit task {task_id!r} "
                             f"(r={task.lora.rank}, alpha={task.lora.alpha}, "
                             f"targets={sorted(task.lora.target_modules)})")
        self.lora.load_hf_state_dict(task_id, tensors)  # CPU tensors; copied onto the params' device
        self._drop_snapshots(task, task_id)
        task.optimizer = self._make_optimizer(self.lora.parameters(task_id), task.algo)
        if version is not None:
            task.version = int(version)

    # -- resume -------------------------------------------------------------------------------------------
    def state_dict(self, task_id: str) -> dict[str, Any]:
        """This rank's resumable state of a task: adapter shards, optimizer state, version, specs, and the older
        adapter versions TIS or IcePop keeps (a task that moves to another trainer group still trains samples of
        them)."""
        state = self._state(task_id)
        state["optimizer"] = copy.deepcopy(state["optimizer"])  # the live dict aliases Adam moments
        return state

    def _state(self, task_id: str, live: bool = False) -> dict[str, Any]:
        """`state_dict` whose optimizer state is the live one (its tensors are Adam's moments); `live`: the
        adapters' too (no copy on the device, for `snapshot`)."""
        task = self._task(task_id)

        def adapter(name: str) -> dict[str, torch.Tensor]:
            if live:
                return {key: param.detach() for key, param in self.lora.named_parameters(name)}
            return self.lora.local_state_dict(name)

        return {"lora": dataclasses.asdict(task.lora), "algo": dataclasses.asdict(task.algo),
                "adapter": adapter(task_id), "optimizer": task.optimizer.state_dict(),
                "version": task.version, "tensor_parallel": self.tp_size, "tp_rank": self.tp_rank,
                "expert_parallel": self.ep_size, "ep_rank": self.ep_rank,
                "bound": task.bound, "snapshots": {v: adapter(_snapshot_name(task_id, v)) for v in task.snapshots}}

    def load_state_dict(self, task_id: str, state: dict[str, Any]) -> None:
        """Restores a task saved by `state_dict` on the same TP rank of a trainer with the same TP size."""
        if state["tensor_parallel"] != self.tp_size or state["tp_rank"] != self.tp_rank:
            raise ValueError(f"state saved at TP rank {state['tp_rank']}/{state['tensor_parallel']}, "
                             f"this is rank {self.tp_rank}/{self.tp_size}; use export/load_adapter to reshard")
        ep_rank = self.ep_rank
        if (state.get("expert_parallel", 1), state.get("ep_rank", 0)) != (self.ep_size, ep_rank):
            raise ValueError(f"state saved at EP rank {state.get('ep_rank', 0)}/{state.get('expert_parallel', 1)}, "
                             f"this is rank {ep_rank}/{self.ep_size}; use export/load_adapter to reshard")
        lora = dict(state["lora"])
        lora["target_modules"] = tuple(lora["target_modules"])
        spec, algo = LoraSpec(**lora), load_config(AlgoSpec, state["algo"], "algo")
        if task_id in self.tasks:
            self.remove_task(task_id)
        self.add_task(task_id, spec, algo, max_staleness=state.get("bound", 0))
        task = self.tasks[task_id]
        self.lora.load_local_state_dict(task_id, state["adapter"])
        for version, shards in sorted(state.get("snapshots", {}).items()):
            self._add_snapshot(task_id, task, version, shards)
        task.optimizer.load_state_dict(state["optimizer"])
        task.version = int(state["version"])

    def snapshot(self, task_ids: Sequence[str]) -> dict[str, dict | None]:
        """Host copies of these tasks' states (None: no such task), for `restore`: what a step may change before it
        fails on some rank (runtime/group_guard.py)."""
        snapshot = {task_id: _to_host(self._state(task_id, live=True)) if task_id in self.tasks else None
                    for task_id in task_ids}
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the copies to the host have landed
        return snapshot

    def restore(self, snapshot: dict[str, dict | None]) -> None:
        """Puts these tasks back as `snapshot` found them (a task absent then is removed)."""
        for task_id, state in snapshot.items():
            if state is not None:
                self.load_state_dict(task_id, state)
            elif task_id in self.tasks:
                self.remove_task(task_id)

    # -- process groups -----------------------------------------------------------------------------------
    def _group_roots(self) -> list:
        """Everything that holds a process group (trainer/process_groups.py)."""
        return [self, self.head, self.lora, *self.lora.sites, self.attention, *self.model.modules()]

    def take_down_groups(self) -> list[str]:
        """Ends this rank's TP/DP groups (a peer waiting in one of them is freed); returns the names of any that
        something still holds."""
        return process_groups.take_down(self._group_roots())

    def remake_groups(self) -> None:
        """Makes the groups again in place (collective over the trainer group's ranks, after `take_down_groups`)."""
        self.group_epoch += 1
        process_groups.remake(self._group_roots(), self.group_store, self.backend, self.group_rank, self.group_size,
                              self.tp_size, expert_parallel=self.ep_size)

    def close(self) -> None:
        """Removes the LoRA hooks (the process groups stay up: they belong to the process)."""
        self.lora.close()
        self.tasks.clear()
