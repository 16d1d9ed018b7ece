"""Rollout side of the LoRA delta broadcasts: one DeltaChannel per trainer group leader (runtime/delta.py).

With one trainer group a rollout rank joins each announced broadcast at once, as it always did. With several,
joining one broadcast and waiting for it could deadlock: rollout rank 1 may see leader A's announce first and
wait in A's broadcast while rollout rank 2 waits in leader B's, each broadcast needing the other rank. So every
announced broadcast is posted without waiting, and finished ones are handed out in each leader's order.

Posting without waiting is not enough under NCCL: operations of communicators that share a GPU must be launched
in the same order on every rank, or the GPU may run rank 1's B before its A while rank 2 waits in A. Announces
from different leaders reach the rollout ranks in different orders, so the order is not theirs: each announce
carries its place in one job-wide order (`seq`, taken by the leader from `DeltaOrder`), and every rollout rank
posts broadcasts in that order, holding an announce back until those before it are posted (they were taken
first, so their announces are already on their way):

    poll():  announces from any leader  ──► held by seq ──► post the next ones in seq order (non-blocking)
             the head of each leader's queue, once complete ──► (announce, tensors)

A task's versions come from whichever group owns it, and a move hands a task to another group at a step
boundary, so version v (old owner) and v+1 (new owner) may complete in either order: the caller installs a
version only if it is newer than the one it holds (RolloutRank._drain_deltas).
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Iterator

import torch

from marlaas_hpc.runtime.comm import poll
from marlaas_hpc.runtime.delta import DeltaChannel, complete, unflatten
from marlaas_hpc.runtime.messages import TAG_DELTA, DeltaAnnounce


class DeltaFanIn:
    """The delta broadcasts of every trainer group leader, as one source of (announce, tensors)."""

    def __init__(self, comm, channels: list[DeltaChannel]):
        if not channels:
            raise ValueError("a rollout rank needs the delta channel of at least one trainer leader")
        self.comm = comm
        self.channels = {channel.leader: channel for channel in channels}
        self.pending: dict[int, deque] = {leader: deque() for leader in self.channels}
        """Per leader: (announce, buffer, work) of posted broadcasts, in the leader's order."""
        self.held: dict[int, tuple[int, DeltaAnnounce]] = {}
        """seq -> (leader, announce) of announced broadcasts not posted yet (one before them is not here yet)."""
        self.next_seq = 0
        """The place in the job's order of the next broadcast to post."""

    @property
    def leaders(self) -> list[int]:
        return list(self.channels)

    def poll(self) -> Iterator[tuple[DeltaAnnounce, Callable[[], dict[str, torch.Tensor]]]]:
        """Yields (announce, receive) for each broadcast ready to be taken; `receive()` returns its tensors.
        One group: every announce at once, `receive` joins the broadcast (blocking, as before). Several: only
        broadcasts that have completed, in each leader's order."""
        if len(self.channels) == 1:
            (leader, channel), = self.channels.items()
            while True:
                announce, _ = poll(self.comm, TAG_DELTA, source=leader)
                if announce is None:
                    return
                yield announce, lambda announce=announce: channel.receive(announce)
        self._take_announces()
        self._post_in_order()
        for leader, queue in self.pending.items():
            while queue and queue[0][2].is_completed():
                announce, flat, work = queue.popleft()
                complete(work)  # raises what the broadcast failed with
                tensors = unflatten(announce, flat)
                yield announce, lambda tensors=tensors: tensors

    def busy(self) -> bool:
        """Broadcasts announced and not yet handed out."""
        return bool(self.held) or any(self.pending.values())

    def _take_announces(self) -> None:
        while True:
            announce, source = poll(self.comm, TAG_DELTA)
            if announce is None:
                return
            if announce.seq is None:
                raise ValueError(f"trainer leader {source} announced {announce.task_id} v{announce.version} without "
                                 f"its place in the delta order, but this rollout rank has {len(self.channels)} "
                                 "trainer leaders (each leader's DeltaChannel needs the job's DeltaOrder)")
            self.held[announce.seq] = (source, announce)

    def _post_in_order(self) -> None:
        while self.next_seq in self.held:
            source, announce = self.held.pop(self.next_seq)
            self.next_seq += 1
            channel = self.channels[source]
            total = sum(int(torch.Size(s).numel()) for s in announce.shapes)
            flat = torch.empty(total, dtype=torch.float32, device=channel.device)
            self.pending[source].append((announce, flat, channel.process_group.broadcast(flat, 0)))
