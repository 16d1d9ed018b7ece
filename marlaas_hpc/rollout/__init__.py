"""Rollout: sampling completions with per-task adapters (vLLM multi-LoRA, or transformers + PEFT)."""
from __future__ import annotations

from pathlib import Path

from marlaas_hpc.rollout.base import AdapterRef, AdapterVersions, Generation, GenerationRequest, RolloutEngine

ENGINE_KINDS = ("vllm", "hf")


def make_engine(kind: str, model_path: str | Path, *, work_dir: str | Path | None = None, seed: int = 0,
                **kwargs) -> RolloutEngine:
    """Builds a rollout engine. kind "vllm": VllmEngine (needs work_dir for its caches; kwargs such as
    max_loras, max_lora_rank, dtype go to it); kind "hf": HfEngine (kwargs: device, dtype, max_batch_size, step_tokens).
    The engine modules are imported lazily (vLLM import takes seconds and sets process-wide state)."""
    if kind == "vllm":
        from marlaas_hpc.rollout.vllm_engine import VllmEngine, import_vllm

        if work_dir is None:
            raise ValueError("the vllm engine needs a work_dir for its caches")
        import_vllm(Path(kwargs.get("cache_dir") or work_dir))  # before the engine exists: see import_vllm
        return VllmEngine(model_path, work_dir=work_dir, seed=seed, **kwargs)
    if kind == "hf":
        from marlaas_hpc.rollout.hf_engine import HfEngine

        return HfEngine(model_path, seed=seed, **kwargs)
    raise ValueError(f"unknown rollout engine kind {kind!r} (choose from {ENGINE_KINDS})")


__all__ = ["ENGINE_KINDS", "AdapterRef", "AdapterVersions", "Generation", "GenerationRequest", "RolloutEngine",
           "make_engine"]
