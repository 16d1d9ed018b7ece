"""Rank-0 scheduler: a pure state machine (core.py) moved by MPI messages or by a simulated clock."""
from marlaas_hpc.scheduler.core import (MODES, ORDERS, Admit, AuditRecord, Cancel, Discard, Generate, Generated,
                                        Move, Moved, RankJoined, RankLeaving, RankLost, Resumed, Scheduler, SchedulerConfig, Scored, StepDone, Submit,
                                        TaskEnded, TaskFailed, Train)
from marlaas_hpc.scheduler.placement import Placement
from marlaas_hpc.scheduler.state import CANCELLED, DONE, FAILED, QUEUED, RUNNING, Group, TaskState

__all__ = ["MODES", "ORDERS", "Admit", "AuditRecord", "Cancel", "Discard", "Generate", "Generated", "Move", "Moved",
           "Placement", "RankJoined", "RankLeaving", "RankLost", "Resumed",
           "Scheduler", "SchedulerConfig",
           "Scored", "StepDone", "Submit", "TaskEnded", "TaskFailed", "Train", "CANCELLED", "DONE", "FAILED",
           "QUEUED", "RUNNING", "Group", "TaskState"]
