"""`marlaas plan CONFIG`: will each GPU rank of the job fit its GPU? Per rank kind (a trainer rank of a TP group, a
rollout rank), the device memory estimate.py gives from the model's config.json (no weights), against
`layout.<component>.gpu_memory_gib`. Exits 1 naming the field to change when a rank would not fit; `marlaas run`
and `marlaas submit` run the same check (`check_fits`) before any rank starts.

    marlaas plan configs/qwen3-0.6b-gsm8k.yaml --model random:qwen3-0.6b [--row-tokens 2048] [--dry-run]
    marlaas plan configs/multi-model-demo.yaml --model chat=random:qwen3-0.6b [--model tiny=...]

`--model` points at any directory holding a config.json, or names a shape of model/random_checkpoints.py
(`random:qwen3-0.6b`, `random:qwen3-8b`): the shipped config's `model:` is a placeholder path. A job of several
`models` takes `--model NAME=PATH` per model to override (repeatable). Each model gets the trainer plan of the
trainer groups that load it; the rollout rank is planned for the model whose engine needs the most of vLLM's share
(the others sleep, their weights in host memory). `--dry-run` also runs the GPU dry run (dry_run.py) of one
trainer rank per model and prints what it measured next to the estimate.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from marlaas_hpc.config_loader import SpecError
from marlaas_hpc.model.shape import ModelShape
from marlaas_hpc.plan.estimate import (DELTA_IN_FLIGHT, DTYPE_BYTES, GIB, NCCL_BYTES_PER_COMMUNICATOR, RolloutInputs,
                                       RolloutMemory, TrainerInputs, TrainerMemory, logits_chunk_tokens, padded_vocab,
                                       peft_adapter_elements, rollout_memory, trainer_memory)

CUDA_CONTEXT_BYTES = GIB
"""Per GPU process, outside what PyTorch allocates: the CUDA context and cuBLAS workspaces (an estimate: about
0.5-1 GiB on an H100). NCCL's buffers are counted per communicator."""
DEFAULT_PROMPT_TOKENS = 32
"""The prompt of each planned row: short, so nearly every token of the micro-batch is trained (the most logits)."""
VLLM_MAX_NUM_SEQS = 256
"""vLLM's max_num_seqs when vllm.max_num_seqs is unset."""


@dataclass(frozen=True, kw_only=True)
class RankPlan:
    """One kind of GPU rank: its memory lines, and what to change when they exceed its GPU."""

    kind: str
    """'trainer' or 'rollout'."""
    title: str
    lines: list[tuple[str, int]]
    total: int
    limit: int
    """Bytes the rank may use: its GPU (less vLLM's share under layout.share_gpus), or vLLM's share of it."""
    limit_label: str
    advice: tuple[str, str] | None = None
    """(field, message) when total > limit."""
    notes: list[str] = field(default_factory=list)
    model: str | None = None
    """The model's name in `JobConfig.model_names` (a job of several models), else None."""
    host: tuple[int, int | None] | None = None
    """(bytes, limit): host RAM per node this rank kind needs beyond its process (a rollout rank's in-memory
    adapters, and the sleeping engines' weights of a job of several models), against the component's `mem`
    (limit None: not set, not checked); None for a trainer rank."""

    @property
    def fits(self) -> bool:
        return self.total <= self.limit and (self.host is None or self.host[1] is None or self.host[0] <= self.host[1])


# ---------------------------------------------------------------------------------------------- model
def model_dims(job, model: str | None = None) -> tuple[ModelShape, str]:
    """The model's dims and a name for them, from `model` (a dir with config.json or 'random:<shape>') or the
    config's `model:`, without building or reading any weights. SpecError naming `model` if there is none, or if
    its config.json is not a family the job serves."""
    from marlaas_hpc.model.families import UnservedCheckpoint

    name = model or job.model
    try:
        dims = ModelShape.read(model_config_dir(name))
    except UnservedCheckpoint as exc:
        raise SpecError("model", str(exc)) from None
    return dims, name


def model_config_dir(name: str) -> Path:
    """A directory holding the model's config.json: the tiny model's shipped one, chat-mini's or chat-mini-moe's, a
    random shape's (written once into the cache), or the named checkpoint dir."""
    from marlaas_hpc.model.chat_mini import RECIPES, ensure_chat_mini
    from marlaas_hpc.model.random_checkpoints import RANDOM_PREFIX, SHAPES, write_config

    if name == "tiny":
        return Path(__file__).resolve().parents[1] / "tiny_weights"
    if name in RECIPES:  # shipped compact, expanded once into the cache (seconds)
        return ensure_chat_mini(RECIPES[name])
    if name.startswith(RANDOM_PREFIX):
        if name[len(RANDOM_PREFIX):] not in SHAPES:
            raise SpecError("model", f"unknown shape {name!r}; known: {[RANDOM_PREFIX + s for s in SHAPES]}")
        return write_config(name[len(RANDOM_PREFIX):])
    if not Path(name, "config.json").is_file():
        raise SpecError("model", f"{name!r} holds no config.json (nor is it 'tiny', 'chat-mini', 'chat-mini-moe' or "
                                 "'random:<shape>'): download the checkpoint there or fill in its path; `marlaas "
                                 "plan --model DIR` estimates from any directory holding the model's config.json "
                                 "(no weights), `--model random:qwen3-0.6b` / `random:qwen3-8b` from a shape")
    return Path(name)


