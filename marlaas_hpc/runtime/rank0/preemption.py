"""Preemption at rank 0 (SIGUSR2, runtime/checkpoint.py PreemptFlag): the scheduler drains (no new work), and once
every group in flight has settled, every live trainer group checkpoints its tasks; the job ends when every group
has answered, and rank 0 marks the run dir preempted (exit status 75)."""
from __future__ import annotations

from marlaas_hpc.runtime.checkpoint import PreemptFlag
from marlaas_hpc.runtime.messages import TAG_CMD, Checkpoint, CheckpointDone


class Preemption:
    def __init__(self, flag: PreemptFlag | None, scheduler, outbox, records, log):
        self.flag = flag or PreemptFlag()
        self.scheduler, self.outbox, self.records, self.log = scheduler, outbox, records, log
        self.sent = False
        self.answers = 0
        self.versions: dict[str, int] = {}
        self.checkpointed: dict[str, int] | None = None
        """Every task's checkpointed version, once every trainer group answered: the job stops."""

    def done(self, evals_pending: bool, leaders: list[int]) -> bool:
        """Drives the drain once USR2 arrived: True when every task is checkpointed and the job may stop."""
        if not self.flag.requested:
            return False
        if not self.scheduler.draining:
            self.scheduler.draining = True
            self.log("[job] USR2: draining in-flight work, then checkpointing every task at a step boundary")
        if not self.sent and self.scheduler.settled() and not evals_pending:
            for leader in leaders:  # every trainer group saves the tasks it owns
                self.outbox.send(Checkpoint(), leader, TAG_CMD)
            self.sent = True
        return self.checkpointed is not None

    def answered(self, event: CheckpointDone, leaders: int) -> None:
        # a leader's StepDone events precede its CheckpointDone (same source and tag: MPI keeps their order)
        for task_id, version in event.versions.items():
            ours = self.scheduler.tasks[task_id].version
            if ours != version:
                raise RuntimeError(f"checkpoint of {task_id}: trainer saved v{version}, scheduler is at v{ours}")
            self.records.saved(self.scheduler.tasks[task_id])
        self.versions.update(event.versions)
        self.answers += 1
        if self.answers == leaders:  # every trainer group has saved its tasks
            self.checkpointed = dict(self.versions)
