"""The delta plane in the simulator: how a published adapter version reaches the rollout ranks, and what that
costs the trainer leader and the engines (issue #29). `Simulation(..., delta_plane=...)` hands every publish to
one of these; without one the simulator keeps its older, averaged model (`Simulation.publish`).

    LockstepBroadcast  today's runtime (runtime/delta/broadcast.py, delta_fanin.py): one job-wide order of broadcasts, each
                       over every rollout rank. A rank joins between engine steps: at its next step boundary, or
                       at once while it is still in the previous broadcast (its `_drain_deltas` loop). The
                       broadcast starts when the LAST rank joins; every rank waits in it, engine stalled, until
                       the transfer ends, then installs. The leader posts and returns, but at most
                       `max_in_flight` of its broadcasts may be outstanding (DeltaChannel.MAX_IN_FLIGHT): past
                       that it waits for its oldest (0: it waits for each broadcast, the delta plane before it
                       posted asynchronously).

    RelayTier          the relay design: one relay per rollout node (`ranks_per_node` rollout ranks). The leader
                       pushes a version once into the root relay and returns; relays forward it along a
                       `relay_fanout`-ary tree (1: a chain), pipelined in `relay_chunks` chunks; each rollout rank
                       pulls it from its node's relay at its next step boundary, stalling only itself: every
                       new version (`relay_pull` 'eager', what every rank installs today) or only a version its
                       waiting work asks for ('on_demand').

Bandwidths and latencies are parameters (`DeltaPlaneModel`); the broadcast's transfer is the workload's
`network.delta_bandwidth` / `delta_latency`, as in the averaged model. The broadcast (and the eager relay)
installs every version on every rollout rank, as the runtime does. A rank's step boundary is extrapolated from
its engine's state when the version is published (its token counter and batch then): the batch may change before
that time, which shifts the boundary by less than a step.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from marlaas_hpc.config_loader import SpecError, bounded, check_bounds

PLANES = ("broadcast", "relay")
PULLS = ("eager", "on_demand")


@dataclass(kw_only=True, slots=True)
class DeltaPlaneModel:
    """Which delta plane the simulator models, and its parameters (SI units: seconds, bytes, bytes/s)."""

    plane: str = bounded("broadcast", choices=PLANES)
    """'broadcast' (today's lockstep: every rollout rank in every broadcast) or 'relay' (push once, pull)."""
    max_in_flight: int = bounded(16, ge=0)
    """Broadcast: broadcasts a leader may have outstanding before it waits for its oldest (the runtime's
    DeltaChannel.MAX_IN_FLIGHT); 0: the leader waits for each of its broadcasts to end."""
    push_bandwidth: float = bounded(25e9, gt=0, unit="bytes/s")
    """Relay: leader -> root relay (one sender, the leader's NIC)."""
    relay_bandwidth: float = bounded(25e9, gt=0, unit="bytes/s")
    """Relay: one relay's egress to the relays it forwards to (shared by its children)."""
    relay_latency: float = bounded(50e-6, ge=0, unit="seconds")
    """Relay: per hop (the leader's push included)."""
    relay_fanout: int = bounded(2, ge=1)
    """Relay: children per relay (1: a chain)."""
    relay_chunks: int = bounded(8, ge=1)
    """Relay: chunks a version is pipelined in (a relay forwards a chunk as soon as it holds it)."""
    relay_pull: str = bounded("eager", choices=PULLS)
    """Relay: 'eager' (a rank pulls every new version at its next step boundary: it holds every task's newest, as
    every rank does today) or 'on_demand' (a rank pulls a task's version only when work for it asks for a newer
    one than it holds)."""
    pull_bandwidth: float = bounded(25e9, gt=0, unit="bytes/s")
    """Relay: node relay (host memory) -> a rollout rank on the same node."""
    ranks_per_node: int = bounded(8, ge=1)
    """Relay: rollout ranks per node, one relay each node."""

    def validate(self, prefix: str = "delta_plane") -> "DeltaPlaneModel":
        check_bounds(self, prefix)
        return self


class PlaneMeter:
    """What a delta plane cost: the leader's blocked seconds per published version (the one-off communicator
    set-up of its first broadcasts left out: it is not a per-update cost), and each rollout rank's engine seconds
    spent on the plane (waiting in a broadcast, transfer, install)."""

    def __init__(self, ranks):
        self.leader_blocked: list[float] = []
        self.rank_seconds = {rank: 0.0 for rank in ranks}

    def blocked_per_update(self) -> float:
        return sum(self.leader_blocked) / max(1, len(self.leader_blocked))

    def rank_seconds_per_update(self) -> float:
        """A rollout rank's engine seconds per published version, averaged over ranks."""
        return sum(self.rank_seconds.values()) / max(1, len(self.rank_seconds)) / max(1, len(self.leader_blocked))


def next_step_boundary(rollout, when: float) -> float:
    """The first time >= `when` at which `rollout` (a RolloutSim) is between engine steps, extrapolated from its
    state now: an idle engine is between steps as soon as its stall ends; a running one finishes the step its
    token counter is in, then every step_time(running) + step_overhead."""
    rollout._advance()
    now = rollout.sim.queue.now
    resume = rollout.stall_until if rollout.stall_until > now else now
    if not rollout.running:
        return when if when > resume else resume
    per_step = rollout._step_time(len(rollout.running)) + rollout.model.step_overhead
    first = resume + (math.ceil(rollout.tokens - 1e-9) - rollout.tokens) * per_step
    if when <= first:
        return first
    return first + math.ceil((when - first) / per_step - 1e-9) * per_step


def _adapter_bytes(sim, task_id: str) -> float:
    return sim.workload.network.adapter_bytes_per_rank * sim.task_spec(task_id).lora.rank


def _setup_cost(sim, trainer) -> float:
    """A replica's first broadcasts set its communicator up (as the averaged model charges)."""
    model = sim.workload.trainer
    return model.broadcast_setup if trainer.broadcasts < model.warm_up_broadcasts else 0.0


class LockstepBroadcast:
    """Today's delta plane (see the module docstring)."""

    def __init__(self, sim, model: DeltaPlaneModel):
        if sim.workload.rollout.batching != "continuous":
            raise SpecError("workload.rollout.batching", "the delta plane models need continuous batching")
        self.sim, self.model = sim, model.validate()
        self.rank_free = {rank: 0.0 for rank in sim.rollout}
        """When each rollout rank leaves its last broadcast (installed): it joins the next at once if announced."""
        self.outstanding: dict[int, deque] = {}
        """Trainer group -> end times of its posted broadcasts, oldest first."""
        self.meter = PlaneMeter(sim.rollout)
        self._first = True

    def publish(self, task_id: str, version: int, at: float, trainer) -> float:
        """Posts one version at `at` (the leader's step end); returns the leader's blocked seconds."""
        sim, net = self.sim, self.sim.workload.network
        one_off = _setup_cost(sim, trainer)
        trainer.broadcasts += 1
        posted = at + sim.workload.trainer.publish_fixed + one_off
        own = self.outstanding.setdefault(trainer.index, deque())
        posted = self._room(own, posted)
        joins = {rank: self._join(rank, posted) for rank in sim.rollout}
        transfer = net.delta_latency + _adapter_bytes(sim, task_id) / net.delta_bandwidth
        rank_one_off = 0.0
        if self._first:  # the rollout ranks set the channel's communicator up with its first broadcast
            rank_one_off = sim.workload.trainer.broadcast_setup
            one_off += rank_one_off if self.model.max_in_flight == 0 else 0.0
            self._first = False
        end = max(joins.values()) + transfer + rank_one_off
        load = sim.workload.rollout.adapter_load
        for rank, join in joins.items():
            sim.queue.at(join, self._wait_in, rank, end)
            self.rank_free[rank] = end + load
            self.meter.rank_seconds[rank] += end - join + load - rank_one_off
        sim.queue.at(end, self._installed, task_id, version)
        own.append(end)
        leave = end if self.model.max_in_flight == 0 else posted
        self.meter.leader_blocked.append(leave - at - one_off)
        return leave - at

    def _room(self, own: deque, posted: float) -> float:
        """The leader waits (on the host) until fewer than max_in_flight of its broadcasts are outstanding."""
        while own and own[0] <= posted:
            own.popleft()
        bound = self.model.max_in_flight
        if bound and len(own) >= bound:
            posted = own[len(own) - bound]
            while own and own[0] <= posted:
                own.popleft()
        return posted

    def _join(self, rank: int, posted: float) -> float:
        if posted <= self.rank_free[rank]:  # still draining deltas: the announce is taken in the same loop turn
            return self.rank_free[rank]
        return next_step_boundary(self.sim.rollout[rank], posted)

    def _wait_in(self, rank: int, end: float) -> None:
        """The rank sits in the broadcast (its engine does not step) until the last member joins and the
        transfer ends."""
        rollout = self.sim.rollout[rank]
        now = self.sim.queue.now
        rollout._stall(end - (rollout.stall_until if rollout.stall_until > now else now), "load_delta")

    def wanted(self, rank: int, task_id: str, version: int) -> None:
        """Work on `rank` waits for a version: it comes with the broadcast every rank joins."""

    def _installed(self, task_id: str, version: int) -> None:
        for rollout in self.sim.rollout.values():
            rollout.new_version(task_id, version, 0.0)


class RelayTier:
    """The relay design (see the module docstring)."""

    def __init__(self, sim, model: DeltaPlaneModel):
        if sim.workload.rollout.batching != "continuous":
            raise SpecError("workload.rollout.batching", "the delta plane models need continuous batching")
        self.sim, self.model = sim, model.validate()
        ranks = sorted(sim.rollout)
        self.node_ranks = [ranks[i:i + model.ranks_per_node] for i in range(0, len(ranks), model.ranks_per_node)]
        """Relay i serves these rollout ranks (relays in breadth-first order of the tree: i's parent is
        (i - 1) // fanout)."""
        self.relay_of = {rank: i for i, node in enumerate(self.node_ranks) for rank in node}
        self.held: list[dict[str, int]] = [{} for _ in self.node_ranks]
        """Per relay: task -> newest version it holds whole."""
        self.wants: dict[int, dict[str, int]] = {rank: {} for rank in ranks}
        """On demand: rank -> task -> the version its waiting work asks for, not yet at its relay."""
        self.egress_free = [0.0] * len(self.node_ranks)
        self.leader_free: dict[int, float] = {}
        self.meter = PlaneMeter(sim.rollout)

    def publish(self, task_id: str, version: int, at: float, trainer) -> float:
        sim, model = self.sim, self.model
        setup = _setup_cost(sim, trainer)
        trainer.broadcasts += 1
        start = at + sim.workload.trainer.publish_fixed + setup
        start = max(start, self.leader_free.get(trainer.index, 0.0))
        size = _adapter_bytes(sim, task_id)
        pushed = start + model.relay_latency + size / model.push_bandwidth
        self.leader_free[trainer.index] = pushed
        first_chunk = start + model.relay_latency + size / model.relay_chunks / model.push_bandwidth
        for relay, arrival in enumerate(self._spread(size, first_chunk, pushed)):
            sim.queue.at(arrival, self._arrived, relay, task_id, version, size)
        self.meter.leader_blocked.append(pushed - at - setup)
        return pushed - at

    def _spread(self, size: float, first_chunk: float, complete: float) -> list[float]:
        """When each relay holds the whole version: a relay forwards each chunk to its children as it has it,
        its egress shared by them, and one relay forwards one version after another."""
        model, count = self.model, len(self.node_ranks)
        firsts, completes = [first_chunk] + [0.0] * (count - 1), [complete] + [0.0] * (count - 1)
        for parent in range(count):
            children = range(parent * model.relay_fanout + 1, min(count, (parent + 1) * model.relay_fanout + 1))
            if not children:
                continue
            share = len(children) / model.relay_bandwidth
            send = max(firsts[parent], self.egress_free[parent])
            self.egress_free[parent] = send + size * share
            for child in children:
                firsts[child] = send + model.relay_latency + size / model.relay_chunks * share
                completes[child] = max(send + model.relay_latency + size * share,
                                       completes[parent] + model.relay_latency + size / model.relay_chunks * share)
        return completes

    def _arrived(self, relay: int, task_id: str, version: int, size: float) -> None:
        held = self.held[relay]
        held[task_id] = max(version, held.get(task_id, -1))
        eager = self.model.relay_pull == "eager"
        for rank in self.node_ranks[relay]:
            if eager or self.wants[rank].get(task_id, version + 1) <= version:
                self.wants[rank].pop(task_id, None)
                self._pull_soon(rank, task_id, size)

    def wanted(self, rank: int, task_id: str, version: int) -> None:
        """Work on `rank` waits for `version` of the task: on demand, pull it now if the node's relay has it,
        else when it arrives there (eager pulls come anyway)."""
        if self.model.relay_pull == "eager":
            return
        if self.held[self.relay_of[rank]].get(task_id, -1) >= version:
            self._pull_soon(rank, task_id, _adapter_bytes(self.sim, task_id))
        else:
            wants = self.wants[rank]
            wants[task_id] = min(version, wants.get(task_id, version))

    def _pull_soon(self, rank: int, task_id: str, size: float) -> None:
        rollout = self.sim.rollout[rank]
        self.sim.queue.at(next_step_boundary(rollout, self.sim.queue.now), self._pull, rank, task_id, size)

    def _pull(self, rank: int, task_id: str, size: float) -> None:
        """Between two engine steps the rank copies the newest version its node's relay holds and installs it;
        one it already holds makes the pull moot."""
        rollout = self.sim.rollout[rank]
        version = self.held[self.relay_of[rank]][task_id]
        if rollout.versions.get(task_id, -1) >= version:
            return
        pull = size / self.model.pull_bandwidth
        self.meter.rank_seconds[rank] += pull + self.sim.workload.rollout.adapter_load
        rollout.new_version(task_id, version, pull)


def delta_plane(sim, model: DeltaPlaneModel):
    """The plane object `model.plane` names, bound to `sim`."""
    return {"broadcast": LockstepBroadcast, "relay": RelayTier}[model.validate().plane](sim, model)
