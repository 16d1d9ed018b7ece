"""Rank-0 scheduler: a pure state machine (core.py) moved by MPI messages or by a simulated clock."""
from marlaas_hpc.scheduler.core import (Admit, AuditRecord, Cancel, Discard, Generate, Generated, Scheduler,
                                        SchedulerConfig, Scored, StepDone, Submit, TaskEnded, TaskFailed, Train)
from marlaas_hpc.scheduler.state import CANCELLED, DONE, FAILED, QUEUED, RUNNING, Group, TaskState

__all__ = ["Admit", "AuditRecord", "Cancel", "Discard", "Generate", "Generated", "Scheduler", "SchedulerConfig",
           "Scored", "StepDone", "Submit", "TaskEnded", "TaskFailed", "Train", "CANCELLED", "DONE", "FAILED",
           "QUEUED", "RUNNING", "Group", "TaskState"]
