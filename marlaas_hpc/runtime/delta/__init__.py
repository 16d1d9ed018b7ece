"""The delta plane: how each new adapter version goes from the trainer leader that owns its task to every rollout
rank (the interface: runtime/delta/plane.py). One transport per module, picked by `delta.transport`:

    plane.py          DeltaPlane (per job: each role's part), DeltaSender (leader), DeltaReceiver (rollout rank)
    broadcast_plane.py  'broadcast': the plane (BroadcastPlane); imports no torch, so neither do rank 0 and env ranks
    broadcast.py      'broadcast': DeltaChannel per leader (NCCL or gloo), DeltaOrder
    fanin.py          'broadcast', rollout side: every leader's channel as one DeltaReceiver (DeltaFanIn)
    relay.py          the relay tier: relays, pushers, the tier's layout and links
    relay_plane.py    'relay': the tier as the job's plane (RelayPublisher, RelayFeed, RelayPlane)
    groups.py         torch.distributed groups of the job's own (stores, backends, completion on the host)
"""
from __future__ import annotations

from marlaas_hpc.runtime.delta.broadcast_plane import BroadcastPlane
from marlaas_hpc.runtime.delta.plane import DeltaPlane, DeltaReceiver, DeltaSender


def delta_plane(settings, rollout_ranks: list[int], leaders: list[int]) -> DeltaPlane:
    """The job's delta plane (config.DeltaSettings `settings`: its `transport`) over its rollout ranks and trainer
    leaders."""
    if settings.transport == "relay":
        # imported only for a relay job (its tier's set-up is collective over the world: every rank uses torch)
        from marlaas_hpc.runtime.delta.relay_plane import RelayPlane

        return RelayPlane(settings, rollout_ranks, leaders)
    return BroadcastPlane(settings, rollout_ranks, leaders)


__all__ = ["DeltaPlane", "DeltaReceiver", "DeltaSender", "delta_plane"]
