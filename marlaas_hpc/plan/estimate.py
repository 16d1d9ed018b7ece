"""Device memory of each rank, from the model's config.json and the job config alone (no torch, no weights).

Trainer rank (one TP rank of a trainer group; every rank of the group holds the same; with expert parallelism,
layout.trainer_ep, each holds its EP rank's experts: as many as every other rank):

    base weights     every megatron parameter of this TP shard in the base dtype: embedding (and the untied output
                     layer) split by vocabulary rows (padded to 128 x TP), attention and MLP split by heads and
                     columns; the RMSNorm weights too (trainer/model.py casts the local spec's float32 norms)
    LoRA, per task   float32 A and B of the four megatron sites per layer (qkv, proj, fc1, fc2: trainer/lora.py)
    optimizer        per task: its gradients and AdamW's two moments, float32 (3 x the LoRA bytes); every task
                     that has stepped keeps them, so max_adapters tasks hold them at once
    activations      what one micro-batch of trainer.micro_batch_tokens keeps for backward, layer by layer
                     (`layer_bytes_per_token`), as the trainer's code saves it; with trainer.recompute only each
                     layer's input, plus one layer recomputed in backward
    LM head          the trained tokens' final hidden states (kept for backward) and the float32 logits of two
                     chunks of LOGITS_CHUNK_BYTES: the trainer's head computes log-softmax a chunk of tokens at a
                     time, forward and backward (trainer/lm_head.py)
    score buffer     attention 'dense' only: megatron keeps its largest [rows x heads, s, s] score buffer
    flex mask        attention 'flex': the block mask a micro-batch keeps (int32 block indices), and the chunk of
                     booleans its build evaluates at once (transient, before the first layer: not at the peak)
    delta buffers    the leader only, broadcast on NCCL: up to DELTA_IN_FLIGHT flat float32 copies of a whole
                     adapter posted and not yet completed (runtime/delta/broadcast.py MAX_IN_FLIGHT)
    dispatch         expert parallelism only: one MoE layer's all-to-all buffers (experts.py)
    NCCL             per communicator (TP, DP, EP and expert-DP groups, the leader's delta channel): NCCL's buffers, an
                     estimate from its defaults (`NCCL_BYTES_PER_COMMUNICATOR`)
    reserve          the caching allocator's memory over live tensors (fragmentation): trainer.allocator_reserve
                     of the rest

The activation and logits terms follow the code; tests/test_plan.py checks them against the GPU dry run
(dry_run.py), which runs the trainer's GPU path on fake CUDA tensors. The micro-batch is `rows` rows of
`row_tokens` (its longest sequence: vllm.max_model_len unless given), one sequence each, whose completion
(`row_tokens - prompt_tokens`) is trained.

Rollout rank (one vLLM engine): weights in vllm.dtype, LoRA slots (vllm max_loras x max_lora_rank on the seven
projections of every layer, A and B as vLLM stacks them), an activation reserve for vLLM's profiling forward
(`rollout_activation_bytes`: an estimate), and the KV cache that vllm.gpu_memory_utilization leaves.

Mixture-of-experts models (Qwen3-MoE): the experts' terms are experts.py's, layer by layer where
`ModelShape.is_expert_layer`; every expert on every rank (TP over the experts), or on a trainer with expert
parallelism (layout.trainer_ep, TP 1) num_experts / EP of them a rank, with their adapters and optimizer state.
"""
from __future__ import annotations

from dataclasses import dataclass

from marlaas_hpc.model.shape import ModelShape
from marlaas_hpc.plan.experts import (expert_backward_bytes_per_token, expert_dispatch_bytes,
                                      expert_layer_bytes_per_token, expert_layer_fixed_bytes, expert_lora_elements,
                                      expert_peft_elements, expert_weight_elements, moe_layers,
                                      rollout_expert_bytes_per_token, router_elements, vllm_expert_slot_elements)

