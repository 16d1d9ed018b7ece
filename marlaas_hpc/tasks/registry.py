"""Task type name -> data/verifier class."""
from __future__ import annotations

from marlaas_hpc.tasks.base import TaskData
from marlaas_hpc.tasks.files import CustomTask, Gsm8kFileTask
from marlaas_hpc.tasks.spec import DatasetSpec
from marlaas_hpc.tasks.synthetic import GENERATORS, Gsm8kSyntheticTask, SyntheticTask

SYNTHETIC_KINDS = tuple(GENERATORS)
ENV_TASK_KINDS = ("gsm8k_tool", "gsm8k_plain", "hotpotqa", "lookup")
"""Tool / multi-turn workloads (marlaas_hpc.env): episodes of several model turns with tool observations."""
GSM8K_KINDS = ("gsm8k", "gsm8k_synth", "gsm8k_tool", "gsm8k_plain")
"""Kinds whose prompts are worded for the prompt format and whose answers follow `dataset.answer_format`."""
TASK_KINDS = frozenset(SYNTHETIC_KINDS) | {"gsm8k", "gsm8k_synth", "custom"} | frozenset(ENV_TASK_KINDS)


def build_task_data(spec: DatasetSpec, prompt_format: str = "raw", sandbox=None) -> TaskData:
    """Loads a task's data (files are read and checked here, at admission). `prompt_format` (the task's
    `prompt.format`) words the prompts of kinds that differ by format (GSM8K: 'Q:/A:' raw, instruction chat).
    A tenant reward file is read, not imported: it runs only in sandboxed workers, under `sandbox` (the job's
    SandboxConfig; None: defaults)."""
    spec.validate()
    if spec.kind in GENERATORS:
        return SyntheticTask(spec)
    if spec.kind in ENV_TASK_KINDS:
        from marlaas_hpc.env.workloads import build_env_task  # lazy: env workers stay light

        return build_env_task(spec, prompt_format, sandbox)
    if spec.kind == "gsm8k":
        return Gsm8kFileTask(spec, prompt_format)
    if spec.kind == "gsm8k_synth":
        return Gsm8kSyntheticTask(spec, prompt_format)
    return CustomTask(spec, sandbox)
