"""The relay tier (runtime/delta/relay.py) as the running job's delta plane (`delta.transport: relay`, issue #29 item 1).

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
- Re-formed when the rollout ranks change (`fault.on_rank_loss: continue`: a rollout rank lost, one joined by
  `marlaas scale` or `layout.rollout_replace`, one drained; rank 0's RanksChanged with a new `delta_epoch`). Each
  leader's `remake` retires its pusher (posted pushes are abandoned, never waited for), the first leader hosts a
  new TCPStore and sends its address with the tier's layout over the live rollout ranks (the same chain/tree
  rule over the new member list: `job_relay_layout`) to the other leaders and to every rollout rank of it
  (`RelayAddress` on TAG_DELTA); every member builds its links of the new tier (a rendezvous per link, in one
  order), the rollout ranks between engine steps (`RelayFeed.poll`). Then each leader pushes every task's newest
  version again (runtime/trainer_rank.py PublishOp): a joined rank gets every task's current version from its
  relay before it can start a group of that task (a group waits for its version). Stale pushes cannot reach the new
  tier: it has links of its own. Nothing waits on a dead rank: a send to a dead peer fails at once (its gloo socket
  is closed), the relay drops that child (`Relay._lose_child`) and keeps serving its own rank and its other
  children, a leader drops a push its dead root relay did not take (`RelayPusher.tolerant`), and a relay whose
  parent died stops taking pushes until the re-formed tier replaces it. The old tier's relays are kept (their
  threads left blocked, daemons), with the pins taken there: a group in flight on a surviving rank keeps its
  version in its engine and its pin at the relay it pinned it at; a group re-issued from the lost rank samples
  the newest version (or its eval version), which every live relay gets again.
- No rollout rank live (the only one lost, its `layout.rollout_replace` replacement on its way): no tier for
  that epoch; the leader's sends are counted (`unsent`), and the next tier gets every task's newest version.
- A lost trainer leader is not dropped from the tier: under `continue` the config refuses relays with several
  trainer groups (a group's loss is survivable only with several).
"""
from __future__ import annotations

import time

import torch

from marlaas_hpc.runtime.comm import poll, recv_wait
from marlaas_hpc.runtime.delta.groups import host_store, join_store, keep_till_exit
from marlaas_hpc.runtime.delta.plane import DeltaPlane, DeltaReceiver, DeltaSender, Received, unflatten
from marlaas_hpc.runtime.delta.relay import Relay, RelayPusher, RelayStore, RelayTier, RelayTierLayout
from marlaas_hpc.runtime.messages import TAG_DELTA, RelayAddress


def job_relay_layout(rollout_ranks: list[int], leaders: list[int], fanout: int = 1,
                     chunk_elems: int = 1 << 20) -> RelayTierLayout:
    """The job's tier: every trainer leader pushes into the first rollout rank's relay; the relays are the rollout
    ranks in order (a chain for fanout 1); no remote clients (each rollout rank reads its own relay)."""
    return RelayTierLayout(leaders=list(leaders), relays=list(rollout_ranks), fanout=fanout, chunk_elems=chunk_elems)


def join_relay_tier(comm, layout: RelayTierLayout, timeout_s: float = 600.0) -> RelayTier:
    """Collective over `comm` (every rank of the job calls it at the same point, before the ready barrier): the
    tier's store and this rank's gloo links (none outside the tier)."""
    return RelayTier(comm, layout, device="cpu", timeout_s=timeout_s)


