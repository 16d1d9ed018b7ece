"""Tasks: specs (what a tenant asks for), data streams and verifiers (what rewards a completion)."""
from marlaas_hpc.tasks.base import RewardError, Sample, TaskData
from marlaas_hpc.tasks.registry import SYNTHETIC_KINDS, TASK_KINDS, build_task_data
from marlaas_hpc.tasks.spec import AlgoSpec, DatasetSpec, LoraSpec, SpecError, TaskSpec

__all__ = ["AlgoSpec", "DatasetSpec", "LoraSpec", "RewardError", "Sample", "SpecError", "TaskData", "TaskSpec",
           "SYNTHETIC_KINDS", "TASK_KINDS", "build_task_data"]
