"""Adapter relays (issue #29, item 1): a tier of node relays that trainer leaders push adapter versions into and
rollout ranks pull from, so that no collective includes a rollout rank's engine loop. The job uses it under
`delta.transport: relay` (runtime/delta/relay_plane.py: one relay per rollout rank, chained); the default delta plane is
still the lockstep broadcast (runtime/delta/broadcast.py).

    leader ──push (header, chunks)──► relay 0 ──chunk by chunk──► relay 1 ──► relay 2 ...   (a tree, fan-out F)
                                        │                            │
                              rollout ranks of node 0      rollout ranks of node 1   pull(task) between steps

- A relay (`Relay`: one per rollout node, threads of a CPU rank or of a rollout rank) keeps in host memory the
  newest version of every task's adapter plus every version a client pins (`RelayStore`: pin counts; a version
  goes once it is superseded and unpinned).
- A push (`RelayPusher.push`) numbers the version from a counter in the tier's TCPStore, puts its announce
  (names, shapes, LoraSpec) in that store, then posts one header and the flat buffer in chunks to the root relay
  and returns without waiting (at most MAX_IN_FLIGHT pushes outstanding, as DeltaChannel). Each relay forwards
  every chunk to its children as soon as it has it (pipelined: the last relay holds a version about one chunk
  time per hop after the first), and records the version once it holds it whole.
- A pull (`RelayClient.pull`) asks its node's relay for a task's newest version (or a given one) and returns at
  once with None if the relay does not hold it yet: only the pulling rank waits, and only for its own relay.

Transport: torch.distributed point-to-point on one two-member process group per link (leader→root, parent→child,
relay→client), built from the tier's TCPStore (like the delta channels, not from the default group, which vLLM or
megatron own); NCCL when both ends have a GPU of their own (`gpu_key`), gloo otherwise. Pairwise groups keep set-up
and connections linear in the tier's size. The bytes are those of the delta broadcast: `flat_buffer` and
`unflatten` of runtime/delta/plane.py. Requests and announces travel through the store (answered by its server thread).
"""
from __future__ import annotations

import pickle
import threading
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from marlaas_hpc.config_loader import SpecError
from marlaas_hpc.runtime.comm import recv_wait
from marlaas_hpc.runtime.delta.groups import complete, gpu_key, host_store, join_store, process_group
from marlaas_hpc.runtime.delta.plane import flat_buffer, unflatten
from marlaas_hpc.runtime.faults import is_peer_lost
from marlaas_hpc.runtime.messages import TAG_DELTA, DeltaAnnounce

STOP = -1
"""A header's or request's number that ends the thread reading that link."""