class RelayPublisher(DeltaSender):
    """A trainer leader's delta plane in relay mode: the `send` / `close` of a DeltaChannel, without a collective.
    `blocked_s` sums the seconds spent inside `send` (the leader's blocked time per update), `flush_s` those inside
    `flush` and `close` (at the end: until the root relay has taken every push). `comm`: this rank's LiveComm (for
    `remake`); `tolerant`: a push a dead root relay did not take is dropped, not raised."""

    def __init__(self, tier: RelayTier, leader: int, comm=None, tolerant: bool = False, timeout_s: float = 600.0,
                 setup_timeout_s: float = 120.0):
        self.leader, self.comm, self.tolerant, self.timeout_s = leader, comm, tolerant, timeout_s
        self.setup_timeout_s = setup_timeout_s
        """How long a re-formed tier's rendezvous may wait for its members (a member lost meanwhile)."""
        self.pusher: RelayPusher | None = RelayPusher(tier, leader, tolerant=tolerant)
        """None while no rollout rank is live (the last one lost, its replacement not joined yet)."""
        self.layout = tier.layout
        self.epoch = 0
        """The tier's epoch (rank 0's delta_epoch when it was last re-formed)."""
        self.retired: list[RelayPusher] = []
        """Pushers of earlier epochs, with what was posted on them: abandoned, never waited for (module doc)."""
        self.blocked_s, self.flush_s, self.sent = 0.0, 0.0, 0
        self.unsent = 0
        """Versions not pushed because no rollout rank was live (the next tier gets every task's newest)."""

    def stats(self) -> dict:
        """Besides the sender's figures, what the tier's changes cost this leader: tiers it took part in after the
        first, pushes a dead root relay did not take, versions not pushed for want of a relay."""
        pushers = self.retired + ([self.pusher] if self.pusher is not None else [])
        return {**super().stats(), "relay_epoch": self.epoch, "tiers_retired": len(self.retired),
                "pushes_dropped": sum(p.dropped for p in pushers), "unsent": self.unsent}

    def send(self, task_id: str, version: int, tensors: dict[str, torch.Tensor], lora) -> None:
        if self.pusher is None:
            self.unsent += 1
            return
        t0 = time.perf_counter()
        self.pusher.push(task_id, version, tensors, lora)
        self.blocked_s += time.perf_counter() - t0
        self.sent += 1

    def flush(self) -> None:
        """Waits until the root relay has taken every push."""
        t0 = time.perf_counter()
        if self.pusher is not None:
            self.pusher.flush()
        self.flush_s += time.perf_counter() - t0

    def close(self) -> None:
        """Flushes, then tells the relays this leader pushes no more (their threads end once every leader has)."""
        t0 = time.perf_counter()
        if self.pusher is not None:
            self.pusher.close()
        self.flush_s += time.perf_counter() - t0

    def remake(self, rollout_ranks: list[int], epoch: int) -> None:
        """The tier of `epoch` over `rollout_ranks` (module doc): the first leader hosts its store and tells every
        other member; blocks until this leader's link to the new root relay is set up. The caller pushes every
        task again. No rollout rank (the last one lost, a replacement on its way): no tier until the next epoch."""
        if self.pusher is not None:
            self.retired.append(self.pusher)
            keep_till_exit(self.pusher)  # its gloo links may hold abandoned sends (runtime/delta/groups.py)
            self.pusher = None
        self.epoch, self.broken = epoch, None
        if not rollout_ranks:
            return
        old = self.layout
        self.layout = layout = job_relay_layout(rollout_ranks, old.leaders, old.fanout, old.chunk_elems)
        try:
            tier = RelayTier.remade(self._tier_store(layout, epoch), layout, self.leader, self.timeout_s,
                                    self.setup_timeout_s)
            self.pusher = RelayPusher(tier, self.leader, tolerant=self.tolerant)
            self.broken = None
        except Exception as exc:  # a member lost while the tier re-forms: no tier until the next epoch
            self.broken = f"{type(exc).__name__}: {exc}"

    def _tier_store(self, layout: RelayTierLayout, epoch: int):
        """The first leader hosts the tier's store and tells every other member; the others join it. Bounded by
        the set-up deadline: a member that never comes fails the rendezvous, not the job."""
        members = sorted(set(layout.leaders) | set(layout.relays))
        host = layout.leaders[0]
        if self.leader == host:
            store, address = host_store(len(members), None, self.setup_timeout_s)
            for rank in members:
                if rank != host:
                    self.comm.send(RelayAddress(epoch, address, layout), dest=rank, tag=TAG_DELTA)
            return store
        message = recv_wait(self.comm, TAG_DELTA, source=host)[0]
        while message.epoch < epoch:  # (an epoch this leader skipped: never, rank 0 tells each in order)
            message = recv_wait(self.comm, TAG_DELTA, source=host)[0]
        return join_store(message.address, len(members), self.setup_timeout_s)


