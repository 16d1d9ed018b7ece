"""Rollout side of the LoRA delta broadcasts: one DeltaChannel per trainer group leader (runtime/delta/broadcast.py).

Every announced broadcast is posted without waiting, and finished ones are handed out in each leader's order.
Joining one broadcast and waiting for it could deadlock with several trainer groups (rollout rank 1 may see
leader A's announce first and wait in A's broadcast while rollout rank 2 waits in leader B's, each broadcast
needing the other rank), and, once a rank can be lost, a survivor could wait forever in a broadcast that needs
a dead member.

Posting without waiting is not enough under NCCL: operations of communicators that share a GPU must be launched
in the same order on every rank, or the GPU may run rank 1's B before its A while rank 2 waits in A. Announces
from different leaders reach the rollout ranks in different orders, so the order is not theirs: each announce
carries its place in one job-wide order (`seq`, taken by the leader from `DeltaOrder`), and every rollout rank
posts broadcasts in that order, holding an announce back until those before it are posted (they were taken
first, so their announces are already on their way):

    poll():  TAG_DELTA from each leader, in its order ──► announce of its channel's epoch: post (one leader), or
                                                          hold by seq, post the next ones in seq order (several)
                                                      ──► ChannelAddress of a new epoch: once every leader before
                                                          it has moved to that epoch, abandon what was posted on
                                                          its old channel and join the new one
             the head of each leader's queue, once complete ──► (announce, tensors)

Channels are remade in the leaders' order on every rollout rank, as they are first made: joining a group is a
blocking collective of all its members, so two rollout ranks joining two leaders' new channels in different
orders would wait for each other. Announces of an epoch the leader has left are dropped: the leader broadcasts
its tasks again on the new channel. A channel left behind (remade, or its leader lost) is aborted first: under NCCL
a broadcast on a group with a dead member never completes, and the watchdog would end this rank
(runtime/delta/groups.py); the CPU twin's gloo fails it. A new channel whose set-up fails (a member lost meanwhile,
runtime/delta/broadcast.py) leaves the leader without a channel here until its next address.

A task's versions come from whichever group owns it, and a move hands a task to another group at a step
boundary, so version v (old owner) and v+1 (new owner) may complete in either order: the caller installs a
version only if it is newer than the one it holds (RolloutRank._drain_deltas).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
import torch

from marlaas_hpc.runtime.comm import poll
from marlaas_hpc.runtime.delta.broadcast import DeltaChannel
from marlaas_hpc.runtime.delta.groups import SetupFailed, abort, complete, keep_till_exit
from marlaas_hpc.runtime.delta.plane import DeltaReceiver, Received, unflatten
from marlaas_hpc.runtime.messages import TAG_DELTA, ChannelAddress, DeltaAnnounce


@dataclass
class _Posted:
    announce: DeltaAnnounce
    flat: torch.Tensor
    work: object


class DeltaFanIn(DeltaReceiver):
    """The delta broadcasts of every trainer group leader, as one source of (announce, tensors). `channels`: one
    per leader, in the leaders' order; a leader whose channel is None (a rank that joined the live job) sends its
    address when it makes one."""

    def __init__(self, comm, channels: list[DeltaChannel], leaders: list[int] | None = None,
                 device: torch.device | str = "cpu", tolerant: bool = False, timeout_s: float = 600.0,
                 setup_timeout_s: float = 120.0):
        leaders = leaders if leaders is not None else [channel.leader for channel in channels]
        if not leaders:
            raise ValueError("a rollout rank needs the delta channel of at least one trainer leader")
        self.comm, self.device, self.tolerant = comm, device, tolerant
        self.timeouts = {"timeout_s": timeout_s, "setup_timeout_s": setup_timeout_s}
        """A remade channel's collective timeout and set-up deadline (runtime/delta/broadcast.py)."""
        self.failed: dict[int, int] = {}
        """Leader -> the epoch of its channel whose set-up failed here (it has none until its next address)."""
        self.channels: dict[int, DeltaChannel | None] = dict.fromkeys(leaders)
        self.channels.update({channel.leader: channel for channel in channels})
        self.inbox: dict[int, deque] = {leader: deque() for leader in leaders}
        """Per leader: its TAG_DELTA messages (announces, channel addresses) not handled yet, in its order."""
        self.pending: dict[int, deque[_Posted]] = {leader: deque() for leader in leaders}
        """Per leader: broadcasts posted on its current channel, in its order."""
        self.held: dict[tuple[int, int], tuple[int, DeltaAnnounce]] = {}
        """(epoch, seq) -> (leader, announce) of announced broadcasts not posted yet (one before them is not here)."""
        self.next_seq: dict[int, int] = {}
        """Per epoch: the place in the job's order of the next broadcast to post."""
        self.retired: list = []
        """Channels left behind, with what was posted on them: aborted, never destroyed (runtime/delta/broadcast.py)."""

    @property
    def leaders(self) -> list[int]:
        return list(self.channels)

    def epoch(self, leader: int) -> int:
        channel = self.channels[leader]
        return self.failed.get(leader, -1) if channel is None else channel.epoch

    def poll(self) -> Received:
        """Yields (announce, receive) for each broadcast that has completed, in each leader's order;
        `receive()` returns its tensors."""
        self._take_messages()
        self._advance()
        self._post_in_order()
        for leader, queue in self.pending.items():
            while queue and queue[0].work.is_completed():
                posted = queue.popleft()
                try:
                    complete(posted.work)  # raises what the broadcast failed with
                except Exception:
                    if not self.tolerant:
                        raise
                    continue  # a member died: the remade channel sends this version again
                tensors = unflatten(posted.announce, posted.flat)
                yield posted.announce, lambda tensors=tensors: tensors

    def close(self) -> None:
        """Nothing to end (the relay plane's feed waits for its relay's threads here)."""

    def busy(self) -> bool:
        """Broadcasts announced and not yet handed out."""
        return bool(self.held) or any(self.pending.values()) or any(self.inbox.values())

    def _take_messages(self) -> None:
        while True:
            message, source = poll(self.comm, TAG_DELTA)
            if message is None:
                return
            if source in self.inbox:
                self.inbox[source].append(message)  # (a lost leader's last words are not)

    def _advance(self) -> None:
        """Handles each leader's messages in its order, in the leaders' order (a new channel of leader i only once
        leaders 0..i-1 have theirs of that epoch)."""
        epoch_before = None
        for leader, inbox in self.inbox.items():
            while inbox:
                message = inbox[0]
                if isinstance(message, ChannelAddress):
                    if epoch_before is not None and epoch_before < message.epoch:
                        break  # an earlier leader has not remade its channel yet
                    inbox.popleft()
                    self._switch(leader, message)
                    continue
                inbox.popleft()
                self._announced(leader, message)
            epoch = self.epoch(leader)
            epoch_before = epoch if epoch_before is None else min(epoch_before, epoch)

    def _announced(self, leader: int, announce: DeltaAnnounce) -> None:
        if announce.epoch != self.epoch(leader):
            return  # broadcast on a channel this rank has left (or never had): sent again on the new one
        if announce.seq is None:
            self._post(leader, announce)
        else:
            self.held[(announce.epoch, announce.seq)] = (leader, announce)

    def _switch(self, leader: int, address: ChannelAddress) -> None:
        """Leaves the leader's old channel (aborted; what was posted on it is abandoned) and joins its new one."""
        self._retire(leader)
        try:
            self.channels[leader] = DeltaChannel.joined(self.comm, address, self.device, self.tolerant,
                                                        **self.timeouts)
            self.failed.pop(leader, None)
        except SetupFailed:  # the leader asks rank 0 for another epoch; its announces of this one are dropped
            self.failed[leader] = address.epoch

    def _retire(self, leader: int) -> None:
        """The leader's current channel is left: aborted, kept till the process ends with what was posted on it
        (runtime/delta/groups.py `keep_till_exit`), nothing held of it."""
        old = self.channels.get(leader)
        if old is not None:
            if old.process_group is not None:
                abort(old.process_group)
            self.retired.append((old, list(self.pending.get(leader, ()))))
            keep_till_exit(self.retired[-1])
            self.channels[leader] = None
        self.pending[leader] = deque()
        for key in [key for key, (source, _) in self.held.items() if source == leader]:
            del self.held[key]

    def drop_leader(self, leader: int) -> None:
        """A trainer leader is lost: its channel is aborted and left behind with what was posted on it (its group's
        tasks are published by their new group, under a new name: TaskState.adapter_key)."""
        if leader not in self.channels:
            return
        self._retire(leader)
        del self.channels[leader]
        self.pending.pop(leader, None)
        self.inbox.pop(leader, None)
        self.failed.pop(leader, None)

    def _post_in_order(self) -> None:
        for epoch in sorted({epoch for epoch, _ in self.held}):
            seq = self.next_seq.setdefault(epoch, 0)
            while (epoch, seq) in self.held:
                leader, announce = self.held.pop((epoch, seq))
                seq += 1
                self._post(leader, announce)
            self.next_seq[epoch] = seq

    def _post(self, leader: int, announce: DeltaAnnounce) -> None:
        channel = self.channels[leader]
        if channel is None:  # its channel of this epoch failed to set up here: the leader sends it again
            return
        if announce.seq is None and len(self.channels) > 1:
            raise ValueError(f"trainer leader {leader} announced {announce.task_id} v{announce.version} without "
                             f"its place in the delta order, but this rollout rank has {len(self.channels)} "
                             "trainer leaders (each leader's DeltaChannel needs the job's DeltaOrder)")
        total = sum(int(torch.Size(s).numel()) for s in announce.shapes)
        flat = torch.empty(total, dtype=torch.float32, device=channel.device)
        self.pending[leader].append(_Posted(announce, flat, channel.process_group.broadcast(flat, 0)))
