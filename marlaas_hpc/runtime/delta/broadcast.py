"""LoRA delta broadcast: trainer leader -> every rollout rank, over a torch.distributed group of its own.

The group {trainer leader} ∪ {rollout ranks} is built straight from a TCPStore, not from the default group:
on rollout ranks an in-process vLLM engine owns the default group (world size 1), and on trainer ranks the
default group is megatron's (the trainer ranks). NCCL when every member has a GPU of its own, gloo otherwise
(FACTS.md: vLLM section).

Every posted broadcast is completed on the host (`complete`): under NCCL `work.wait()` only makes the current CUDA
stream wait for the collective and returns at once, so a bound or a flush built on it bounds nothing.

With several trainer groups a rollout rank is a member of several channels, and NCCL needs the operations of
communicators that share a GPU launched in the same order on every rank (a communicator's set-up, its first
use, is a blocking collective of its own): each channel sets its communicator up when it is made, in the
leaders' order on every rollout rank, and every broadcast carries its place in one job-wide order
(`DeltaOrder`), which rollout ranks post in (runtime/delta/fanin.py).

A process group with a dead member cannot be used again, so when the rollout ranks change (one lost, one joined:
rank 0's RanksChanged, runtime/membership.py) each leader remakes its channel among the rollout ranks of the new
`epoch` (`remake`): a new store and group, its address sent to each member on TAG_DELTA after every announce of
the old channel, then the leader's tasks broadcast again (the new members hold none of them, the others may have
missed broadcasts abandoned with the old group). Broadcasts in flight on the old group are abandoned, not waited
for (one to a dead member never ends), and the old group is aborted first (runtime/delta/groups.py: on NCCL its
pending broadcasts would otherwise keep the watchdog counting towards ending this process), then kept, never
destroyed: destroying a gloo group joins its worker threads, which an abandoned broadcast holds until its timeout
(runtime/delta/groups.py `keep_till_exit`: not at the job's end either).
Under a tolerant job a broadcast that fails (its group had a member die) is dropped, not raised: the remade channel
sends that version again.

A channel's set-up has a deadline (`setup_timeout_s`: its store's rendezvous, and its NCCL communicator made in
non-blocking mode and polled, `set_up`). A remade channel whose set-up fails (a member died after rank 0 named it
live, or never came) is aborted and left out: the leader has no channel (`broken`: versions are counted `unsent`)
until the next epoch, which it asks rank 0 for (runtime/trainer_rank.py: DeltaPlaneFailed).
"""
from __future__ import annotations

import time
from collections import deque
from datetime import timedelta

import torch

from marlaas_hpc.runtime.comm import recv_wait, send_settled
from marlaas_hpc.runtime.delta.groups import (SetupFailed, abort, complete, gpu_key, host_store, join_store,
                                             keep_till_exit, process_group, set_up)
from marlaas_hpc.runtime.delta.plane import DeltaSender, flat_buffer, unflatten
from marlaas_hpc.runtime.messages import TAG_DELTA, ChannelAddress, DeltaAnnounce


class DeltaOrder:
    """One order of every trainer leader's delta broadcasts, for a job of several trainer groups: each broadcast
    takes the next number of a counter in a TCPStore that the first leader hosts (`store.add`: a round trip of
    well under a millisecond, answered by the store's server thread whatever that leader is doing), and every
    rollout rank posts the broadcasts in that order (DeltaFanIn). A leader never waits for another leader or for
    a rollout rank to take its number. Made by every trainer leader, in any order."""

    KEY = "delta_seq"

    def __init__(self, comm, leaders: list[int], host: str | None = None, timeout_s: float = 600.0,
                 host_rank: int = 0):
        """Made by every leader and by `host_rank` (world rank 0), which hosts the counter: the job's one rank
        whose loss stops it anyway, so the counter outlives any trainer group."""
        if comm.Get_rank() == host_rank:
            self.store, address = host_store(len(leaders) + 1, host, timeout_s)
            for rank in leaders:
                if rank != host_rank:
                    comm.send(address, dest=rank, tag=TAG_DELTA)
        else:
            self.store = join_store(recv_wait(comm, TAG_DELTA, source=host_rank)[0], len(leaders) + 1, timeout_s)

    def next(self, epoch: int = 0) -> int:
        """The place of the broadcast about to be announced (0, 1, 2, ... over the whole job; each channel epoch
        counts from 0 again: the rollout ranks drop what was held of an epoch once they leave it)."""
        return self.store.add(self.KEY if epoch == 0 else f"{self.KEY}/{epoch}", 1) - 1