@dataclass(kw_only=True)
class RelayTierLayout:
    """Who is who in one relay tier (world ranks of the MPI communicator that builds it)."""

    leaders: list[int]
    """Trainer leaders: each pushes into the root relay (relays[0])."""
    relays: list[int]
    """Ranks that host a relay, in breadth-first order of the tree: relay i's parent is relays[(i - 1) // fanout]."""
    clients: dict[int, int] = field(default_factory=dict)
    """Rollout rank -> the rank of its node's relay (a rank hosting its own relay reads it in process instead)."""
    fanout: int = 1
    """Children per relay: 1 is a chain (pipelined, one hop per relay), 2+ a tree (fewer hops, egress shared)."""
    chunk_elems: int = 1 << 20
    """float32 elements per chunk of a push (4 MiB): the unit a relay forwards as soon as it has it."""

    def validate(self, prefix: str = "relay") -> "RelayTierLayout":
        if not self.leaders:
            raise SpecError(f"{prefix}.leaders", "a relay tier needs at least one trainer leader")
        if not self.relays or len(set(self.relays)) != len(self.relays):
            raise SpecError(f"{prefix}.relays", f"needs one or more distinct ranks, got {self.relays}")
        if set(self.leaders) & set(self.relays):
            raise SpecError(f"{prefix}.leaders", "a trainer leader cannot host a relay")
        for client, relay in self.clients.items():
            if relay not in self.relays:
                raise SpecError(f"{prefix}.clients", f"rank {client}'s relay {relay} is not one of {self.relays}")
        if self.fanout < 1:
            raise SpecError(f"{prefix}.fanout", f"must be >= 1, got {self.fanout}")
        if self.chunk_elems < 1:
            raise SpecError(f"{prefix}.chunk_elems", f"must be >= 1, got {self.chunk_elems}")
        return self

    def parent(self, relay: int) -> list[int]:
        """The ranks that push into `relay`: every leader for the root, else its parent relay."""
        index = self.relays.index(relay)
        return list(self.leaders) if index == 0 else [self.relays[(index - 1) // self.fanout]]

    def children(self, relay: int) -> list[int]:
        index = self.relays.index(relay)
        first = index * self.fanout + 1
        return self.relays[first:first + self.fanout]

    def links(self) -> list[tuple[int, int]]:
        """Every (sender, receiver) link, in one order every member builds them in (gloo and NCCL set-up is a
        blocking rendezvous of the two ends: one global order cannot deadlock)."""
        pushes = [(up, relay) for relay in self.relays for up in self.parent(relay)]
        pulls = [(relay, client) for client, relay in self.clients.items() if client != relay]
        return sorted(pushes + pulls)


class RelayStore:
    """A relay's versions: the newest of each task, plus every version pinned (by in-flight groups). Thread-safe:
    the relay's link threads put and read it. A version goes once it is superseded and no pin holds it."""

    def __init__(self):
        self.lock = threading.Lock()
        self.versions: dict[str, dict[int, tuple[DeltaAnnounce, torch.Tensor]]] = {}
        """task -> version -> (announce, flat float32 buffer in host memory)."""
        self.pins: dict[tuple[str, int], int] = {}
        """(task, version) -> how many pins hold it."""

    def put(self, announce: DeltaAnnounce, flat: torch.Tensor) -> None:
        with self.lock:
            self.versions.setdefault(announce.task_id, {})[announce.version] = (announce, flat)
            self._evict(announce.task_id)

    def newest(self, task_id: str) -> int | None:
        with self.lock:
            held = self.versions.get(task_id)
            return max(held) if held else None

    def get(self, task_id: str, version: int | None = None, pin: bool = False):
        """(announce, flat) of `version` (None: the newest), or None if not held; `pin` holds it until `unpin`."""
        with self.lock:
            held = self.versions.get(task_id, {})
            version = max(held, default=None) if version is None else version
            if version not in held:
                return None
            if pin:
                self.pins[task_id, version] = self.pins.get((task_id, version), 0) + 1
            return held[version]

    def unpin(self, task_id: str, version: int) -> None:
        with self.lock:
            count = self.pins.get((task_id, version), 0)
            if count <= 0:
                raise ValueError(f"{task_id} v{version} is not pinned at this relay")
            if count == 1:
                del self.pins[task_id, version]
            else:
                self.pins[task_id, version] = count - 1
            self._evict(task_id)

    def held(self, task_id: str) -> list[int]:
        with self.lock:
            return sorted(self.versions.get(task_id, {}))

    def _evict(self, task_id: str) -> None:
        held = self.versions[task_id]
        newest = max(held)
        for version in [v for v in held if v != newest and (task_id, v) not in self.pins]:
            del held[version]


class _Link:
    """One two-member process group: member 0 sends pushes or answers pulls, member 1 the other end."""

    def __init__(self, store, sender: int, receiver: int, me: int, key: str | None, peer_key: str | None,
                 timeout: timedelta, setup_timeout: timedelta | None = None):
        self.peer = receiver if me == sender else sender
        keys = [key, peer_key]
        self.backend = "nccl" if all(keys) and key != peer_key else "gloo"
        nccl = self.backend == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        prefixed = dist.PrefixStore(f"link/{sender}-{receiver}", store)
        self.member = 0 if me == sender else 1
        self.group = process_group(self.backend, prefixed, self.member, 2, timeout, setup_timeout)

    def send(self, tensor: torch.Tensor):
        return self.group.send([tensor.to(self.device)], 1 - self.member, 0)

    def recv(self, tensor: torch.Tensor) -> torch.Tensor:
        """Blocks this thread until `tensor` (on the link's device) is filled; returns it."""
        self.done(self.group.recv([tensor], 1 - self.member, 0))
        return tensor

    def done(self, work) -> None:
        """Waits on the host for a posted send or receive. Gloo's point-to-point works only learn that they are
        complete inside wait() (is_completed() stays false until then), NCCL's only on the host by polling."""
        complete(work) if self.backend == "nccl" else work.wait()

    def finished(self, work) -> bool:
        """Whether `work` is known complete without waiting (never, for gloo point-to-point: see `done`)."""
        return self.backend == "nccl" and work.is_completed()


class RelayTier:
    """The tier's store and this rank's links. Collective over `comm`: every rank of it makes one (a rank outside
    `layout` gets no links); `device` is the rank's own (its binding), for choosing NCCL or gloo per link. The
    store is hosted by the first trainer leader (not by a relay: it outlives any rollout rank's loss)."""

    def __init__(self, comm, layout: RelayTierLayout, device: torch.device | str = "cpu",
                 host: str | None = None, timeout_s: float = 600.0):
        self.layout = layout.validate()
        me = comm.Get_rank()
        members = sorted(set(layout.leaders) | set(layout.relays) | set(layout.clients))
        root = layout.leaders[0]
        keys = comm.allgather(gpu_key(torch.device(device)) if me in members else None)
        if me == root:
            self.store, address = host_store(len(members), host, timeout_s)
            for rank in members:
                if rank != root:
                    comm.send(address, dest=rank, tag=TAG_DELTA)
        elif me in members:
            self.store = join_store(recv_wait(comm, TAG_DELTA, source=root)[0], len(members), timeout_s)
        self._connect(me, keys, timeout_s)

    @classmethod
    def remade(cls, store, layout: RelayTierLayout, me: int, timeout_s: float = 600.0,
               setup_timeout_s: float | None = None) -> "RelayTier":
        """A tier re-formed over a new member list while the job runs (runtime/delta/relay_plane.py): `store` is the
        new epoch's (hosted by the first leader), every link gloo. Blocks until this rank's links are set up (each
        a rendezvous of its two ends, in the one order of `links()`), or raises past `setup_timeout_s` (a member
        lost meanwhile)."""
        tier = cls.__new__(cls)
        tier.layout, tier.store = layout.validate(), store
        tier._connect(me, {}, timeout_s, setup_timeout_s)
        return tier

    def _connect(self, me: int, keys, timeout_s: float, setup_timeout_s: float | None = None) -> None:
        timeout = timedelta(seconds=timeout_s)
        setup = None if setup_timeout_s is None else timedelta(seconds=setup_timeout_s)
        key = (lambda rank: keys[rank] if isinstance(keys, list) else keys.get(rank))
        self.links: dict[tuple[int, int], _Link] = {
            (a, b): _Link(self.store, a, b, me, key(a), key(b), timeout, setup)
            for a, b in self.layout.links() if me in (a, b)}


class RelayPusher:
    """A trainer leader's side: `push` one version into the root relay and return; `flush`/`close` before leaving."""

    MAX_IN_FLIGHT = 16
    """Pushes posted and not yet taken by the root relay before `push` waits (bounds the buffers kept alive)."""

    def __init__(self, tier: RelayTier, leader: int, tolerant: bool = False):
        self.tier, self.tolerant = tier, tolerant
        """`tolerant`: a push that fails because a relay died is dropped, not raised (the tier is re-formed over
        the live ranks and the version pushed again: runtime/delta/relay_plane.py)."""
        self.link = tier.links[leader, tier.layout.relays[0]]
        self.in_flight: deque = deque()
        """(works, buffer) of posted pushes, oldest first."""
        self.dropped = 0
        """Pushes dropped after their root relay died (tolerant)."""

    def push(self, task_id: str, version: int, tensors: dict[str, torch.Tensor], lora) -> int:
        """Posts `version` of `task_id` into the tier and returns its number in the tier's order of pushes."""
        self._reap(self.MAX_IN_FLIGHT - 1)
        names = sorted(tensors)
        seq = self.tier.store.add("push_seq", 1) - 1
        announce = DeltaAnnounce(task_id, version, names, [tuple(tensors[n].shape) for n in names], lora, seq)
        self.tier.store.set(f"announce/{seq}", pickle.dumps(announce))
        flat = flat_buffer(tensors, names, self.link.device)
        header = torch.tensor([seq, flat.numel()], dtype=torch.int64)
        chunks = _chunks(flat, self.tier.layout.chunk_elems)
        try:
            works = [self.link.send(header)] + [self.link.send(chunk) for chunk in chunks]
        except Exception as exc:
            self._failed(exc)
            return seq
        self.in_flight.append((works, flat))  # the buffer lives until the root relay has read it
        return seq

    def _reap(self, keep: int) -> None:
        link = self.link
        while self.in_flight and (len(self.in_flight) > keep or all(map(link.finished, self.in_flight[0][0]))):
            for work in self.in_flight.popleft()[0]:
                try:
                    link.done(work)
                except Exception as exc:
                    self._failed(exc)

    def _failed(self, exc: Exception) -> None:
        """A send to the root relay failed: dropped if the relay died in a tolerant job, else raised."""
        if not (self.tolerant and is_peer_lost(exc)):
            raise exc
        self.dropped += 1

    def flush(self) -> None:
        """Waits until the root relay has taken every posted push."""
        self._reap(0)

    def close(self) -> None:
        """Tells the relays this leader pushes no more (the tier's threads end once every leader has closed)."""
        self.flush()
        try:
            self.link.done(self.link.send(torch.tensor([STOP, 0], dtype=torch.int64)))
        except Exception as exc:
            self._failed(exc)


def _chunks(flat: torch.Tensor, size: int) -> list[torch.Tensor]:
    return [flat[start:start + size] for start in range(0, flat.numel(), size)]


class Relay:
    """A node's relay: one thread per upstream link (receives pushes, forwards each chunk to the children, keeps
    the version) and one per client link (answers pulls and unpins). `start()` runs them; `join()` waits for all
    to end (every leader closed, every client closed)."""

    def __init__(self, tier: RelayTier, rank: int):
        self.tier, self.rank = tier, rank
        layout = tier.layout
        self.store = RelayStore()
        self.upstream = [tier.links[up, rank] for up in layout.parent(rank)]
        self.children = [tier.links[rank, child] for child in layout.children(rank)]
        self.clients = [link for (a, _), link in tier.links.items() if a == rank and link.peer not in layout.relays]
        self.forward_lock = threading.Lock()
        """Held while one push is forwarded: the children receive pushes whole, one after another."""
        self.lost_peers: list[int] = []
        """Ranks whose link failed (a child or a parent that died): a lost child is no longer forwarded to; a lost
        parent's thread ends. The tier is re-formed over the live ranks (runtime/delta/relay_plane.py)."""
        self.open_upstream = len(self.upstream)
        self.threads = [threading.Thread(target=self._take_pushes, args=(link,), daemon=True) for link in self.upstream]
        self.threads += [threading.Thread(target=self._answer_pulls, args=(link,), daemon=True)
                         for link in self.clients]

    def start(self) -> "Relay":
        for thread in self.threads:
            thread.start()
        return self

    def join(self) -> None:
        for thread in self.threads:
            thread.join()

    def _take_pushes(self, link: _Link) -> None:
        try:
            while True:
                header = link.recv(torch.empty(2, dtype=torch.int64, device=link.device)).cpu()
                with self.forward_lock:
                    if int(header[0]) == STOP:
                        self.open_upstream -= 1
                        if self.open_upstream == 0:  # the last leader closed: the children may end too
                            self._wait_children(self._to_children(header))
                        return
                    self._take_one(link, header)
        except Exception as exc:  # the parent (or the tier's store) is gone: this relay takes no more pushes
            if not is_peer_lost(exc):
                raise
            self.lost_peers.append(link.peer)

    def _take_one(self, link: _Link, header: torch.Tensor) -> None:
        seq, total = int(header[0]), int(header[1])
        flat = torch.empty(total, dtype=torch.float32, device=link.device)
        works = self._to_children(header)
        for chunk in _chunks(flat, self.tier.layout.chunk_elems):
            link.recv(chunk)
            works += self._to_children(chunk)  # forwarded as soon as it is here
        announce = pickle.loads(self.tier.store.get(f"announce/{seq}"))
        self.store.put(announce, flat.cpu())
        self._wait_children(works)  # the children take it while this relay already holds it for its clients

    def _to_children(self, tensor: torch.Tensor) -> list:
        """Posts `tensor` to every live child; a child whose link fails (it died) is dropped, not raised."""
        works = []
        for child in list(self.children):
            try:
                works.append((child, child.send(tensor)))
            except Exception as exc:
                self._lose_child(child, exc)
        return works

    def _wait_children(self, works: list) -> None:
        for child, work in works:
            if child not in self.children:
                continue
            try:
                child.done(work)
            except Exception as exc:
                self._lose_child(child, exc)

    def _lose_child(self, child: _Link, exc: Exception) -> None:
        """A child relay died: nothing more is forwarded to it (a send to a dead peer fails, it never hangs: the
        link's socket is closed), and this relay goes on serving its own rank and its other children."""
        if not is_peer_lost(exc):
            raise exc
        self.children.remove(child)
        self.lost_peers.append(child.peer)

    def _answer_pulls(self, link: _Link) -> None:
        while True:
            number = int(link.recv(torch.empty(1, dtype=torch.int64, device=link.device))[0])
            if number == STOP:
                return
            op, task_id, version = pickle.loads(self.tier.store.get(f"request/{link.peer}/{number}"))
            if op == "unpin":
                self.store.unpin(task_id, version)
                continue
            found = self.store.get(task_id, version, pin=op == "pin")
            if found is None:
                link.done(link.send(torch.tensor([STOP, 0], dtype=torch.int64)))
                continue
            announce, flat = found
            link.done(link.send(torch.tensor([announce.seq, flat.numel()], dtype=torch.int64)))
            link.done(link.send(flat))


class RelayClient:
    """A rollout rank's side of its node's relay: pull a task's version between engine steps (only this rank waits,
    and only for its relay), pin the version its in-flight groups use and unpin it when they end."""

    def __init__(self, tier: RelayTier, rank: int):
        self.tier, self.rank = tier, rank
        self.relay = tier.layout.clients[rank]
        self.link = tier.links[self.relay, rank]
        self.requests = 0

    def pull(self, task_id: str, version: int | None = None, pin: bool = False):
        """(announce, tensors) of `version` of `task_id` (None: the newest the relay holds), or None when the relay
        does not hold it (yet). `pin`: the relay keeps that version until `unpin`, even once superseded."""
        self._ask("pin" if pin else "pull", task_id, version)
        header = self.link.recv(torch.empty(2, dtype=torch.int64, device=self.link.device)).cpu()
        if int(header[0]) == STOP:
            return None
        announce = pickle.loads(self.tier.store.get(f"announce/{int(header[0])}"))
        flat = self.link.recv(torch.empty(int(header[1]), dtype=torch.float32, device=self.link.device))
        return announce, unflatten(announce, flat)

    def unpin(self, task_id: str, version: int) -> None:
        self._ask("unpin", task_id, version)

    def close(self) -> None:
        self.link.done(self.link.send(torch.tensor([STOP], dtype=torch.int64)))

    def _ask(self, op: str, task_id: str, version: int | None) -> None:
        self.tier.store.set(f"request/{self.rank}/{self.requests}", pickle.dumps((op, task_id, version)))
        self.link.done(self.link.send(torch.tensor([self.requests], dtype=torch.int64)))
        self.requests += 1


class LocalRelayClient:
    """RelayClient's in-process twin: a rollout rank that hosts its node's relay (a thread of its own) reads the
    relay's store directly, since a rank cannot make a link to itself; tests use it without processes."""

    def __init__(self, store: RelayStore):
        self.store = store

    def pull(self, task_id: str, version: int | None = None, pin: bool = False):
        found = self.store.get(task_id, version, pin=pin)
        return None if found is None else (found[0], unflatten(*found))

    def unpin(self, task_id: str, version: int) -> None:
        self.store.unpin(task_id, version)

    def close(self) -> None:
        """Nothing to end: no link."""