def model_field(job, name: str) -> str:
    """The config field giving model `name`'s path: `models.<name>`, or `model` in a job of a single `model:`."""
    return f"models.{name}" if job.models else "model"


def job_model_dims(job) -> dict[str, ModelShape]:
    """Every base model's dims by its name in `JobConfig.model_names` (the default first), from config.json
    alone; SpecError naming the model's field (`models.<name>` or `model`) if one has none."""
    dims = {}
    for name, path in job.model_names().items():
        try:
            dims[name] = model_dims(job, path)[0]
        except SpecError as exc:
            raise SpecError(model_field(job, name), exc.reason) from None
    for name in dict.fromkeys(job.group_models()):
        check_expert_layout(job, dims[name], name)
    return dims


def check_expert_layout(job, dims: ModelShape, name: str) -> None:
    """layout.trainer_ep against a model a trainer group loads: the layout checks that EP divides trainer_dp and
    that TP is 1; only the model tells whether it has experts for EP to split, and whether EP divides them
    (trainer/model.py `check_expert_parallel` refuses the same at the trainer's start)."""
    from marlaas_hpc.model.checkpoint import check_expert_split

    check_expert_split(job.layout.trainer_ep, dims.num_experts, f"model {name}" if job.models else "the model",
                       "layout.trainer_ep")


def model_overrides(job, values: list[str]) -> dict[str, str]:
    """`--model` values as model name -> path: each `NAME=PATH` (NAME one of the job's models; split at the first
    '='), or one bare PATH in a job of one model. SpecError naming `--model` otherwise."""
    names = job.model_names()
    overrides = {}
    for value in values:
        name, equals, path = value.partition("=")
        if not equals:
            if len(names) > 1:
                raise SpecError("--model", f"the job has {len(names)} models {sorted(names)}: override one with "
                                           f"--model NAME=PATH (e.g. --model {next(iter(names))}={value})")
            name, path = next(iter(names)), value
        elif name not in names:
            raise SpecError("--model", f"unknown model {name!r} in {value!r}; the job's models: {sorted(names)}")
        if not path:
            raise SpecError("--model", f"{value!r} gives no path")
        overrides[name] = path
    return overrides


def with_model_paths(job, paths: dict[str, str]):
    """The job with each model of `paths` (name -> path, `model_overrides`) at its path."""
    if not paths:
        return job
    if not job.models:  # a single `model:`, named by its path
        return replace(job, model=next(iter(paths.values())))
    models = {name: paths.get(name, path) for name, path in job.models.items()}
    return replace(job, models=models, model=next(iter(models.values())))


# ---------------------------------------------------------------------------------------------- trainer
def trainer_inputs(job, dims: ModelShape, row_tokens: int | None = None,
                   prompt_tokens: int = DEFAULT_PROMPT_TOKENS, model: str | None = None) -> TrainerInputs:
    """A trainer rank of the job on a GPU: the base in bf16 unless trainer.dtype says float32, 'auto' attention
    is FlexAttention, micro-batches of trainer.micro_batch_tokens in rows of `row_tokens` (default: the longest
    sequence the rollout can return, vllm.max_model_len, else the model's context). `model`: a rank of a group
    loading that model (its tasks make the fused step when trainer.micro_batch_tokens is 0); None: any."""
    width = row_tokens or job.vllm.max_model_len or dims.max_position_embeddings
    budget = job.trainer.micro_batch_tokens
    if budget == 0:  # one pass over a whole fused step: its longest batch of every fused task
        tasks = [task for task in job.tasks if model is None or task_model(job, task) == model]
        longest = max((task.algo.batch_prompts * task.algo.group_size for task in tasks), default=1)
        budget = job.trainer_slots * longest * width
    layout, nccl_delta = job.layout, delta_on_nccl(job)
    return TrainerInputs(dims=dims, tensor_parallel=layout.trainer_tp,
                         dtype_bytes=4 if job.trainer.dtype == "float32" else 2, micro_batch_tokens=budget,
                         row_tokens=width, prompt_tokens=min(prompt_tokens, max(0, min(width, budget) - 1)),
                         lora_rank=job.max_lora_rank, max_adapters=job.max_adapters, fused_tasks=job.trainer_slots,
                         recompute=job.trainer.recompute,
                         attention="dense" if job.trainer.attention == "dense" else "flex",
                         data_parallel=layout.trainer_dp, expert_parallel=layout.trainer_ep,
                         delta_buffers=DELTA_IN_FLIGHT if nccl_delta else 0,
                         allocator_reserve=job.trainer.allocator_reserve)


def delta_on_nccl(job) -> bool:
    """Whether the delta plane's buffers and communicators are on the GPUs: the broadcast between ranks with GPUs
    of their own (the relay tier's links are gloo; under layout.share_gpus two members share a GPU: gloo)."""
    return job.delta.transport == "broadcast" and not job.layout.share_gpus


def task_model(job, task) -> str:
    """The name (in `JobConfig.model_names`) of the model a task trains."""
    from marlaas_hpc.tasks.spec import check_base_model

    return check_base_model(task.base_model, job.model_names())


