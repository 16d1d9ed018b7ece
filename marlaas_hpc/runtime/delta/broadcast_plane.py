"""`delta.transport: broadcast` as the job's delta plane: one DeltaChannel per trainer leader (runtime/delta/
broadcast.py), every rollout rank a member of each (DeltaFanIn, runtime/delta/fanin.py).

This module imports no torch: rank 0 and the env ranks take their part of the plane from it (nothing, or with
several trainer groups rank 0's DeltaOrder) and use torch nowhere else, so they start without it (an import of
torch is ~1.4 CPU seconds and ~200 MB of memory a rank). The roles that move tensors import the channels here.
"""
from __future__ import annotations

from marlaas_hpc.runtime.delta.plane import DeltaPlane, DeltaReceiver, DeltaSender
from marlaas_hpc.runtime.messages import TAG_DELTA


class BroadcastPlane(DeltaPlane):
    """One DeltaChannel per trainer leader, every rollout rank a member of each (DeltaFanIn); with several trainer
    groups rank 0 hosts the job's DeltaOrder."""

    def for_scheduler(self, comm):
        if len(self.leaders) == 1:
            return None
        from marlaas_hpc.runtime.delta.broadcast import DeltaOrder

        # the job's order of delta broadcasts: it outlives any trainer group
        return DeltaOrder(comm, self.leaders)

    def for_bystander(self, comm) -> None:
        return None

    def for_leader(self, comm, device: str, model: str | None) -> DeltaSender:
        from marlaas_hpc.runtime.delta.broadcast import DeltaChannel, DeltaOrder

        order = DeltaOrder(comm, self.leaders) if len(self.leaders) > 1 else None
        return DeltaChannel(comm, comm.Get_rank(), self.rollout_ranks, device=device, order=order,
                            tolerant=comm.members.tolerant, model=model, **self._timeouts())

    def for_rollout(self, comm, device: str) -> DeltaReceiver:
        from marlaas_hpc.runtime.delta.broadcast import DeltaChannel
        from marlaas_hpc.runtime.delta.fanin import DeltaFanIn

        # one channel per leader, made in the leaders' order on every rollout rank (each leader waits for its
        # own): each channel's NCCL communicator is set up as it is made, in that one order
        tolerant = comm.members.tolerant
        return DeltaFanIn(comm, [DeltaChannel(comm, leader, self.rollout_ranks, device=device, tolerant=tolerant,
                                              **self._timeouts()) for leader in self.leaders],
                          device=device, tolerant=tolerant, **self._timeouts())

    def for_joiner(self, comm, rank: int, leaders: list[int], device: str) -> DeltaReceiver:
        import torch

        from marlaas_hpc.runtime.delta.fanin import DeltaFanIn
        from marlaas_hpc.runtime.delta.groups import gpu_key

        for leader in leaders:  # as every rollout rank does at start: the leader picks the backend
            comm.send(gpu_key(torch.device(device)), leader, TAG_DELTA)
        return DeltaFanIn(comm, [], leaders=leaders, device=device, tolerant=True, **self._timeouts())

    def _timeouts(self) -> dict:
        """The channels' collective timeout and set-up deadline. Asked for by every member before it makes its
        first channel, which is also when torch's bound on a non-blocking NCCL set-up must be in place."""
        from marlaas_hpc.runtime.delta.groups import nccl_setup_deadline

        nccl_setup_deadline(self.settings.setup_timeout_s)
        return {"timeout_s": self.settings.timeout_s, "setup_timeout_s": self.settings.setup_timeout_s}
