"""Every task kind's data, in one table: the tasks package's data streams (synthetic, GSM8K) and what the env adds
on top of them (tool workloads, a tenant's own dataset scored in a sandbox). The kinds' names are in
tasks/registry.py; this is the one place that builds them."""
from __future__ import annotations

from marlaas_hpc.env.custom import CustomTask
from marlaas_hpc.env.workloads import build_env_task
from marlaas_hpc.tasks.base import TaskData
from marlaas_hpc.tasks.files import Gsm8kFileTask, MathFileTask
from marlaas_hpc.tasks.registry import ENV_TASK_KINDS
from marlaas_hpc.tasks.spec import DatasetSpec
from marlaas_hpc.tasks.synthetic import GENERATORS, Gsm8kSyntheticTask, LongTailTask, SyntheticTask


def build_task_data(spec: DatasetSpec, prompt_format: str = "raw", sandbox=None) -> TaskData:
    """Loads a task's data (files are read and checked here, at admission). `prompt_format` (the task's
    `prompt.format`) words the prompts of kinds that differ by format (GSM8K: 'Q:/A:' raw, instruction chat).
    A tenant reward file is read, not imported: it runs only in sandboxed workers, under `sandbox` (the job's
    SandboxConfig; None: defaults)."""
    spec.validate()
    if spec.kind in GENERATORS:
        return SyntheticTask(spec)
    if spec.kind == "long_tail":
        return LongTailTask(spec)
    if spec.kind in ENV_TASK_KINDS:
        return build_env_task(spec, prompt_format, sandbox)
    if spec.kind == "gsm8k":
        return Gsm8kFileTask(spec, prompt_format)
    if spec.kind == "math":
        return MathFileTask(spec, prompt_format)
    if spec.kind in ("gsm8k_synth", "gsm8k_easy"):
        return Gsm8kSyntheticTask(spec, prompt_format)
    return CustomTask(spec, prompt_format, sandbox)