def trainer_lines(memory: TrainerMemory) -> list[tuple[str, int]]:
    inputs = memory.inputs
    dims, tasks = inputs.dims, inputs.max_adapters
    dtype = "bfloat16" if inputs.dtype_bytes == 2 else "float32"
    shard_vocab = padded_vocab(dims, inputs.tensor_parallel) // inputs.tensor_parallel
    weights = f"base weights ({dtype})"
    ep = inputs.expert_parallel
    if dims.num_experts and ep > 1:  # (EP runs at TP 1: each local expert is whole)
        weights += f": {dims.num_experts}/{ep} experts per rank (expert parallelism {ep}), router whole"
    elif dims.num_experts:  # TP splits every expert
        weights += (f": all {dims.num_experts} experts, 1/{inputs.tensor_parallel} of each (no expert "
                    "parallelism), router whole")
    lines = [(weights, memory.base_weights),
             (f"LoRA weights r{inputs.lora_rank}: {_gib(memory.lora_per_task)} per task x {tasks} (max_adapters)",
              tasks * memory.lora_per_task),
             (f"gradients + AdamW moments: {_gib(memory.optimizer_per_task)} per task x {tasks}",
              tasks * memory.optimizer_per_task),
             (f"activations: {inputs.tokens} tokens ({inputs.rows} rows x {inputs.width}), {inputs.attention} "
              f"attention, {'recompute' if inputs.recompute else 'no recompute'}", memory.activations),
             (f"LM head: {inputs.trained_tokens} trained tokens' hidden states + 2 float32 logit chunks of "
              f"{logits_chunk_tokens(inputs)} x {shard_vocab} (vocab/TP)", memory.logits)]
    if memory.dispatch:
        lines.append((f"expert dispatch buffers (all-to-all in + out): {inputs.tokens} tokens x top "
                      f"{dims.experts_per_token} x hidden {dims.hidden_size}, spread evenly", memory.dispatch))
    if memory.score_buffer:
        lines.append(("megatron's kept attention score buffer (dense)", memory.score_buffer))
    if inputs.attention == "flex":
        lines.append((f"FlexAttention block mask (its build's {_gib(memory.flex_mask_build)} is before the peak)",
                      memory.flex_mask))
    lines.append((f"delta buffers in flight (the leader's, NCCL): {inputs.delta_buffers} x "
                  f"{_gib(memory.delta_in_flight // max(1, inputs.delta_buffers))} adapter, float32",
                  memory.delta_in_flight))
    lines.append((f"allocator reserve: {inputs.allocator_reserve:g} (trainer.allocator_reserve) of the tensors' "
                  f"{_gib(memory.tensors)}", memory.reserve))
    lines.append((f"NCCL buffers: {inputs.communicators} communicator(s) ({communicator_names(inputs)}) x "
                  f"{_gib(NCCL_BYTES_PER_COMMUNICATOR)} (estimate)", memory.nccl))
    return lines + [("CUDA context, cuBLAS (estimate)", CUDA_CONTEXT_BYTES)]


def communicator_names(inputs: TrainerInputs) -> str:
    """The NCCL communicators `trainer_inputs` counted, in words."""
    return ", ".join(inputs.communicator_names) or "none"


def trainer_total(inputs: TrainerInputs) -> int:
    return trainer_memory(inputs).total + CUDA_CONTEXT_BYTES


def trainer_plan(job, dims: ModelShape, row_tokens: int | None = None,
                 prompt_tokens: int = DEFAULT_PROMPT_TOKENS, model: str | None = None) -> RankPlan:
    """A trainer rank; `model`: of the groups loading that model (a job of several models), None: of every group."""
    inputs = trainer_inputs(job, dims, row_tokens, prompt_tokens, model)
    memory = trainer_memory(inputs)
    gpu = int(job.layout.trainer.gpu_gib * GIB)
    limit, label = gpu, gpu_label(job.layout.trainer, "trainer")
    if job.layout.share_gpus:  # a vLLM engine on the same GPU takes gpu_memory_utilization of it
        limit = int(gpu * (1 - job.vllm.gpu_memory_utilization))
        label += f", less vLLM's {job.vllm.gpu_memory_utilization:g} of it (layout.share_gpus)"
    total = memory.total + CUDA_CONTEXT_BYTES
    layout = job.layout
    groups = layout.trainer_groups if model is None else job.group_models().count(model)
    ep = f", layout.trainer_ep {layout.trainer_ep}" if layout.trainer_ep > 1 else ""
    title = (f"{'' if model is None else f'model {model}: '}trainer rank x{groups * layout.trainer_group_size} "
             f"(layout.trainer_tp {layout.trainer_tp}, {groups} group(s) x {layout.trainer_dp} DP{ep})")
    advice = None if total <= limit else trainer_advice(job, inputs, total, limit)
    return RankPlan(kind="trainer", title=title, lines=trainer_lines(memory), total=total, limit=limit,
                    limit_label=label, advice=advice, model=model)


