"""Multi-tenant service around a running job: the intake queue (`marlaas tasks add/ls/cancel/close`),
tenant isolation (safe names, data roots, unique ids) and per-tenant quotas.

    tenant ──tasks add──► check_spec ──► RUN_DIR/queue/*.json ──(rank 0, every 0.5 s)──► check_spec again
                                                                  ├─► accepted/ ──Submit──► Scheduler (FIFO/priority, max_adapters)
                                                                  └─► rejected/ (+ reason)
    tenant ──tasks cancel──► queue/cancel/<id> ──► Cancel (at the task's next step boundary)
    operator ──tasks close──► queue/CLOSE ──► the job ends once its tasks have ended
"""
from marlaas_hpc.service.intake import IntakeRules, QueueIntake, check_spec
from marlaas_hpc.service.queue import TaskQueue
from marlaas_hpc.service.quotas import TaskRecord, TenantQuota

__all__ = ["IntakeRules", "QueueIntake", "TaskQueue", "TaskRecord", "TenantQuota", "check_spec"]
