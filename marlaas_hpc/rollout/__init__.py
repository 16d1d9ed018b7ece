"""Rollout: sampling completions with per-task adapters (vLLM multi-LoRA, or transformers + PEFT)."""
from marlaas_hpc.rollout.base import AdapterRef, AdapterVersions, Generation, GenerationRequest, RolloutEngine

__all__ = ["AdapterRef", "AdapterVersions", "Generation", "GenerationRequest", "RolloutEngine"]
