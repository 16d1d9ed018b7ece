"""Launching a job: role layout, Slurm environment, sbatch rendering, submitit het jobs (docs/architecture.md §8).

submitit-dependent pieces live in `submitit_hetjob` / `probe` and are imported on demand."""
from marlaas_hpc.launch.layout import (COMPONENTS, ROLE_KINDS, ComponentResources, JobLayout, LayoutError, Role,
                                       assign_role, ranks_of, require_world_size, world_size_matches)
from marlaas_hpc.launch.slurm_env import SlurmPlacement, expand_hostlist, in_slurm_step, placement_from_env

__all__ = ["COMPONENTS", "ROLE_KINDS", "ComponentResources", "JobLayout", "LayoutError", "Role", "SlurmPlacement",
           "assign_role", "expand_hostlist", "in_slurm_step", "placement_from_env", "ranks_of",
           "require_world_size", "world_size_matches"]