GIB = 2 ** 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128
"""trainer/model.py's: megatron pads the vocabulary to a multiple of 128 x TP (imported here without torch)."""
ATTENTION_KERNELS = ("flex", "dense")
LOGITS_CHUNK_BYTES = 256 << 20
"""trainer/lm_head.py's: float32 logits the LM head computes at once (repeated here: that module imports torch)."""
FLEX_BLOCK = 128
"""trainer/attention.py's FlexAttention block (repeated here: that module imports torch)."""
FLEX_MASK_CHUNK_ELEMENTS = 1 << 24
"""trainer/attention.py's MASK_CHUNK_ELEMENTS: booleans of the visibility rule its block mask evaluates at once;
the build holds about five tensors of that size at its peak."""
DELTA_IN_FLIGHT = 16
"""runtime/delta/broadcast.py's DeltaChannel.MAX_IN_FLIGHT: broadcasts a leader posts before it waits (repeated
here: that module imports torch; tests/test_plan.py checks they agree)."""
NCCL_BYTES_PER_COMMUNICATOR = 16 * 2 * ((4 << 20) + (4608 << 10) + (256 << 10))
"""An estimate of one NCCL communicator's device buffers: per channel and per peer connection, one buffer per
protocol at NCCL's defaults (Simple: NCCL_BUFFSIZE 4 MiB; LL128 ~4.5 MiB; LL 256 KiB); 16 channels (what NCCL
typically opens within an NVLink node; NCCL_MAX_NCHANNELS bounds it) of 2 connections (a ring's two neighbours):
~283 MiB. Measured on a GPU it can be more (more channels) or less (NCCL_BUFFSIZE lowered)."""


