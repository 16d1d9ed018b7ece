"""This package's vLLM general plugin (pyproject.toml, entry point group `vllm.general_plugins`).

vLLM runs its general plugins in every process of an engine, the engine core and worker processes it spawns
included. A rollout engine whose core runs in a process of its own (rollout/vllm_engine.py `start_llm`) needs
the CPU LoRA wrapper installed there, where the rank's own `vllm_cpu_lora.install()` cannot reach. Light on
purpose: a GPU platform imports nothing more and changes nothing.
"""
from __future__ import annotations


def install_cpu_lora() -> None:
    """On the CPU platform, vLLM builds rollout/vllm_cpu_lora.py's grouped LoRA wrapper; elsewhere a no-op."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from marlaas_hpc.rollout import vllm_cpu_lora

        vllm_cpu_lora.install()