def trainer_advice(job, inputs: TrainerInputs, total: int, limit: int) -> tuple[str, str]:
    """The field to change first, and every change that alone would make the rank fit."""
    options, first = [], None
    fitting = largest_micro_batch(inputs, limit)
    if fitting:
        first = first or "trainer.micro_batch_tokens"
        options.append(f"lower trainer.micro_batch_tokens to at most {fitting}")
    if not inputs.recompute and (alt := trainer_total(replace(inputs, recompute=True))) <= limit:
        first = first or "trainer.recompute"
        options.append(f"set trainer.recompute: true ({_gib(alt)})")
    if inputs.attention == "dense" and (alt := trainer_total(replace(inputs, attention="flex"))) <= limit:
        first = first or "trainer.attention"
        options.append(f"set trainer.attention: flex ({_gib(alt)})")
    tp = 2 * inputs.tensor_parallel
    if inputs.expert_parallel == 1 and _splits(inputs.dims, tp) and \
            (alt := trainer_total(replace(inputs, tensor_parallel=tp))) <= limit:  # EP runs at TP 1 only
        first = first or "layout.trainer_tp"
        options.append(f"raise layout.trainer_tp to {tp} ({_gib(alt)})")
    if option := expert_parallel_option(inputs, limit):
        first = first or option[0]
        options.append(option[1])
    if not options:
        parallel = ("raise layout.trainer_ep (layout.trainer_dp with it)" if inputs.expert_parallel > 1 else
                    "raise layout.trainer_tp")
        return ("layout.trainer_ep" if inputs.expert_parallel > 1 else "layout.trainer_tp",
                f"a trainer rank needs {_gib(total)} of {_gib(limit)} and no single change fits it: {parallel}, "
                "lower trainer.micro_batch_tokens and set trainer.recompute: true together, or use larger GPUs "
                "(layout.trainer.gpu_memory_gib)" + expert_adapter_hint(inputs))
    return first, f"a trainer rank needs {_gib(total)} of {_gib(limit)}: " + ", or ".join(options)


