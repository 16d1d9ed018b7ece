"""The trainer's base network: a megatron-core GPTModel (local layer spec) loaded from an HF checkpoint of a
served family (model/families.py: Qwen3 dense and MoE, Qwen2 / Qwen2.5, Llama 3.x).

mbridge maps HF names <-> megatron names and splits weights over tensor-parallel ranks. Its bridges (Qwen3Bridge,
Qwen2Bridge, LLaMABridge) target the Transformer Engine spec (fused `linear_qkv.layer_norm_weight`); here each is
pointed at the local spec, whose norms are separate modules (`input_layernorm`, `pre_mlp_layernorm`), built with
the family's qk-norm (Qwen3) and q/k/v biases (Qwen2), and given the checkpoint's RoPE (Llama 3's `llama3`
scaling through megatron-core's own RotaryEmbedding). `bridge.get_model()` is not used (it calls `.cuda()`): the
GPTModel is built directly and the bridge only loads weights. Qwen3-MoE starts from the Qwen3 bridge (attention,
norms, embeddings) and maps its routers and experts itself (trainer/moe.py): mbridge's Qwen3MoEBridge names the
experts of Transformer Engine's grouped-GEMM module, and reads only per-expert checkpoint tensors.

Process groups (docs/architecture.md §2): the default torch.distributed group (gloo on CPU, nccl on GPU) spans one
trainer group's ranks, TP x DP (TP-major: TP groups are consecutive ranks); megatron's parallel state splits it into
TP and DP groups. `init_distributed` creates it from the torchrun environment, or a single-process group for TP=DP=1.
"""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from marlaas_hpc.model.checkpoint import check_expert_split, checkpoint_family, read_checkpoint
from marlaas_hpc.model.families import ExpertsSpec, ModelFamily, experts_of, rope_of
from marlaas_hpc.trainer.cpu_shims import apply_cpu_shims
from marlaas_hpc.trainer.frozen_base import skip_frozen_weight_grads


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_single_process_group(backend: str | None = None) -> None:
    """Initialises a world-size-1 default process group in this process (no network, no env vars)."""
    if dist.is_initialized():
        return
    dist.init_process_group(backend or default_backend(), store=dist.HashStore(), rank=0, world_size=1)


def init_distributed(tensor_parallel: int, seed: int = 0, backend: str | None = None,
                     data_parallel: int = 1, store=None, expert_parallel: int = 1) -> None:
    """Default process group (from `store` with env RANK / WORLD_SIZE, else torchrun env vars, else
    single-process) + megatron's TP, DP and expert groups (`expert_parallel` ranks of the DP ones share one MoE
    layer's experts: trainer/experts_parallel.py) + RNG.

    The default group must span exactly the trainer group's ranks: `tensor_parallel * data_parallel` of them.
    Idempotent when already initialised with the same sizes. On CUDA the caller selects this rank's device first
    (`torch.cuda.set_device`): NCCL binds to it.
    """
    from megatron.core import parallel_state, tensor_parallel as mcore_tp

    apply_cpu_shims()
    if not dist.is_initialized():
        if store is not None:
            dist.init_process_group(backend or default_backend(), store=store, rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]))
        elif "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend or default_backend())
        elif tensor_parallel * data_parallel == 1:
            init_single_process_group(backend)
        else:
            raise RuntimeError(f"tensor_parallel={tensor_parallel} x data_parallel={data_parallel} needs an "
                               "initialised default process group (torchrun / init_process_group) of that size")
    world = dist.get_world_size()
    if world != tensor_parallel * data_parallel:
        raise ValueError(f"the default process group has {world} ranks but tensor_parallel={tensor_parallel} x "
                         f"data_parallel={data_parallel}; the trainer's world must be exactly its TP x DP ranks")
    if parallel_state.model_parallel_is_initialized():
        have = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_expert_model_parallel_world_size())
        if have != (tensor_parallel, expert_parallel):
            raise ValueError(f"megatron parallel state already initialised with TP, EP={have}")
    else:
        # megatron's extra gloo groups serve its distributed optimizer and checkpointing, which the trainer does
        # not use: on GPU they were TCP meshes for nothing, and a fake process group (the GPU dry run) has no gloo
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel,
                                                 expert_model_parallel_size=expert_parallel,
                                                 create_gloo_process_groups=False)
    tracker = mcore_tp.get_cuda_rng_tracker()
    if "model-parallel-rng" not in tracker.get_states():
        mcore_tp.model_parallel_cuda_manual_seed(seed)


MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128
"""Megatron's default: the embedding has a multiple of 128 * TP rows (Megatron-LM `_vocab_size_with_padding`)."""


def padded_vocab_size(vocab_size: int, tensor_parallel: int) -> int:
    """The embedding / output rows megatron allocates for `vocab_size` tokens at this TP size."""
    multiple = MAKE_VOCAB_SIZE_DIVISIBLE_BY * tensor_parallel
    return -(-vocab_size // multiple) * multiple


def _bridge_base_cls(family: ModelFamily):
    """mbridge's own bridge of the family: its HF <-> megatron name mapping and its TransformerConfig (Qwen3:
    qk_layernorm; Qwen2: add_qkv_bias; Llama: neither)."""
    from mbridge.models.llama import LLaMABridge
    from mbridge.models.qwen2 import Qwen2Bridge
    from mbridge.models.qwen3 import Qwen3Bridge

    return {"qwen3": Qwen3Bridge, "qwen3_moe": Qwen3Bridge, "qwen2": Qwen2Bridge, "llama": LLaMABridge}[family.name]


def local_spec_bridge(family: ModelFamily, hf_config, dtype: torch.dtype, experts: ExpertsSpec | None = None):
    """The family's mbridge bridge pointed at the local (non-TE) layer spec, whose norms are separate modules
    (`input_layernorm`, `pre_mlp_layernorm`) instead of Transformer Engine's fused `layer_norm_weight`s.
    `experts`: the checkpoint's experts (qwen3_moe), mapped by trainer/moe.py."""
    base = _bridge_base_cls(family)

    class LocalSpecBridge(base):
        def __init__(self, *args, **kwargs):
            # per-instance copies: mbridge mutates these class dicts for tied embeddings
            self._DIRECT_MAPPING = dict(base._DIRECT_MAPPING)
            self._ATTENTION_MAPPING = {k: v for k, v in base._ATTENTION_MAPPING.items()
                                       if k != "self_attention.linear_qkv.layer_norm_weight"}
            self._MLP_MAPPING = {k: v for k, v in base._MLP_MAPPING.items()
                                 if k != "mlp.linear_fc1.layer_norm_weight"}
            self._MLP_MAPPING["pre_mlp_layernorm.weight"] = [
                "model.layers.{layer_number}.post_attention_layernorm.weight"]
            self._OTHER_MAPPING = {"input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"]}
            super().__init__(*args, **kwargs)

        def _get_transformer_layer_spec(self, vp_stage=None):
            return local_layer_spec(family, experts)

        def _get_safetensor_io(self, weights_path: str):
            return _safetensor_io(self._get_actual_hf_path(weights_path)) if experts else \
                super()._get_safetensor_io(weights_path)

        def _build_base_config(self, **kwargs):
            if experts and self.mpu.ep_size > 1:
                # megatron's config refuses EP without experts: the first config (in mbridge's constructor, before
                # `set_extra_args` gives the trainer's) has the experts' fields already
                from marlaas_hpc.trainer.moe import moe_config_args

                kwargs.update(moe_config_args(experts, self.mpu.ep_size), variable_seq_lengths=False)
            return super()._build_base_config(**kwargs)

        def _weight_name_mapping_mcore_local_to_global(self, model, consider_ep: bool = True) -> dict:
            # mbridge maps local to global experts for grouped-GEMM names only (`mlp.experts.linear_fc1.weightN`);
            # SequentialMLP's `local_experts.i` is expert ep_rank x local + i of the checkpoint
            from marlaas_hpc.trainer.moe import global_expert_name

            names = super()._weight_name_mapping_mcore_local_to_global(model, consider_ep)
            if not experts or self.mpu.ep_size == 1:
                return names
            local = experts.num_experts // self.mpu.ep_size
            return {key: global_expert_name(value, self.mpu.ep_rank * local) for key, value in names.items()}

        def _weight_name_mapping_mlp(self, name: str) -> list[str]:
            from marlaas_hpc.trainer.moe import moe_hf_names

            return (moe_hf_names(name) if experts else None) or super()._weight_name_mapping_mlp(name)

        def _get_gptmodel_args(self) -> dict:
            rope = rope_of(self.hf_config.to_dict())
            return dict(vocab_size=self.hf_config.vocab_size,
                        max_sequence_length=self.hf_config.max_position_embeddings,
                        position_embedding_type="rope", rotary_base=rope.theta,
                        # megatron-core's RotaryEmbedding applies Llama 3.1's frequency scaling itself (factor
                        # given, the other three parameters fixed at the released values, which intake checks);
                        # mbridge's Llama bridge would pass linear position interpolation instead
                        rope_scaling=rope.scaling == "llama3", rope_scaling_factor=rope.factor)

    return LocalSpecBridge(hf_config, dtype=dtype)


