"""Tasks: specs (what a tenant asks for), data streams and verifiers (what rewards a completion). Their data is
built by `marlaas_hpc.env.build_task_data` (every kind, the env's workloads included)."""
from marlaas_hpc.tasks.base import RewardError, Sample, TaskData
from marlaas_hpc.tasks.registry import SYNTHETIC_KINDS, TASK_KINDS
from marlaas_hpc.tasks.spec import AlgoSpec, DatasetSpec, LoraSpec, SpecError, TaskSpec

__all__ = ["AlgoSpec", "DatasetSpec", "LoraSpec", "RewardError", "Sample", "SpecError", "TaskData", "TaskSpec",
           "SYNTHETIC_KINDS", "TASK_KINDS"]
