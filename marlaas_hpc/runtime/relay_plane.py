"""The relay tier (runtime/relay.py) as the running job's delta plane (`delta.transport: relay`, issue #29 item 1).

    trainer leader ──push──► relay of rollout rank 1 ──► relay of rollout rank 2 ──► ...   (chain: relay_fanout 1)
      (returns at once)              │ in process                 │ in process
                               rollout rank 1's loop        rollout rank 2's loop: between engine steps, installs
                                                                                   the newest version of each task

- Placement: every rollout rank hosts one relay, a thread of its own process (`Relay`: it takes pushes from its
  parent, forwards each chunk to its children and keeps the versions), and reads it in process
  (`LocalRelayClient`): on one machine this is one relay per rollout rank; on a cluster, one per rollout rank
  rather than one per node (a relay on a node's first rollout rank serving the others over links is the
  component's option, `RelayTierLayout.clients`, not used here).
- A trainer leader's `RelayPublisher.send` pushes the version into the root relay and returns (`RelayPusher`): no
  collective with a rollout rank. `close()` at the end sends the tier's STOP once the pushes are taken.
- A rollout rank's `RelayFeed.poll`, called between engine steps like `DeltaFanIn.poll`, yields the newest version
  of each task its relay holds that is newer than the one it installed last. Intermediate versions that were
  superseded before the rank looked are skipped (a group samples the newest version there is; a group keeps the
  version it started with). The feed pins what it installed until it installs a newer one, so every group can pin
  its version at start (`pin`), and the relay keeps it until the group completes (`unpin`), whatever arrives.
- Links are gloo (host buffers) whatever the devices: a relay holds versions in host memory anyway, and the NCCL
  links of the component have not been run inside the job (no GPU here).
- Not remade when a rank is lost or joins: the job config refuses relays without `fault.on_rank_loss: stop`.
"""
from __future__ import annotations

import time
from typing import Callable, Iterator

import torch

from marlaas_hpc.runtime.messages import DeltaAnnounce
from marlaas_hpc.runtime.relay import LocalRelayClient, Relay, RelayPusher, RelayTier, RelayTierLayout


def job_relay_layout(rollout_ranks: list[int], leaders: list[int], fanout: int = 1,
                     chunk_elems: int = 1 << 20) -> RelayTierLayout:
    """The job's tier: every trainer leader pushes into the first rollout rank's relay; the relays are the rollout
    ranks in order (a chain for fanout 1); no remote clients (each rollout rank reads its own relay)."""
    return RelayTierLayout(leaders=list(leaders), relays=list(rollout_ranks), fanout=fanout, chunk_elems=chunk_elems)


def join_relay_tier(comm, layout: RelayTierLayout, timeout_s: float = 600.0) -> RelayTier:
    """Collective over `comm` (every rank of the job calls it at the same point, before the ready barrier): the
    tier's store and this rank's gloo links (none outside the tier)."""
    return RelayTier(comm, layout, device="cpu", timeout_s=timeout_s)


class RelayPublisher:
    """A trainer leader's delta plane in relay mode: the `send` / `close` of a DeltaChannel, without a collective.
    `blocked_s` sums the seconds spent inside `send` (the leader's blocked time per update), `flush_s` those inside
    `flush` and `close` (at the end: until the root relay has taken every push)."""

    epoch = 0
    """The tier is never remade (DeltaChannel's epochs count remade channels)."""

    def __init__(self, tier: RelayTier, leader: int):
        self.pusher = RelayPusher(tier, leader)
        self.blocked_s, self.flush_s, self.sent = 0.0, 0.0, 0

    def send(self, task_id: str, version: int, tensors: dict[str, torch.Tensor], lora) -> None:
        t0 = time.perf_counter()
        self.pusher.push(task_id, version, tensors, lora)
        self.blocked_s += time.perf_counter() - t0
        self.sent += 1

    def flush(self) -> None:
        """Waits until the root relay has taken every push."""
        t0 = time.perf_counter()
        self.pusher.flush()
        self.flush_s += time.perf_counter() - t0

    def close(self) -> None:
        """Flushes, then tells the relays this leader pushes no more (their threads end once every leader has)."""
        t0 = time.perf_counter()
        self.pusher.close()
        self.flush_s += time.perf_counter() - t0

    def remake(self, rollout_ranks: list[int], epoch: int) -> None:
        raise RuntimeError("the relay tier is not remade when rollout ranks change (delta.transport: relay needs "
                           "fault.on_rank_loss: stop)")


class RelayFeed:
    """A rollout rank's delta plane in relay mode: its own relay (a thread of this process, started here) and the
    versions it installed and pinned. `poll` has DeltaFanIn's shape: (announce, receive) per version to install."""

    def __init__(self, tier: RelayTier, rank: int, leaders: list[int]):
        self.rank = rank
        self.leaders = list(leaders)
        self.relay = Relay(tier, rank).start()
        self.client = LocalRelayClient(self.relay.store)
        self.installed: dict[str, int] = {}
        """Task -> the version this rank took last (pinned at its relay until it takes a newer one)."""

    def poll(self) -> Iterator[tuple[DeltaAnnounce, Callable[[], dict[str, torch.Tensor]]]]:
        store = self.relay.store
        with store.lock:
            tasks = list(store.versions)
        for task_id in tasks:
            newest = store.newest(task_id)
            have = self.installed.get(task_id)
            if newest is None or (have is not None and newest <= have):
                continue
            found = self.client.pull(task_id, newest, pin=True)  # held until a newer one is taken
            if found is None:
                continue
            if have is not None:
                self.client.unpin(task_id, have)
            self.installed[task_id] = newest
            announce, tensors = found
            yield announce, lambda tensors=tensors: tensors

    def pin(self, task_id: str, version: int) -> bool:
        """Keeps `version` of `task_id` at this rank's relay until `unpin` (a group sampling with it); False if
        the relay no longer holds it (an eval group's older version: the engine still holds its tensors)."""
        return self.relay.store.get(task_id, version, pin=True) is not None

    def unpin(self, task_id: str, version: int) -> None:
        self.client.unpin(task_id, version)

    def holds(self, task_id: str, version: int) -> bool:
        return version in self.relay.store.held(task_id)

    def busy(self) -> bool:
        return False

    def drop_leader(self, leader: int) -> None:
        raise RuntimeError("the relay tier is not remade when a trainer leader is lost (delta.transport: relay "
                           "needs fault.on_rank_loss: stop)")

    def close(self) -> None:
        """Waits until this relay's threads end: every leader closed (and the STOP forwarded to its children)."""
        self.relay.join()