def local_layer_spec(family: ModelFamily, experts: ExpertsSpec | None = None):
    """The decoder layer's local spec (dense families), or every layer's (a TransformerBlockSubmodules: MoE
    layers and the checkpoint's dense ones)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    dense = get_gpt_layer_local_spec(qk_layernorm=family.qk_norm, normalization="RMSNorm")
    if experts is None:
        return dense
    from marlaas_hpc.trainer.moe import decoder_block_spec

    return decoder_block_spec(dense, experts, family.qk_norm)


def _safetensor_io(model_dir: str):
    """mbridge's checkpoint reader, also reading per-expert tensors out of fused 3D experts
    (trainer/moe.py `fused_expert_slice`) when the checkpoint stores those."""
    from mbridge.core.safetensor_io import SafeTensorIO

    from marlaas_hpc.trainer.moe import fused_expert_slice

    class ExpertsIO(SafeTensorIO):
        def load_some_hf_weight(self, hf_weight_names: list[str]) -> dict:
            stored = set(self.load_hf_weight_names())
            out = super().load_some_hf_weight([name for name in hf_weight_names if name in stored])
            fused: dict[str, torch.Tensor] = {}

            def read(key: str) -> torch.Tensor:
                if key not in fused:
                    fused[key] = super(ExpertsIO, self).load_some_hf_weight([key])[key]
                return fused[key]

            for name in hf_weight_names:
                if name not in stored:
                    tensor = fused_expert_slice(name, read)
                    if tensor is None:
                        raise ValueError(f"{model_dir}: the checkpoint has no tensor {name}")
                    out[name] = tensor.contiguous()
            return out

    return ExpertsIO(model_dir)


@dataclass
class LoadedModel:
    model: torch.nn.Module
    """megatron-core GPTModel (this rank's TP shard), base parameters frozen."""
    hf_config: object
    """The checkpoint's transformers config."""
    bridge: object
    """mbridge bridge (HF <-> megatron weight mapping)."""
    vocab_size: int
    """Tokens of the checkpoint (rows of its embedding)."""
    padded_vocab_size: int
    """Rows of the megatron embedding / output layer: vocab_size padded to a multiple of 128 * TP."""


def check_tensor_parallel(hf_config, tensor_parallel: int, experts: ExpertsSpec | None = None) -> None:
    """Refuses a TP size that does not split the checkpoint's heads, KV heads, dense MLPs and experts evenly (the
    vocabulary is padded instead)."""
    names = ["num_attention_heads", "num_key_value_heads"]
    if experts is None or not all(experts.expert_layers):
        names.append("intermediate_size")
    if experts is not None:
        names.append("moe_intermediate_size")
    for name in names:
        value = getattr(hf_config, name)
        if value % tensor_parallel:
            raise ValueError(f"tensor_parallel={tensor_parallel} must divide {name}={value}")


def check_expert_parallel(expert_parallel: int, tensor_parallel: int, data_parallel: int, model_path) -> None:
    """Refuses an EP size megatron-core cannot lay out or the trainer does not build, naming `expert_parallel`
    (trainer/experts_parallel.py)."""
    from marlaas_hpc.tasks.spec import SpecError

    if expert_parallel == 1:
        return
    config = json.loads(Path(model_path, "config.json").read_text())
    check_expert_split(expert_parallel, config.get("num_experts") or config.get("num_local_experts") or 0,
                       "the model", "expert_parallel")
    if tensor_parallel != 1:
        # the replicated-token dispatcher (trainer/moe.py) runs TP without sequence parallelism: every TP rank holds
        # every token; combined with EP's all-to-all that needs expert-TP groups this trainer does not build
        raise SpecError("expert_parallel", f"> 1 runs at tensor_parallel 1 only, got tensor_parallel "
                                           f"{tensor_parallel}")
    if data_parallel % expert_parallel:
        # megatron-core carves EP out of the DP x TP ranks: world % (expert TP x EP) == 0
        raise SpecError("expert_parallel", f"must divide data_parallel={data_parallel} (megatron-core carves the "
                                           f"expert-parallel ranks out of the data-parallel ones), got "
                                           f"{expert_parallel}")


def build_gpt_model(model_path: str | Path, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32, recompute: bool = False,
                    load_weights: bool = True) -> LoadedModel:
    """Builds the GPTModel for this rank's TP shard on `device` and loads the HF checkpoint into it (frozen).

    Tied input/output embeddings (Qwen3-0.6B..4B, Qwen2.5 up to 3B, Llama 3.2) share one megatron weight, mapped
    from `model.embed_tokens.weight`; untied ones load `lm_head.weight` into the output layer. The vocabulary is
    padded as megatron pads it (zero rows past `vocab_size`); callers keep padded logits out of every softmax.
    Parameters are allocated on `device` before any weight is loaded, because mbridge scatters each weight
    from TP rank 0 over the TP group (NCCL on GPU cannot scatter CPU tensors). `dtype`: base weights
    (bfloat16 on GPU, float32 for exact CPU tests). `recompute`: full activation recompute of every layer (in
    train mode only: `training_mode`). `load_weights=False` leaves the parameters as allocated (uninitialised):
    the GPU dry run (marlaas_hpc/plan) builds the model from config.json alone.
    Needs `init_distributed` first (all TP ranks call this together).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel
    from transformers import AutoConfig

    apply_cpu_shims()
    skip_frozen_weight_grads()
    device = torch.device(device)
    # the intake check, again where the weights load (the trainer reads no tokenizer)
    info = read_checkpoint(model_path, tokenizer=False)
    family = checkpoint_family(info)
    experts = experts_of(info.config) if family.experts else None
    hf_config = AutoConfig.from_pretrained(str(model_path))
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    bridge = local_spec_bridge(family, hf_config, dtype, experts)
    expert_parallel = parallel_state.get_expert_model_parallel_world_size()
    bridge.set_extra_args(**_config_args(device, dtype, recompute, experts, expert_parallel))
    tp = bridge.mpu.tp_size
    check_tensor_parallel(hf_config, tp, experts)
    vocab = int(hf_config.vocab_size)
    padded = padded_vocab_size(vocab, tp)
    bridge.make_vocab_size_divisible_by = MAKE_VOCAB_SIZE_DIVISIBLE_BY * tp  # mbridge pads with zero rows
    bridge.vocab_size, bridge.padded_vocab_size = vocab, padded
    args = {**bridge._get_gptmodel_args(), "vocab_size": padded}
    if device.type == "cuda":  # megatron allocates non-CPU-initialised parameters on the current device
        torch.cuda.set_device(device)
    with torch.device(device):  # the local spec's norms take no device argument: built on `device` at once
        model = GPTModel(config=bridge.config, transformer_layer_spec=local_layer_spec(family, experts),
                         share_embeddings_and_output_weights=tied, pre_process=True, post_process=True, **args)
    _norms_in_base_dtype(model, dtype)
    if any(tensor.device != device for tensor in (*model.parameters(), *model.buffers())):
        # `to` re-wraps every fake-tensor parameter, which torch refuses: called only when something is elsewhere
        model.to(device)
    if load_weights:
        with torch.no_grad():
            bridge.load_weights([model], str(model_path))
    for param in model.parameters():
        param.requires_grad_(False)
    model.eval()  # the trainer's default; training_mode around a forward and its backward
    return LoadedModel(model=model, hf_config=hf_config, bridge=bridge, vocab_size=vocab, padded_vocab_size=padded)


def _config_args(device: torch.device, dtype: torch.dtype, recompute: bool, experts: ExpertsSpec | None,
                 expert_parallel: int = 1) -> dict:
    """The TransformerConfig fields the trainer sets over mbridge's (CPU-safe: no fusion, no dropout)."""
    args = dict(
        sequence_parallel=False, use_cpu_initialization=device.type == "cpu", perform_initialization=False,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        cross_entropy_loss_fusion=False, attention_dropout=0.0, hidden_dropout=0.0,
        attention_softmax_in_fp32=True, variable_seq_lengths=True)
    if recompute:
        args.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if experts is not None:
        from marlaas_hpc.trainer.moe import moe_config_args

        # variable_seq_lengths only sizes pipeline-parallel sends (the trainer has no pipeline stages), and
        # megatron's config refuses it with the all-gather dispatcher, whose gather trainer/moe.py skips
        # (mbridge sets expert_model_parallel_size from megatron's parallel state)
        args.update(moe_config_args(experts, expert_parallel), variable_seq_lengths=False)
    return args


def _norms_in_base_dtype(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """The local spec's norms (torch.nn.RMSNorm: it takes no dtype) are built in float32 whatever the base dtype.
    A float32 weight over bf16 activations keeps torch off its fused kernel: every norm then keeps a float32 copy
    of its input for backward (~14 of a layer's ~45 KB per token at Qwen3-0.6B, TP 2: ~6 GiB of the shipped
    micro-batch, measured by the GPU dry run) and warns on every call. The checkpoints store these weights in
    bf16 anyway; the fused kernel still normalises in float32."""
    for module in model.modules():
        if isinstance(module, (torch.nn.RMSNorm, torch.nn.LayerNorm)):
            for name, param in list(module.named_parameters(recurse=False)):
                if param.dtype != dtype:
                    setattr(module, name, torch.nn.Parameter(param.detach().to(dtype), requires_grad=False))


def final_hidden_states(model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                        attention_mask: torch.Tensor | None) -> torch.Tensor:
    """GPTModel.forward without its output layer: [s, rows, hidden] after the final norm, in the base dtype.

    For this model (first and last pipeline stage, RoPE, no MTP) megatron's forward is the embedding, RoPE
    tables, the decoder block (layers and final norm) and the output layer; the LM head is the trainer's
    (trainer/lm_head.py). `positions` [rows, s] are each token's RoPE positions: packed rows hold several
    sequences (trainer/packing.py) and a completion sits after its prompt's other completions, yet has the
    positions it has alone. The RoPE tables [s, rows, 1, dim] are an argument of every layer, so activation
    recompute (which re-runs a layer inside backward) reuses them. `attention_mask`: megatron's bool mask (dense
    attention) or None (FlexAttention layers read theirs from trainer/attention.py's RowAttention).
    """
    hidden = model.embedding(input_ids=input_ids, position_ids=positions)
    if model.training and torch.is_grad_enabled() and model.config.recompute_granularity == "full":
        # megatron's checkpoint is a reentrant autograd Function: a layer's recomputed backward runs only if its
        # input requires grad, and the frozen embedding's output does not (a trained embedding's would)
        hidden = hidden.detach().requires_grad_()
    table = model.rotary_pos_emb(int(positions.max()) + 1)  # [max position + 1, 1, 1, dim]
    return model.decoder(hidden_states=hidden, attention_mask=attention_mask, rotary_pos_emb=table[positions.t(), 0])


@contextmanager
def training_mode(model: torch.nn.Module) -> Iterator[None]:
    """The model in train mode for a forward and its backward, then back in eval mode (the trainer's default).

    megatron-core 0.16 recomputes activations only in train mode (TransformerBlock._checkpointed_forward runs
    when `self.training`). On this model's path train mode changes nothing else: dropout is 0 (`F.dropout` with
    p=0 returns its input), bias-dropout-add adds out of place instead of in place (the same sum), and the
    train-only CUDA-graph and offloading paths are off in its config."""
    model.train()
    try:
        yield
    finally:
        model.eval()