def expert_parallel_option(inputs: TrainerInputs, limit: int) -> tuple[str, str] | None:
    """(field, change) of the smallest expert parallelism above the current one at which an MoE's trainer rank
    fits, or None (a dense model, or none fits). EP must divide the experts and trainer_dp (its ranks are a
    group's DP ranks: trainer_dp is raised to its next multiple) and runs at TP 1: from TP > 1 the change trades
    TP for EP and names layout.trainer_tp, where it starts (the layout refuses EP > 1 beside TP > 1)."""
    dims = inputs.dims
    for ep in range(inputs.expert_parallel + 1, dims.num_experts + 1):
        if dims.num_experts % ep:
            continue
        dp = -(-inputs.data_parallel // ep) * ep
        alt = trainer_total(replace(inputs, tensor_parallel=1, expert_parallel=ep, data_parallel=dp))
        if alt > limit:
            continue
        changes = f"layout.trainer_ep to {ep}" + (
            f" and layout.trainer_dp to {dp}, a multiple of it" if dp != inputs.data_parallel else "")
        if inputs.tensor_parallel > 1:
            return "layout.trainer_tp", (f"trade TP for expert parallelism: set layout.trainer_tp to 1, {changes} "
                                         f"({_gib(alt)})")
        return "layout.trainer_ep", f"raise {changes} ({_gib(alt)})"
    return None


def expert_adapter_hint(inputs: TrainerInputs) -> str:
    """An MoE's adapters: TP shrinks them little (each expert's fc1 A and fc2 B are whole on every rank), EP splits
    the experts' part, fewer or smaller ones do ('' for a dense model)."""
    if not inputs.dims.num_experts:
        return ""
    memory = trainer_memory(inputs)
    ep = inputs.expert_parallel
    experts = "every expert" if ep == 1 else f"its rank's {inputs.dims.num_experts // ep} experts"
    split = "little of it split by TP" if ep == 1 else f"its experts' part split by EP {ep}"
    return (f"; each task's adapter on {experts} takes {_gib(memory.lora_per_task + memory.optimizer_per_task)} "
            f"a rank with its gradients and AdamW moments, {inputs.max_adapters} tasks (max_adapters) "
            f"{_gib(memory.adapters)}, {split}: fewer tasks or a lower max_lora_rank shrink it")


def largest_micro_batch(inputs: TrainerInputs, limit: int, step: int = 256) -> int:
    """The largest trainer.micro_batch_tokens (a multiple of `step`) below the current one that fits, or 0."""
    low, high = 0, inputs.micro_batch_tokens // step
    while low < high:  # the estimate grows with the budget
        middle = (low + high + 1) // 2
        if trainer_total(replace(inputs, micro_batch_tokens=middle * step)) <= limit:
            low = middle
        else:
            high = middle - 1
    return low * step if low * step < inputs.micro_batch_tokens else 0


def _splits(dims: ModelShape, tp: int) -> bool:
    widths = (dims.num_heads, dims.num_kv_heads, dims.intermediate_size) + (
        (dims.expert_intermediate_size,) if dims.num_experts else ())
    return all(value % tp == 0 for value in widths)


def gpu_label(resources, component: str) -> str:
    """'79.6 GiB GPU (an h100-80gb: layout.trainer.gpu_type)', or the site's own layout.<component>.gpu_memory_gib."""
    if resources.gpu_memory_gib is not None:
        return f"{resources.gpu_gib:g} GiB GPU (layout.{component}.gpu_memory_gib)"
    from marlaas_hpc.launch.layout import DEFAULT_GPU_TYPE

    how = f"layout.{component}.gpu_type" if resources.gpu_type else f"the default, layout.{component}.gpu_type unset"
    return f"{resources.gpu_gib:g} GiB GPU (an {resources.gpu_type or DEFAULT_GPU_TYPE}: {how})"


# ---------------------------------------------------------------------------------------------- rollout
def rollout_inputs(job, dims: ModelShape, model_dtype: str = "bfloat16") -> RolloutInputs:
    vllm = job.vllm
    dtype = model_dtype if vllm.dtype == "auto" else vllm.dtype
    engine = vllm.engine_kwargs(job.max_adapters, job.max_lora_rank, job.largest_staleness())
    return RolloutInputs(dims=dims, tensor_parallel=vllm.tensor_parallel_size, dtype_bytes=DTYPE_BYTES[dtype],
                         gpu_bytes=int(job.layout.rollout.gpu_gib * GIB),
                         gpu_memory_utilization=vllm.gpu_memory_utilization, max_loras=engine["max_loras"],
                         max_lora_rank=job.max_lora_rank,
                         max_model_len=vllm.max_model_len or dims.max_position_embeddings,
                         max_num_seqs=vllm.max_num_seqs or VLLM_MAX_NUM_SEQS)


def rollout_need(memory: RolloutMemory) -> int:
    """What an engine needs of its GPU to start: weights, LoRA slots, profiling, context and the KV cache of one
    sequence of max_model_len (vLLM refuses to start with less)."""
    fixed = memory.weights + memory.lora_slots + memory.activations + CUDA_CONTEXT_BYTES
    return fixed + memory.inputs.max_model_len * memory.kv_bytes_per_token


def rollout_plan(job, dims: ModelShape, model: str | None = None) -> RankPlan:
    """A rollout rank's engine of one model (`model`: its name in a job of several, else None): vLLM's share of
    the GPU, and beside it what the delta plane puts on the GPU after vLLM sized its KV cache."""
    inputs = rollout_inputs(job, dims)
    memory = rollout_memory(inputs)
    kv = memory.kv_cache - CUDA_CONTEXT_BYTES
    sequences = max(0, kv) // (memory.kv_bytes_per_token * inputs.max_model_len)
    tokens = max(0, kv) // memory.kv_bytes_per_token
    dims_text = f"{inputs.max_lora_rank} (max_lora_rank) x 7 projections x {dims.num_layers} layers"
    weights = f"weights ({'bfloat16' if inputs.dtype_bytes == 2 else 'float32'})"
    if dims.num_experts:
        dims_text = (f"{inputs.max_lora_rank} (max_lora_rank) x (4 attention + {dims.num_experts} experts x 3) "
                     f"projections x {dims.num_layers} layers")
        weights += f": all {dims.num_experts} experts, 1/{inputs.tensor_parallel} of each (no expert parallelism)"
    lines = [(weights, memory.weights),
             (f"LoRA slots: {inputs.max_loras} (vllm.max_loras) x r{dims_text}", memory.lora_slots),
             ("activations of vLLM's profiling forward (estimate)", memory.activations),
             ("CUDA context, cuBLAS (estimate)", CUDA_CONTEXT_BYTES),
             (f"KV cache: the rest of vLLM's share = {tokens} tokens, {sequences} sequences of max_model_len "
              f"{inputs.max_model_len}", max(0, kv))]
    beside = delta_beside_vllm(job, dims)
    label = (f"vllm.gpu_memory_utilization {inputs.gpu_memory_utilization:g} of a "
             f"{gpu_label(job.layout.rollout, 'rollout')}")
    title = f"rollout rank x{job.layout.rollout_ranks} (vllm.tensor_parallel_size {inputs.tensor_parallel})"
    if model is not None:
        title += f", awake: model {model}"
    if sequences < 1:
        needed = rollout_need(memory)
        utilization = needed / inputs.gpu_bytes
        fix = (f"raise vllm.gpu_memory_utilization to at least {utilization:.2f}" if utilization <= 0.95 else
               "lower vllm.max_model_len, vllm.max_loras or max_lora_rank, or raise vllm.tensor_parallel_size")
        advice = ("vllm.gpu_memory_utilization",
                  f"a rollout rank's KV cache holds {max(0, tokens)} tokens, less than one sequence of "
                  f"vllm.max_model_len {inputs.max_model_len} (vLLM refuses to start): {fix}")
        plan = RankPlan(kind="rollout", title=title, lines=lines, total=needed, limit=memory.budget,
                        limit_label=label, advice=advice, model=model)
    else:
        plan = beside_vllm_plan(job, RankPlan(kind="rollout", title=title, lines=lines, total=memory.budget,
                                              limit=memory.budget, limit_label=label, model=model), beside, inputs)
    return plan


def delta_beside_vllm(job, dims: ModelShape) -> list[tuple[str, int]]:
    """What a rollout rank's delta plane puts on its GPU, outside vLLM's share (made after vLLM sized its KV
    cache): under the broadcast on NCCL, one channel per trainer leader and the buffers of the broadcasts posted
    and not yet complete (each leader has at most DELTA_IN_FLIGHT in flight)."""
    if not delta_on_nccl(job):
        return []
    leaders, adapter = job.layout.trainer_groups, 4 * peft_adapter_elements(dims, job.max_lora_rank)
    return [(f"delta receive buffers: {leaders} leader(s) x {DELTA_IN_FLIGHT} in flight x {_gib(adapter)} adapter",
             leaders * DELTA_IN_FLIGHT * adapter),
            (f"NCCL buffers: {leaders} delta channel(s) x {_gib(NCCL_BYTES_PER_COMMUNICATOR)} (estimate)",
             leaders * NCCL_BYTES_PER_COMMUNICATOR)]


def beside_vllm_plan(job, plan: RankPlan, beside: list[tuple[str, int]], inputs: RolloutInputs) -> RankPlan:
    """The rank's GPU holds vLLM's share and what the delta plane puts beside it: refused naming
    vllm.gpu_memory_utilization (with the value that fits) when they exceed the GPU."""
    if not beside:
        return plan
    extra = sum(size for _, size in beside)
    total, gpu = plan.total + extra, inputs.gpu_bytes
    advice = None
    if total > gpu:
        fitting = (gpu - extra) / gpu
        advice = ("vllm.gpu_memory_utilization", f"a rollout rank's GPU holds vLLM's {_gib(plan.total)} and "
                  f"{_gib(extra)} of delta buffers beside it, {_gib(total)} of {_gib(gpu)}: lower "
                  f"vllm.gpu_memory_utilization to at most {fitting:.2f}")
    return replace(plan, lines=plan.lines + [(f"{label}, beside vLLM's share", size) for label, size in beside],
                   total=total, limit=gpu, advice=advice, limit_label=f"{plan.limit_label}, "
                   f"and the delta plane's buffers beside it in the {_gib(gpu)}")


def rollout_host_bytes(job, dims: ModelShape) -> int:
    """Host memory of one rollout rank's in-memory adapters: every version its engine holds as float32 tensors
    until it retires it (per task the current one, the ones open groups still sample with: up to the largest
    staleness bound, and one arriving), and vLLM's CPU LoRA cache (as many of those as vllm.max_cpu_loras holds,
    in its dtype). In a job of several models, counted at the largest model's adapter size: an upper bound."""
    adapter = peft_adapter_elements(dims, job.max_lora_rank)
    engine = job.vllm.engine_kwargs(job.max_adapters, job.max_lora_rank, job.largest_staleness())
    dtype = DTYPE_BYTES["bfloat16" if job.vllm.dtype == "auto" else job.vllm.dtype]
    versions = job.max_adapters * (job.largest_staleness() + 2)
    return versions * 4 * adapter + min(engine["max_cpu_loras"], versions) * dtype * adapter


def models_rollout_plan(job, dims: dict[str, ModelShape]) -> RankPlan:
    """The rollout rank of a job of several models: one engine per model, one awake. vLLM takes
    gpu_memory_utilization of the GPU whatever the model, so the rank is planned for the engine that needs the
    most of it (`rollout_need`: it fails first); the others' needs are noted, and their weights, asleep (vLLM
    sleep level 1), are host memory of the rank, not GPU memory."""
    memories = {name: rollout_memory(rollout_inputs(job, model_dims_)) for name, model_dims_ in dims.items()}
    awake = max(memories, key=lambda name: rollout_need(memories[name]))
    asleep = [name for name in memories if name != awake]
    notes = [f"engine of model {name} when awake: needs {_gib(rollout_need(memories[name]))} with one sequence's "
             f"KV cache, of {_gib(memories[name].budget)}" for name in asleep]
    host = sum(memories[name].weights * memories[name].inputs.tensor_parallel for name in asleep)
    notes.append(f"sleeping engines (model {', '.join(asleep)}): {_gib(host)} of weights in host memory per rank "
                 "(vLLM sleep level 1): host RAM (layout.rollout.mem), not GPU")
    if job.vllm.own_process(len(dims), on_gpu=True):  # vLLM starts only if the GPU's free memory covers its share
        notes.append(f"each sleeping engine's core runs in a process of its own (vllm.engine_process), whose CUDA "
                     f"context stays on the GPU: ~{_gib(len(asleep) * CUDA_CONTEXT_BYTES)} beside vLLM's share")
    plan = rollout_plan(job, dims[awake], awake)
    plan = replace(plan, title=f"{plan.title} (the largest engine of {len(dims)})", notes=notes)
    adapters = max(rollout_host_bytes(job, model_dims_) for model_dims_ in dims.values())
    return with_host_check(job, plan, adapters, host, asleep)


def with_host_check(job, plan: RankPlan, adapters: int, sleeping: int = 0, asleep: list[str] = ()) -> RankPlan:
    """The rollout plan with the host RAM per node its rank kind needs beyond its process: each node holds its
    share of the rollout ranks, each with its in-memory adapters (`rollout_host_bytes`) and, in a job of several
    models, the sleeping engines' weights. Checked against `layout.rollout.mem` when it is set."""
    limit = slurm_mem_bytes(job.layout.rollout.mem)
    ranks = math.ceil(job.layout.rollout_ranks / job.layout.rollout.nodes)
    needed = ranks * (adapters + sleeping)
    if limit is None:
        return replace(plan, host=(needed, None))
    advice, model = plan.advice, plan.model
    if needed > limit and plan.total <= plan.limit:  # the refusal names host memory, not the awake engine
        model = None
        what = f"in-memory adapters ({_gib(adapters)})" + (
            f" and the sleeping engines' weights (model {', '.join(asleep)}: {_gib(sleeping)})" if asleep else "")
        advice = ("layout.rollout.mem",
                  f"a rollout rank's {what} take {_gib(needed)} of host RAM per node ({ranks} rollout rank(s) x "
                  f"{_gib(adapters + sleeping)}), more than layout.rollout.mem {job.layout.rollout.mem}: raise it, "
                  "or spread the rollout ranks over more nodes (layout.rollout.nodes)")
    return replace(plan, advice=advice, model=model, host=(needed, limit), limit_label=f"{plan.limit_label}, "
                   f"{ranks} rollout rank(s) per node in layout.rollout.mem {job.layout.rollout.mem}")


def slurm_mem_bytes(mem: str | None) -> int | None:
    """sbatch --mem as bytes: a number with an optional K/M/G/T suffix, megabytes without one (Slurm's unit)."""
    if mem is None:
        return None
    scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    return int(mem[:-1]) * scale[mem[-1]] if mem[-1] in scale else int(mem) * 2**20


# ---------------------------------------------------------------------------------------------- job
def gpu_kinds(job, gpus_visible: bool | None = None) -> list[str]:
    """The rank kinds that run on GPUs: under Slurm the components that ask for GPUs (`gpus_visible` None), in
    local mode the rollout and trainer ranks when this machine's GPUs are visible. Never with
    layout.accelerator 'cpu'; the rollout kind only with the vllm engine."""
    if job.layout.accelerator == "cpu":
        return []
    kinds = []
    for kind in ("rollout", "trainer"):
        on_gpu = job.layout.resources(kind).requests_gpus() if gpus_visible is None else gpus_visible
        if on_gpu and (kind == "trainer" or job.engine == "vllm"):
            kinds.append(kind)
    return kinds


def job_plan(job, dims: dict[str, ModelShape] | None = None, kinds=("trainer", "rollout"),
             row_tokens: int | None = None, prompt_tokens: int = DEFAULT_PROMPT_TOKENS) -> list[RankPlan]:
    """The plans of the job's GPU rank kinds: a trainer rank per model some trainer group loads, then the rollout
    rank (vllm engine). `dims`: `job_model_dims(job)`, read when None."""
    dims = job_model_dims(job) if dims is None else dims
    several = len(dims) > 1
    plans = []
    if "trainer" in kinds:
        loaded = job.group_models()
        plans += [trainer_plan(job, model_dims_, row_tokens, prompt_tokens, name if several else None)
                  for name, model_dims_ in dims.items() if name in loaded]
    if "rollout" in kinds and job.engine == "vllm":
        if several:
            plans.append(models_rollout_plan(job, dims))
        else:
            dims_ = next(iter(dims.values()))
            plans.append(with_host_check(job, rollout_plan(job, dims_), rollout_host_bytes(job, dims_)))
    return plans


def refusal(job, plan: RankPlan) -> tuple[str, str]:
    """The field to change and why, for a plan that does not fit; the model named in a job of several."""
    field_name, message = plan.advice
    if plan.model is not None:
        message = f"model {plan.model} ({model_field(job, plan.model)}): {message}"
    return field_name, message


def check_fits(job, gpus_visible: bool | None = None) -> None:
    """`marlaas run` / `submit`: SpecError naming the field to change (and the model, in a job of several) when a
    GPU rank would not fit its GPU."""
    from marlaas_hpc.model.random_checkpoints import RANDOM_PREFIX

    kinds = gpu_kinds(job, gpus_visible)
    if not kinds:
        return
    for name, path in job.model_names().items():
        if not path.startswith(RANDOM_PREFIX):  # a missing checkpoint is refused as `marlaas run` refuses it
            job.model_path(name)
    for plan in job_plan(job, kinds=kinds):
        if not plan.fits:
            field_name, message = refusal(job, plan)
            raise SpecError(field_name, f"{message} (marlaas plan shows every rank's memory)")


# ---------------------------------------------------------------------------------------------- command
def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="device memory of every GPU rank from the model's config.json; exit 1 if "
                                    "one would not fit its GPU")
    p.add_argument("config", help="job config YAML")
    p.add_argument("--model", action="append", default=[], metavar="[NAME=]PATH",
                   help="a directory holding the model's config.json, or random:<shape> (default: the config's "
                        "model); in a job of several `models`, NAME=PATH overrides model NAME (repeatable)")
    p.add_argument("--row-tokens", type=int, help="width of a trainer row: the longest sequence (default: "
                                                  "vllm.max_model_len, else the model's context)")
    p.add_argument("--prompt-tokens", type=int, default=DEFAULT_PROMPT_TOKENS,
                   help="prompt of each row; the rest is trained (default: %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="also run one trainer rank's GPU path (per model) on "
                                                          "fake CUDA tensors and print its measured memory")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args) -> int:
    from marlaas_hpc.config import JobConfig

    try:
        job = JobConfig.load(args.config).validate()
        job = with_model_paths(job, model_overrides(job, args.model))
        dims = job_model_dims(job)
    except (SpecError, OSError) as exc:
        print(f"marlaas: invalid config {args.config}: {exc}", file=sys.stderr)
        return 2
    plans = job_plan(job, dims, row_tokens=args.row_tokens, prompt_tokens=args.prompt_tokens)
    paths = job.model_names()
    for name, model_dims_ in dims.items():
        print(f"{args.config}: model {name}: {model_dims_.describe()}" if len(dims) == 1 else
              f"{args.config}: model {name}: {paths[name]}: {model_dims_.describe()}")
    for plan in plans:
        print_plan(plan)
    print("control and env ranks: CPU only")
    if args.dry_run:
        print_dry_runs(job, plans, dims, args.row_tokens, args.prompt_tokens)
    failed = [plan for plan in plans if not plan.fits]
    for plan in failed:
        field_name, message = refusal(job, plan)
        print(f"marlaas: {field_name}: {message}", file=sys.stderr)
    return 1 if failed else 0