class DeltaChannel(DeltaSender):
    """Member 0 is the trainer leader (source of every broadcast); members 1.. are rollout ranks.

    Each member passes its own device (its binding, launch/devices.py). The group uses NCCL when every member
    is on a GPU of its own, with the broadcast buffer on that GPU; otherwise gloo with the buffer in host
    memory (a CPU member, or two members on one GPU under layout.share_gpus: NCCL refuses a duplicate GPU).
    `order` (the leader, several trainer groups): numbers each broadcast in the job's one order. `tolerant`: a
    broadcast that fails is dropped (a member died; the remade channel sends it again), not raised."""

    def __init__(self, comm, leader: int, rollout_ranks: list[int], device: torch.device | str = "cpu",
                 host: str | None = None, timeout_s: float = 600.0, order: DeltaOrder | None = None,
                 tolerant: bool = False, model: str | None = None, setup_timeout_s: float = 120.0):
        self.comm, self.leader, self.rollout_ranks = comm, leader, list(rollout_ranks)
        self.model = model
        """Leader: its trainer group's base model, named in every announce (DeltaAnnounce.model)."""
        self.own = torch.device(device)
        self.host, self.timeout_s, self.order, self.tolerant = host, timeout_s, order, tolerant
        self.setup_timeout_s = setup_timeout_s
        """How long the channel's set-up may wait for its members (module doc)."""
        self.epoch = 0
        self.broken: str | None = None
        """Leader: why the channel of `epoch` could not be set up (None: it is up)."""
        self.unsent = 0
        """Leader: versions not sent for want of a channel (the next one gets every task's newest)."""
        self.in_flight: deque = deque()
        """Leader: (work, buffer, announce requests) of posted broadcasts, oldest first."""
        self.retired: list = []
        """Process groups of earlier epochs and what was in flight on them: never destroyed (module doc)."""
        self.keys: dict[int, str | None] = {}
        """Leader: each member's GPU (gpu_key), which decides the backend."""
        self.blocked_s, self.flush_s, self.sent = 0.0, 0.0, 0
        """Leader: seconds spent inside `send` (its blocked time per update), inside `flush` (at the end), and
        versions sent."""
        if comm.Get_rank() == leader:
            # the rollout ranks arrive once their engine is up, seconds after a trainer: wait without spinning
            self.keys = {rank: recv_wait(comm, TAG_DELTA, source=rank)[0] for rank in self.rollout_ranks}
            self._host(0)
        else:
            comm.send(gpu_key(self.own), dest=leader, tag=TAG_DELTA)
            self._join(recv_wait(comm, TAG_DELTA, source=leader)[0])

    @classmethod
    def joined(cls, comm, address: ChannelAddress, device: torch.device | str = "cpu", tolerant: bool = False,
               timeout_s: float = 600.0, setup_timeout_s: float = 120.0) -> "DeltaChannel":
        """A rollout rank's member of a channel made after it started (a joined rank, or a remade channel); raises
        SetupFailed if its set-up does not complete."""
        channel = cls.__new__(cls)
        channel.comm, channel.leader, channel.rollout_ranks = comm, address.members[0], list(address.members[1:])
        channel.own, channel.host, channel.timeout_s, channel.order = torch.device(device), None, timeout_s, None
        channel.tolerant, channel.in_flight, channel.retired, channel.keys = tolerant, deque(), [], {}
        channel.setup_timeout_s, channel.broken, channel.unsent = setup_timeout_s, None, 0
        channel._join(address)
        return channel

    def _host(self, epoch: int) -> None:
        """Leader: a new store and group for `rollout_ranks`; its address to each of them, then set it up."""
        members = [self.leader] + self.rollout_ranks
        keys = [gpu_key(self.own)] + [self.keys[rank] for rank in self.rollout_ranks]
        self.backend = "nccl" if all(keys) and len(set(keys)) == len(keys) else "gloo"
        store, address = host_store(len(members), self.host, self.setup_timeout_s)
        for rank in self.rollout_ranks:
            self.comm.send(ChannelAddress(epoch, address, self.backend, tuple(members)), dest=rank, tag=TAG_DELTA)
        self._connect(store, 0, len(members), epoch)

    def _join(self, address: ChannelAddress) -> None:
        members = list(address.members)
        self.backend, self.rollout_ranks = address.backend, members[1:]
        try:
            store = join_store(address.address, len(members), self.setup_timeout_s)
        except Exception as exc:  # the leader's store is gone (it gave this channel up) or never answered
            raise SetupFailed(f"{type(exc).__name__}: {exc}") from exc
        self._connect(store, members.index(self.comm.Get_rank()), len(members), address.epoch)

    def _connect(self, store, member: int, size: int, epoch: int) -> None:
        """The channel's group, set up here (module doc); raises SetupFailed past the deadline."""
        self.member, self.size, self.epoch = member, size, epoch
        self.device = self.own if self.backend == "nccl" else torch.device("cpu")
        self.process_group = None
        try:  # gloo meets its members in the constructor (bounded by the store's timeout, the set-up deadline)
            group = process_group(self.backend, store, member, size, timedelta(seconds=self.timeout_s),
                                  timedelta(seconds=self.setup_timeout_s))
        except Exception as exc:
            raise SetupFailed(f"{type(exc).__name__}: {exc}") from exc
        # NCCL sets a communicator up at its first collective, until every member joins: done here, while every
        # rollout rank makes its channels in the same (leaders') order, never at a first broadcast that two rollout
        # ranks may reach in different orders
        set_up(group, self.device, self.setup_timeout_s)
        self.process_group = group

    def _retire(self) -> None:
        """Leaves the current group: aborted (nothing pending on it can hold this rank), then kept till the process
        ends (module doc)."""
        if self.process_group is not None:
            abort(self.process_group)
            self.retired.append((self.process_group, self.in_flight))
            keep_till_exit(self.retired[-1])
        self.process_group, self.in_flight = None, deque()

    def remake(self, rollout_ranks: list[int], epoch: int) -> None:
        """Leader: the channel of `epoch` among `rollout_ranks` (module doc). A member new to this leader first
        sends its GPU (as every rollout rank does at start). Blocks until every member has joined, or until the
        set-up deadline: then the channel is `broken` until the next epoch."""
        for rank in rollout_ranks:
            if rank not in self.keys:
                self.keys[rank] = recv_wait(self.comm, TAG_DELTA, source=rank)[0]
        self._retire()
        self.rollout_ranks = list(rollout_ranks)
        try:
            self._host(epoch)
            self.broken = None
        except SetupFailed as exc:
            self.epoch, self.broken = epoch, str(exc)

    def send(self, task_id: str, version: int, tensors: dict[str, torch.Tensor], lora) -> None:
        """Leader: announce over MPI, then post the broadcast of one flat buffer of every tensor, without waiting
        for it. Rollout ranks join between their engine steps: waiting here stalled the trainer for up to one
        generate step per published version (a quarter of its time on local-demo). The group runs posted
        broadcasts in order; at most MAX_IN_FLIGHT wait, and `flush` waits for all."""
        if self.process_group is None:  # no channel this epoch (`broken`): the next one carries the newest
            self.unsent += 1
            return
        t0 = time.perf_counter()
        self._reap(self.MAX_IN_FLIGHT - 1)
        names = sorted(tensors)
        seq = self.order.next(self.epoch) if self.order is not None else None
        announce = DeltaAnnounce(task_id, version, names, [tuple(tensors[n].shape) for n in names], lora, seq,
                                 self.epoch, self.model)
        requests = [(rank, self.comm.isend(announce, dest=rank, tag=TAG_DELTA)) for rank in self.rollout_ranks]
        flat = flat_buffer(tensors, names, self.device)
        self.in_flight.append((self.process_group.broadcast(flat, 0), flat, requests))  # the buffer lives until done
        self.blocked_s += time.perf_counter() - t0
        self.sent += 1

    MAX_IN_FLIGHT = 16
    """Posted broadcasts the leader lets wait for the rollout ranks before it waits itself (bounds memory)."""

    def _reap(self, keep: int) -> None:
        """Finishes completed broadcasts, oldest first, and waits (on the host) until at most `keep` are left."""
        while self.in_flight and (len(self.in_flight) > keep or self.in_flight[0][0].is_completed()):
            work, _, requests = self.in_flight[0]
            try:
                complete(work)  # raises what the broadcast failed with
            except Exception:
                if not self.tolerant:
                    raise
            self.in_flight.popleft()  # its buffer may go now: the broadcast has read it
            for rank, request in requests:  # an announce to a rank that died is dropped
                while not send_settled(self.comm, request, rank):
                    time.sleep(0.0002)

    def flush(self) -> None:
        """Leader: waits until every posted broadcast is complete (before the rank leaves the group)."""
        t0 = time.perf_counter()
        self._reap(0)
        self.flush_s += time.perf_counter() - t0

    def close(self) -> None:
        """Leader, before it leaves: `flush` (the relay plane's publisher also ends its tier there)."""
        self.flush()

    def stats(self) -> dict:
        return {**super().stats(), "epoch": self.epoch, "channels_retired": len(self.retired), "unsent": self.unsent}

    def receive(self, announce: DeltaAnnounce) -> dict[str, torch.Tensor]:
        """Rollout rank: join the broadcast that follows `announce` and unflatten it."""
        total = sum(int(torch.Size(s).numel()) for s in announce.shapes)
        flat = torch.empty(total, dtype=torch.float32, device=self.device)
        complete(self.process_group.broadcast(flat, 0))
        return unflatten(announce, flat)
