"""PEFT-format adapter files: `adapter_config.json` + `adapter_model.safetensors`, as peft's save_pretrained.

Keys: `base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight` (fp32); a mixture-of-experts
layer's experts one by one, `...layers.{i}.mlp.experts.{n}.{gate|up|down}_proj.lora_{A|B}.weight`, the form stock
vLLM reads and PEFT converts to transformers 5's fused experts on load (docs/architecture.md §10). The config is
written by peft's own `LoraConfig`, so transformers+PEFT and vLLM load the directory directly.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import torch

from marlaas_hpc.tasks.spec import QWEN3_LORA_TARGETS, LoraSpec

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"


def peft_config(spec: LoraSpec, base_model_name_or_path: str | None = None):
    """peft's LoraConfig of an adapter (what adapter_config.json holds; in-memory loads use it too)."""
    from peft import LoraConfig

    return LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=0.0, bias="none",
                      target_modules=sorted(spec.target_modules), task_type="CAUSAL_LM",
                      base_model_name_or_path=base_model_name_or_path, inference_mode=True)


def peft_config_dict(spec: LoraSpec) -> dict:
    """adapter_config.json's content as a dict (JSON types only: vLLM's PEFTHelper reads it)."""
    data = {k: sorted(v) if isinstance(v, set) else v for k, v in peft_config(spec).to_dict().items()}
    return json.loads(json.dumps(data))  # as save_pretrained writes it (sets as lists, enums as strings)


def write_peft_adapter(out_dir: str | Path, tensors: dict[str, torch.Tensor], spec: LoraSpec,
                       base_model_name_or_path: str | None = None) -> Path:
    """Writes a PEFT LoRA adapter directory atomically (staged next to it, then renamed into place).

    An existing `out_dir` is replaced.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    staging.mkdir()
    try:
        peft_config(spec, base_model_name_or_path).save_pretrained(str(staging))
        save_file({k: v.detach().to("cpu", torch.float32).contiguous() for k, v in sorted(tensors.items())},
                  str(staging / WEIGHTS_NAME), metadata={"format": "pt"})
        if out.exists():
            trash = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
            os.rename(out, trash)
            os.rename(staging, out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def read_peft_adapter(path: str | Path) -> tuple[LoraSpec, dict[str, torch.Tensor]]:
    """(LoraSpec from adapter_config.json, tensors) of a PEFT LoRA adapter directory."""
    from safetensors.torch import load_file

    path = Path(path)
    config = json.loads((path / CONFIG_NAME).read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: not a LoRA adapter (peft_type={config.get('peft_type')!r})")
    for flag in ("use_dora", "use_rslora"):
        if config.get(flag):
            raise ValueError(f"{path}: {flag} adapters are not supported")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(f"{path}: per-module rank/alpha patterns are not supported")
    targets = config["target_modules"]
    if isinstance(targets, str):
        raise ValueError(f"{path}: regex target_modules are not supported")
    targets = tuple(t for t in QWEN3_LORA_TARGETS if t in set(targets))
    spec = LoraSpec(rank=int(config["r"]), alpha=float(config["lora_alpha"]), target_modules=targets)
    spec.validate()
    return spec, load_file(str(path / WEIGHTS_NAME))