def padded_vocab(dims: ModelShape, tp: int) -> int:
    """The vocabulary as megatron pads it: a multiple of MAKE_VOCAB_SIZE_DIVISIBLE_BY x TP."""
    multiple = MAKE_VOCAB_SIZE_DIVISIBLE_BY * tp
    return -(-dims.vocab_size // multiple) * multiple


@dataclass(frozen=True, kw_only=True)
class TrainerInputs:
    """One trainer rank's share of the job."""

    dims: ModelShape
    tensor_parallel: int
    dtype_bytes: int
    """Base weights: 2 (bfloat16, the GPU default) or 4."""
    micro_batch_tokens: int
    row_tokens: int
    prompt_tokens: int
    lora_rank: int
    max_adapters: int
    fused_tasks: int
    """trainer_slots: tasks fused into one step."""
    recompute: bool
    attention: str
    """'flex' or 'dense' (trainer.attention resolved for a GPU: 'auto' is 'flex')."""
    data_parallel: int = 1
    """The group's DP ranks (layout.trainer_dp): which communicators a rank joins."""
    expert_parallel: int = 1
    """layout.trainer_ep: the ranks of an EP group split each MoE layer's experts (1: every rank holds every one)."""
    delta_buffers: int = 0
    """Flat adapter copies this rank holds in flight on the GPU (a leader broadcasting on NCCL: DELTA_IN_FLIGHT)."""
    allocator_reserve: float = 0.0
    """The caching allocator's reserve, as a share of what the tensors take."""

    @property
    def communicator_names(self) -> list[str]:
        """The NCCL communicators this rank is a member of: its TP group, its DP group (the LoRA gradients'
        all-reduce), with expert parallelism its EP group (the tokens' all-to-all) and, when DP / EP > 1, its
        expert-data-parallel group (the expert LoRA gradients' sum: trainer/lockstep.py), and the leader's delta
        channel when the broadcast runs on NCCL (the delta buffers are then on the GPU)."""
        tp, dp, ep = self.tensor_parallel, self.data_parallel, self.expert_parallel
        return [name for name, member in (("TP", tp > 1), ("DP", dp > 1), ("EP", ep > 1), ("expert DP", 1 < ep < dp),
                                          ("delta channel", self.delta_buffers > 0)) if member]

    @property
    def communicators(self) -> int:
        return len(self.communicator_names)

    @property
    def width(self) -> int:
        return min(self.row_tokens, self.micro_batch_tokens) if self.micro_batch_tokens else self.row_tokens

    @property
    def rows(self) -> int:
        return max(1, self.micro_batch_tokens // self.width) if self.micro_batch_tokens else 1

    @property
    def tokens(self) -> int:
        return self.rows * self.width

    @property
    def trained_tokens(self) -> int:
        return self.rows * (self.width - self.prompt_tokens)

    @property
    def tasks_per_step(self) -> int:
        """Tasks fused into the micro-batch: fused_tasks, or fewer when there are fewer rows or tasks."""
        return min(self.fused_tasks, self.rows, self.max_adapters)


@dataclass(frozen=True, kw_only=True)
class TrainerMemory:
    """Bytes on one trainer rank's GPU."""

    inputs: TrainerInputs
    base_weights: int
    lora_per_task: int
    optimizer_per_task: int
    activations: int
    logits: int
    score_buffer: int
    flex_mask: int = 0
    """The block mask a micro-batch keeps (flex attention)."""
    flex_mask_build: int = 0
    """The block mask's build, transient: before the first layer, so never at the step's peak."""
    delta_in_flight: int = 0
    nccl: int = 0
    dispatch: int = 0
    """Expert parallelism's all-to-all buffers of one MoE layer (experts.py `expert_dispatch_bytes`)."""

    @property
    def adapters(self) -> int:
        """LoRA weights and optimizer state of max_adapters tasks."""
        return self.inputs.max_adapters * (self.lora_per_task + self.optimizer_per_task)

    @property
    def steady(self) -> int:
        """Between steps, once every task has stepped."""
        return self.base_weights + self.adapters + self.score_buffer

    @property
    def step_peak(self) -> int:
        """What the trainer's tensors take at a step's peak (the mask's build comes before it, on less): what the
        GPU dry run measures. The dispatch buffers are added whole: they live in an MoE layer's forward or backward,
        not in the LM head's, so this is an upper bound when the LM head's backward is the peak."""
        peak = self.steady + self.activations + self.logits + self.flex_mask + self.dispatch
        return max(peak, self.steady + self.flex_mask_build)

    @property
    def tensors(self) -> int:
        """Every tensor at the peak: the step's and the leader's delta buffers in flight."""
        return self.step_peak + self.delta_in_flight

    @property
    def reserve(self) -> int:
        return int(self.inputs.allocator_reserve * self.tensors)

    @property
    def total(self) -> int:
        return self.tensors + self.reserve + self.nccl


def trainer_memory(inputs: TrainerInputs) -> TrainerMemory:
    lora = 4 * lora_elements(inputs.dims, inputs.tensor_parallel, inputs.lora_rank, inputs.expert_parallel)
    kept, build = flex_mask_bytes(inputs)
    return TrainerMemory(inputs=inputs, base_weights=base_weight_bytes(inputs), lora_per_task=lora,
                         optimizer_per_task=3 * lora, activations=activation_bytes(inputs),
                         logits=logits_bytes(inputs), score_buffer=score_buffer_bytes(inputs), flex_mask=kept,
                         flex_mask_build=build, delta_in_flight=inputs.delta_buffers * adapter_bytes(inputs),
                         nccl=inputs.communicators * NCCL_BYTES_PER_COMMUNICATOR,
                         dispatch=expert_dispatch_bytes(inputs.dims, inputs.tokens, inputs.dtype_bytes,
                                                        inputs.expert_parallel))


def adapter_bytes(inputs: TrainerInputs) -> int:
    """One task's whole adapter as one flat float32 buffer: what a delta broadcast sends (every TP shard gathered,
    in PEFT's form: A and B of each of the seven projections, every expert's in an MoE)."""
    return 4 * peft_adapter_elements(inputs.dims, inputs.lora_rank)


def flex_mask_bytes(inputs: TrainerInputs) -> tuple[int, int]:
    """(kept, build) of a micro-batch's FlexAttention block mask: the kept part is two int32 [rows, q blocks,
    kv blocks] index tensors (partial and full blocks) and their counts; the build evaluates at most
    FLEX_MASK_CHUNK_ELEMENTS booleans at once (at least one query block of every row) and holds about five such
    tensors (trainer/attention.py flex_block_mask). Nothing on the dense path."""
    if inputs.attention != "flex":
        return 0, 0
    blocks = -(-inputs.width // FLEX_BLOCK)
    kept = 2 * 4 * inputs.rows * blocks * (blocks + 1)
    chunk = max(FLEX_MASK_CHUNK_ELEMENTS, inputs.rows * FLEX_BLOCK * inputs.width)
    return kept, 5 * chunk


def base_weight_bytes(inputs: TrainerInputs) -> int:
    """The TP shard's parameters and buffers (RoPE frequencies; the LM head's padding mask on the rank with
    megatron's padding rows); with expert parallelism, the EP rank's experts only."""
    dims, tp, b, ep = inputs.dims, inputs.tensor_parallel, inputs.dtype_bytes, inputs.expert_parallel
    shard_vocab = padded_vocab(dims, tp) // tp
    embeddings = shard_vocab * dims.hidden_size * (1 if dims.tied else 2)
    padding_mask = shard_vocab if padded_vocab(dims, tp) > dims.vocab_size else 0
    router = router_elements(dims)  # whole on every rank (0 in a dense model)
    linears = sum(dims.layer_weights(layer) for layer in range(dims.num_layers)) - router
    linears -= expert_weight_elements(dims) - expert_weight_elements(dims) // ep  # the other EP ranks' experts
    layers = (linears + dims.num_layers * dims.qkv_biases()) // tp + router
    return b * (embeddings + layers + dims.norm_weights()) + padding_mask + 4 * dims.head_dim // 2


def lora_elements(dims: ModelShape, tp: int, rank: int, ep: int = 1) -> int:
    """One task's A and B on this TP rank, every layer, all seven projections (trainer/lora.py's layout: column
    sites qkv and fc1 keep A whole and split B; row sites proj and fc2 split A and keep B whole). In an MoE model
    the MLP sites are every local expert's (experts.py: all, or 1/EP), and its dense layers take none."""
    h, d, f = dims.hidden_size, dims.head_dim, dims.intermediate_size // tp
    qkv_out = (dims.num_heads + 2 * dims.num_kv_heads) * d // tp
    attention = rank * (h + qkv_out) + rank * (dims.num_heads * d // tp + h)
    if dims.num_experts:
        return dims.num_layers * attention + expert_lora_elements(dims, tp, rank, ep)
    return dims.num_layers * (attention + rank * (h + 2 * f) + rank * (f + h))


def layer_bytes_per_token(inputs: TrainerInputs, layer: int = 0) -> int:
    """What one decoder layer keeps for backward per token of the micro-batch, as the trainer's code saves it:
    what torch's fused RMSNorm keeps (the norm weights are in the base dtype: trainer/model.py), the input of
    each LoRA site (its frozen base linear keeps none; proj's is
    FlexAttention's output, kept anyway) and its [r] hidden, megatron's RoPE cos/sin, the attention's inputs and
    output, and the SwiGLU's input and output; an MoE layer's MLP keeps its routed tokens' (experts.py)."""
    dims, b, r = inputs.dims, inputs.dtype_bytes, inputs.lora_rank
    h, d, f = dims.hidden_size, dims.head_dim, dims.intermediate_size // inputs.tensor_parallel
    q_heads, kv_heads = dims.num_heads // inputs.tensor_parallel, dims.num_kv_heads // inputs.tensor_parallel
    # each norm keeps its input and a float32 rstd per row (per head for the q/k norms); the k norm's input is a
    # view of the fused qkv output (counted with the attention), the q norm's a copy (megatron reshapes the
    # query heads of each KV group into one tensor)
    norms = 2 * (b * h + 4) + (b * q_heads * d + 4 * q_heads + 4 * kv_heads if dims.qk_norm else 0)
    attention_lora = b * h + (b * q_heads * d if inputs.attention == "dense" else 0) + 2 * 4 * r
    rope = 4 * d * b
    attention = norms + attention_lora + rope + attention_bytes_per_token(inputs)
    if dims.is_expert_layer(layer):
        # with EP a rank's experts compute the slots the whole EP group routed to them: as many as its own tokens'
        # k slots when the routing spreads tokens evenly over the EP ranks (the assumption: experts.py)
        return attention + expert_layer_bytes_per_token(dims, inputs.tensor_parallel, b, r)
    mlp_lora = 0 if dims.num_experts else b * (h + f) + 2 * 4 * r  # an MoE's dense layers: no MLP adapter
    mlp = 4 * f * b  # fc1's output [2f] (SwiGLU's input), the SiLU output and the product
    return attention + mlp_lora + mlp


def attention_bytes_per_token(inputs: TrainerInputs) -> int:
    dims, b = inputs.dims, inputs.dtype_bytes
    d = dims.head_dim
    q_heads, kv_heads = dims.num_heads // inputs.tensor_parallel, dims.num_kv_heads // inputs.tensor_parallel
    qkv = (q_heads + 2 * kv_heads) * d * b  # the fused projection's output (v is a view of it)
    if inputs.attention == "flex":
        # rotated q and k, the output, and two float32 statistics per query and head (logsumexp, max)
        return qkv + (2 * q_heads + kv_heads) * d * b + 2 * 4 * q_heads
    # dense: megatron repeats k and v to every query head; per score the float32 softmax and (bf16 base) its copy
    return qkv + 3 * q_heads * d * b + q_heads * inputs.width * (4 + (b if b < 4 else 0))


def activation_bytes(inputs: TrainerInputs) -> int:
    """Activations at the step's peak, logits aside. The peak is the LM head's backward (every layer's activations
    and the logits' copies live) or, when the logits are small, the last layer's backward (its gradients on top:
    `backward_bytes_per_token`). With recompute each layer keeps only its input, and one layer at a time is
    rebuilt inside backward, after the LM head's backward has freed the logits."""
    dims, tokens = inputs.dims, inputs.tokens
    mask = inputs.rows * inputs.width * inputs.width if inputs.attention == "dense" else 0  # bool, shared
    kinds = layer_kinds(dims)  # one layer of each kind: what a layer keeps depends on its MLP only
    layers = {kind: tokens * layer_bytes_per_token(inputs, kind) + scaled_b_bytes(inputs, kind) for kind in kinds}
    backward = tokens * backward_bytes_per_token(inputs)
    if not inputs.recompute:
        # layer 0's input norm keeps nothing (the frozen embedding's output needs no gradient); the final norm
        # keeps as much
        kept = sum(layers[layer_kinds(dims, layer)] for layer in range(dims.num_layers))
        return kept + mask + max(0, backward - logits_bytes(inputs))
    # each layer's input (the first one's: the embedding's output, made to require grad for megatron's reentrant
    # checkpoint) and the final norm's float32 input
    checkpoints = (dims.num_layers + 1) * tokens * dims.hidden_size * inputs.dtype_bytes \
        + tokens * (inputs.dtype_bytes * dims.hidden_size + 4)
    layer = max(tokens * layer_bytes_per_token(inputs, kind) for kind in kinds)
    return checkpoints + mask + max(0, layer + backward - logits_bytes(inputs))


def layer_kinds(dims: ModelShape, layer: int | None = None):
    """A representative layer of each MLP kind the model has ({0} for a dense model), or that of `layer`."""
    if layer is None:
        return {layer_kinds(dims, index) for index in range(dims.num_layers)}
    if not dims.num_experts:
        return 0
    if dims.is_expert_layer(layer):
        return next(index for index in range(dims.num_layers) if dims.is_expert_layer(index))
    return dims.dense_layers[0]


def scaled_b_bytes(inputs: TrainerInputs, layer: int = 0) -> int:
    """Per layer, each fused task's B x alpha / r of the four sites (float32 [out, r], kept for backward); an MoE
    layer's MLP sites are every local expert's, and it keeps its router weight's float32 copy (experts.py)."""
    dims, tp = inputs.dims, inputs.tensor_parallel
    attention = (dims.num_heads + 2 * dims.num_kv_heads) * dims.head_dim // tp + dims.hidden_size
    tasks = inputs.tasks_per_step
    if dims.is_expert_layer(layer):
        return tasks * 4 * inputs.lora_rank * attention \
            + expert_layer_fixed_bytes(dims, tp, inputs.lora_rank, tasks, inputs.expert_parallel)
    mlp = 0 if dims.num_experts else 2 * dims.intermediate_size // tp + dims.hidden_size
    return tasks * 4 * inputs.lora_rank * (attention + mlp)


def backward_bytes_per_token(inputs: TrainerInputs) -> int:
    """A layer's backward at its peak, on top of the activations (measured by the dry run): the float32 gradient
    of fc1's output and a hidden-size gradient; without recompute the last layer's backward also meets the final
    norm's float32 gradients; dense attention adds the bf16 gradients of the scores."""
    dims, tp = inputs.dims, inputs.tensor_parallel
    extra = 8 * (dims.intermediate_size // tp) + dims.hidden_size
    if moe_layers(dims):  # the widest MLP's
        expert = expert_backward_bytes_per_token(dims, tp, inputs.dtype_bytes)
        extra = max(expert, extra) if dims.dense_layers else expert
    if not inputs.recompute:
        extra += 8 * dims.hidden_size
    if inputs.attention == "dense":
        extra += 2 * inputs.dtype_bytes * (dims.num_heads // inputs.tensor_parallel) * inputs.width
    return extra


def logits_bytes(inputs: TrainerInputs) -> int:
    """The LM head at its peak (trainer/lm_head.py `LmHead.logprobs`, one call per fused task): the trained
    tokens' final hidden states it keeps for backward and a float32 logsumexp and logprob per token, plus the
    float32 logits of two chunks of LOGITS_CHUNK_BYTES (a chunk's and the one before it, not yet released)."""
    dims, tokens = inputs.dims, inputs.trained_tokens
    shard_vocab = padded_vocab(dims, inputs.tensor_parallel) // inputs.tensor_parallel
    chunk = logits_chunk_tokens(inputs)
    chunks = 2 if -(-tokens // inputs.tasks_per_step) > chunk else 1
    return tokens * (dims.hidden_size * inputs.dtype_bytes + 8) + chunks * chunk * shard_vocab * 4


def logits_chunk_tokens(inputs: TrainerInputs) -> int:
    """Tokens of one chunk of the LM head's logits: LOGITS_CHUNK_BYTES' worth, or a task's trained tokens."""
    shard_vocab = padded_vocab(inputs.dims, inputs.tensor_parallel) // inputs.tensor_parallel
    per_task = -(-inputs.trained_tokens // inputs.tasks_per_step)
    return max(1, min(per_task, LOGITS_CHUNK_BYTES // (4 * shard_vocab)))


def score_buffer_bytes(inputs: TrainerInputs) -> int:
    if inputs.attention != "dense":
        return 0
    heads = inputs.dims.num_heads // inputs.tensor_parallel
    return inputs.rows * heads * inputs.width * inputs.width * inputs.dtype_bytes


# ---------------------------------------------------------------------------------------------- rollout
@dataclass(frozen=True, kw_only=True)
class RolloutInputs:
    dims: ModelShape
    tensor_parallel: int
    dtype_bytes: int
    gpu_bytes: int
    gpu_memory_utilization: float
    max_loras: int
    max_lora_rank: int
    max_model_len: int
    max_num_seqs: int


@dataclass(frozen=True, kw_only=True)
class RolloutMemory:
    inputs: RolloutInputs
    weights: int
    lora_slots: int
    activations: int

    @property
    def budget(self) -> int:
        """What vLLM may take: gpu_memory_utilization of the GPU."""
        return int(self.inputs.gpu_memory_utilization * self.inputs.gpu_bytes)

    @property
    def kv_cache(self) -> int:
        return self.budget - self.weights - self.lora_slots - self.activations

    @property
    def kv_bytes_per_token(self) -> int:
        dims = self.inputs.dims
        return 2 * dims.num_layers * max(1, dims.num_kv_heads // self.inputs.tensor_parallel) * dims.head_dim \
            * self.inputs.dtype_bytes

    @property
    def kv_tokens(self) -> int:
        return max(0, self.kv_cache) // self.kv_bytes_per_token


def rollout_memory(inputs: RolloutInputs) -> RolloutMemory:
    dims, tp, b = inputs.dims, inputs.tensor_parallel, inputs.dtype_bytes
    router = router_elements(dims)  # vLLM replicates the router (0 in a dense model)
    return RolloutMemory(inputs=inputs, weights=b * ((dims.parameters() - router) // tp + router),
                         lora_slots=b * inputs.max_loras * vllm_lora_elements(dims, tp, inputs.max_lora_rank),
                         activations=rollout_activation_bytes(inputs))


def vllm_lora_elements(dims: ModelShape, tp: int, rank: int) -> int:
    """One vLLM LoRA slot on a TP rank: A and B of each of the seven projections (q, k, v, o, gate, up, down); in
    an MoE model, every expert's gate, up and down in its routed layers (experts.py)."""
    attention, mlp = vllm_layer_elements(dims, tp, rank)
    dense_mlps = dims.num_layers - moe_layers(dims)
    return dims.num_layers * attention + dense_mlps * mlp + vllm_expert_slot_elements(dims, tp, rank)


def vllm_layer_elements(dims: ModelShape, tp: int, rank: int) -> tuple[int, int]:
    """(attention, dense MLP) elements of one layer's vLLM LoRA slot on a TP rank: q, k, v and o; gate, up, down."""
    h, d, f = dims.hidden_size, dims.head_dim, dims.intermediate_size // tp
    q, kv = dims.num_heads * d // tp, dims.num_kv_heads * d // tp
    attention = 3 * rank * h + rank * (q + 2 * kv) + rank * q + rank * h
    mlp = 2 * rank * h + 2 * rank * f + rank * f + rank * h
    return attention, mlp


def peft_adapter_elements(dims: ModelShape, rank: int) -> int:
    """One task's whole adapter in PEFT's form (TP gathered: an export, a delta broadcast, a rollout rank's
    in-memory copy): the seven projections of every layer; in an MoE model the attention's of every layer and
    every expert's gate/up/down (its dense layers take no MLP adapter: trainer/lora.py `MultiLora`)."""
    if not dims.num_experts:
        return vllm_lora_elements(dims, 1, rank)
    return dims.num_layers * vllm_layer_elements(dims, 1, rank)[0] + expert_peft_elements(dims, rank)


ROLLOUT_BATCHED_TOKENS = 8192
"""Tokens of vLLM's profiling forward when the job does not bound them (its default max_num_batched_tokens)."""


def rollout_activation_bytes(inputs: RolloutInputs) -> int:
    """An estimate of what vLLM's start-up profiling forward peaks at: a layer's widest intermediates for the
    batched tokens, and float32 logits plus sampling copies for max_num_seqs sequences. vLLM measures its own at
    start; the KV cache gets the rest."""
    dims, tp, b = inputs.dims, inputs.tensor_parallel, inputs.dtype_bytes
    tokens = max(ROLLOUT_BATCHED_TOKENS, inputs.max_model_len)
    mlp = b * (3 * dims.intermediate_size // tp)
    if moe_layers(dims):  # the widest layer's
        expert = rollout_expert_bytes_per_token(dims, tp, b)
        mlp = max(expert, mlp) if dims.dense_layers else expert
    per_token = b * (4 * dims.hidden_size + (dims.num_heads + 2 * dims.num_kv_heads) * dims.head_dim // tp) + mlp
    sampler = 3 * 4 * inputs.max_num_seqs * dims.vocab_size
    return tokens * per_token + sampler