class RelayFeed(DeltaReceiver):
    """A rollout rank's delta plane in relay mode: its own relay (a thread of this process, started here) and the
    versions it installed and pinned. `poll` has DeltaFanIn's shape: (announce, receive) per version to install.
    `tier` None: a rank that joined the live job, whose relay comes with the first re-formed tier (`comm`: its
    LiveComm, on which the first leader sends each new tier's address)."""

    pins_versions = True

    def __init__(self, tier: RelayTier | None, rank: int, leaders: list[int], comm=None, timeout_s: float = 600.0,
                 setup_timeout_s: float = 120.0):
        self.rank, self.comm, self.timeout_s, self.setup_timeout_s = rank, comm, timeout_s, setup_timeout_s
        self.leaders = list(leaders)
        self.relay = Relay(tier, rank).start() if tier is not None else None
        self.epoch = 0 if tier is not None else -1
        self.retired: list[Relay] = []
        """Relays of earlier epochs (this rank's), with the pins taken there (module doc)."""
        self.clock = None
        """The rank's BusyClock (set by runtime/rollout_rank.py): each re-forming is a `relay_reform` span on the
        timeline, with its epoch and the tier's relays."""
        self.installed: dict[str, int] = {}
        """Task -> the version this rank took last (pinned at its relay until it takes a newer one)."""
        self.pinned: dict[tuple[str, int], list[RelayStore]] = {}
        """(task, version) -> the relay store each pin of it was taken at (an earlier epoch's, after a re-form)."""

    def poll(self) -> Received:
        self._take_addresses()
        if self.relay is None:
            return
        store = self.relay.store
        with store.lock:
            tasks = list(store.versions)
        for task_id in tasks:
            newest = store.newest(task_id)
            have = self.installed.get(task_id)
            if newest is None or (have is not None and newest <= have):
                continue
            found = self._pin_at(store, task_id, newest)  # held until a newer one is taken
            if found is None:
                continue
            if have is not None:
                self.unpin(task_id, have)
            self.installed[task_id] = newest
            yield found[0], lambda found=found: unflatten(*found)

    def _take_addresses(self) -> None:
        """Joins each re-formed tier the first leader announced, in order (module doc)."""
        if self.comm is None:
            return
        while True:
            message, source = poll(self.comm, TAG_DELTA, source=self.leaders[0])
            if source is None:
                return
            if isinstance(message, RelayAddress) and message.epoch > self.epoch:
                self._reform(message)

    def _reform(self, message: RelayAddress) -> None:
        """Joins the tier of a new epoch (bounded by the set-up deadline: past it, no relay until the next one)."""
        t0 = time.time()
        layout = message.layout
        members = sorted(set(layout.leaders) | set(layout.relays))
        if self.relay is not None:
            self.retired.append(self.relay)
            keep_till_exit(self.relay)  # its gloo links may hold abandoned receives (runtime/delta/groups.py)
            self.relay = None
        self.epoch = message.epoch
        failed = None
        try:
            store = join_store(message.address, len(members), self.setup_timeout_s)
            tier = RelayTier.remade(store, layout, self.rank, self.timeout_s, self.setup_timeout_s)
            self.relay = Relay(tier, self.rank).start()
        except Exception as exc:  # a member lost while the tier re-forms: its leader asks rank 0 for another
            failed = f"{type(exc).__name__}: {exc}"
        if self.clock is not None:
            self.clock.note("relay_reform", (), t0, time.time(), epoch=message.epoch, relays=list(layout.relays),
                            **({"failed": failed} if failed else {}))

    def _pin_at(self, store: RelayStore, task_id: str, version: int):
        found = store.get(task_id, version, pin=True)
        if found is not None:
            self.pinned.setdefault((task_id, version), []).append(store)
        return found

    def pin(self, task_id: str, version: int) -> bool:
        """Keeps `version` of `task_id` at this rank's relay until `unpin` (a group sampling with it); False if
        the relay no longer holds it (an eval group's older version, or one from before a re-form: the engine
        still holds its tensors)."""
        return self.relay is not None and self._pin_at(self.relay.store, task_id, version) is not None

    def unpin(self, task_id: str, version: int) -> None:
        """Releases one pin of the version, at the relay it was taken at."""
        stores = self.pinned.get((task_id, version))
        if not stores:
            raise ValueError(f"{task_id} v{version} is not pinned at this rank's relays")
        store = stores.pop()
        if not stores:
            del self.pinned[task_id, version]
        store.unpin(task_id, version)

    def holds(self, task_id: str, version: int) -> bool:
        return self.relay is not None and version in self.relay.store.held(task_id)

    def busy(self) -> bool:
        return False

    def drop_leader(self, leader: int) -> None:
        raise RuntimeError("the relay tier is not re-formed when a trainer leader is lost (delta.transport: relay "
                           "with several trainer groups needs fault.on_rank_loss: stop)")

    def close(self) -> None:
        """Waits until this relay's threads end: every leader closed (and the STOP forwarded to its children). A
        rank that drained left the tier at its last re-forming: no leader closes its relay, nothing to wait for."""
        if self.relay is None or (self.comm is not None and self.comm.members.drained):
            return
        self.relay.join()


class RelayPlane(DeltaPlane):
    """`delta.transport: relay`: the tier is joined by every rank of the job at the same point (its set-up is
    collective over the world; ranks outside the tier get no links)."""

    def _tier(self, comm) -> RelayTier:
        s = self.settings
        return join_relay_tier(comm, job_relay_layout(self.rollout_ranks, self.leaders, s.relay_fanout,
                                                      s.chunk_elems), s.timeout_s)

    def for_scheduler(self, comm) -> None:
        self._tier(comm)

    def for_bystander(self, comm) -> None:
        self._tier(comm)

    def for_leader(self, comm, device: str, model: str | None) -> RelayPublisher:
        return RelayPublisher(self._tier(comm), comm.Get_rank(), comm=comm, tolerant=comm.members.tolerant,
                              **self._timeouts())

    def for_rollout(self, comm, device: str) -> RelayFeed:
        return RelayFeed(self._tier(comm), comm.Get_rank(), self.leaders, comm=comm, **self._timeouts())

    def for_joiner(self, comm, rank: int, leaders: list[int], device: str) -> RelayFeed:
        # its relay comes with the tier re-formed with it
        return RelayFeed(None, rank, leaders, comm=comm, **self._timeouts())

    def _timeouts(self) -> dict:
        return {"timeout_s": self.settings.timeout_s, "setup_timeout_s": self.settings.setup_timeout_s}