def print_plan(plan: RankPlan) -> None:
    print(f"{plan.title}, {plan.limit_label}:")
    for label, size in plan.lines:
        print(f"  {label:<96} {size / GIB:8.2f} GiB")
    verdict = "fits" if plan.total <= plan.limit else "DOES NOT FIT"
    if plan.kind == "trainer" or plan.limit != plan.total and any("beside vLLM" in label for label, _ in plan.lines):
        print(f"  {'total':<96} {plan.total / GIB:8.2f} GiB  {verdict} in {_gib(plan.limit)}")
    else:
        print(f"  {'vLLM takes':<96} {plan.limit / GIB:8.2f} GiB  {verdict}")
    if plan.host is not None:
        needed, limit = plan.host
        label = "host RAM per node: in-memory adapters" + (", sleeping engines' weights" if plan.notes else "")
        verdict = ("(layout.rollout.mem unset: not checked)" if limit is None else
                   f"{'fits' if needed <= limit else 'DOES NOT FIT'} in {_gib(limit)}")
        print(f"  {label:<96} {needed / GIB:8.2f} GiB  {verdict}")
    for note in plan.notes:
        print(f"  note: {note}")


def print_dry_runs(job, plans: list[RankPlan], dims: dict[str, ModelShape], row_tokens: int | None,
                   prompt_tokens: int) -> None:
    """The GPU dry run of one trainer rank per model; none for a mixture-of-experts model (said so)."""
    paths = job.model_names()
    for plan in (plan for plan in plans if plan.kind == "trainer"):
        name = plan.model or next(iter(dims))
        if dims[name].num_experts:
            # megatron's permute picks each expert's tokens with masked_select, whose output size depends on
            # the routing: fake tensors cannot size it (DynamicOutputShapeException), so the dry run fails there
            print(f"{'' if plan.model is None else f'model {plan.model}: '}no GPU dry run: it cannot route "
                  "tokens to experts on fake tensors (the estimate's expert terms are unchecked)")
        else:
            print_dry_run(job, paths[name], trainer_inputs(job, dims[name], row_tokens, prompt_tokens, plan.model),
                          plan.model)


def print_dry_run(job, model_name: str, inputs: TrainerInputs, model: str | None = None) -> None:
    """`model_name`: the model's path; `model`: its name in a job of several models."""
    from marlaas_hpc.model.cache import default_cache_dir
    from marlaas_hpc.plan.dry_run import DryRunShape, run_in_subprocess

    shape = DryRunShape(model_dir=str(model_config_dir(model_name)), tensor_parallel=inputs.tensor_parallel,
                        micro_batch_tokens=inputs.micro_batch_tokens, row_tokens=inputs.row_tokens,
                        prompt_tokens=inputs.prompt_tokens, lora_rank=inputs.lora_rank,
                        max_adapters=inputs.max_adapters, fused_tasks=inputs.fused_tasks,
                        dtype="bfloat16" if inputs.dtype_bytes == 2 else "float32", recompute=inputs.recompute,
                        attention=inputs.attention)
    result = run_in_subprocess(shape, default_cache_dir())
    memory = trainer_memory(inputs)
    print(f"{'' if model is None else f'model {model}: '}GPU dry run of trainer rank {result.tp_rank} of TP "
          f"{inputs.tensor_parallel} ({result.seconds:.0f} s, fake CUDA tensors; estimate / measured, without the "
          "CUDA context):")
    for label, estimate, measured in (("base weights", memory.base_weights, result.base_bytes),
                                      ("steady (weights, adapters, optimizer)", memory.steady, result.steady_bytes),
                                      ("a step adds (activations, logits)", memory.activations + memory.logits,
                                       result.step_added_bytes),
                                      ("peak", memory.step_peak, result.steady_peak_bytes)):
        print(f"  {label:<40} {estimate / GIB:8.2f} / {measured / GIB:8.2f} GiB ({estimate / measured - 1:+.1%})")
    print(f"  delta flatten adds {_gib(result.delta_peak_bytes)}; {result.host_syncs_per_step} device-to-host "
          f"syncs per step")


def _gib(size: int) -> str:
    return f"{size / GIB:.2f} GiB"
