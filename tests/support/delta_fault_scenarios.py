"""Delta channels losing a member, with NCCL's behaviour (tests/support/nccl_standin.py): a collective that waits for a
missing member never completes, abort() ends it, and a watchdog ends any process whose collective stays pending
past its timeout. Run by tests/test_delta_faults.py:

    mpirun -np 3 python tests/support/delta_fault_scenarios.py lost_rollout     leader 0, rollout ranks 1 and 2; 2 is lost
    mpirun -np 3 python tests/support/delta_fault_scenarios.py drain            the same, 2 drains (leaves after its last poll)
    mpirun -np 4 python tests/support/delta_fault_scenarios.py lost_leader      leaders 0, 1, rollout 2, 3; leader 1 is lost
    mpirun -np 4 python tests/support/delta_fault_scenarios.py several_leaders  leaders 0, 1, rollout 2, 3; rollout 3 is lost
    mpirun -np 3 python tests/support/delta_fault_scenarios.py setup_deadline   2 is lost while the leader remakes with it
    mpirun -np 3 python tests/support/delta_fault_scenarios.py relay_deadline   relay tier 1 -> 2; 2 is lost as it re-forms

A lost rank stops taking part (NCCL cannot tell a dead member from one that never comes); the survivors do what the
job does on rank 0's RanksChanged (runtime/trainer_rank.py: `remake`; runtime/rollout_rank.py: the fan-in switches
on the new channel's address, or drops a lost leader), then check that the next version arrives and that the
watchdog's timeout passes without ending them. Rank 0 prints one JSON line.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's marlaas_hpc

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

from nccl_standin import patch_delta_groups  # noqa: E402
from marlaas_hpc.runtime.delta.broadcast import DeltaChannel, DeltaOrder  # noqa: E402
from marlaas_hpc.runtime.delta.fanin import DeltaFanIn  # noqa: E402
from marlaas_hpc.runtime.messages import TAG_DELTA, DeltaAnnounce  # noqa: E402
from marlaas_hpc.tasks.spec import LoraSpec  # noqa: E402

WATCHDOG_S = 4.0
"""The stand-in's watchdog: a collective pending this long ends its process."""
SETUP_S = 5.0
"""The channels' set-up deadline."""
LORA = LoraSpec(rank=4)


def delta(version: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(version)
    return {"a": torch.randn(4, 64, generator=gen), "b": torch.randn(256, 4, generator=gen)}


def channel(comm, leader: int, rollout: list[int], order=None) -> DeltaChannel:
    return DeltaChannel(comm, leader, rollout, tolerant=True, order=order, setup_timeout_s=SETUP_S)


def fanin(comm, leaders: list[int], rollout: list[int]) -> DeltaFanIn:
    return DeltaFanIn(comm, [channel(comm, leader, rollout) for leader in leaders], tolerant=True,
                      setup_timeout_s=SETUP_S)


def receive_until(fan: DeltaFanIn, wanted: set[tuple[str, int]], timeout_s: float = 60.0) -> bool:
    """Polls as a rollout rank does between engine steps until every (task, version) wanted arrived intact."""
    deadline, ok = time.monotonic() + timeout_s, True
    while wanted and time.monotonic() < deadline:
        for announce, receive in fan.poll():
            key = (announce.task_id, announce.version)
            if key in wanted:
                wanted.discard(key)
                tensors, expected = receive(), delta(announce.version)
                ok &= all(torch.equal(tensors[name], expected[name]) for name in expected)
        time.sleep(0.002)
    return ok and not wanted


def wait_posted(fan: DeltaFanIn, wanted: set[tuple[str, int]]) -> None:
    """Polls until every (task, version) wanted has been posted here: still pending, or already complete (gloo
    completes a broadcast on a member once the root has sent it its part, whoever else is missing; NCCL may not:
    waiting for it to stay pending raced with its completion)."""
    while wanted:
        wanted -= {(announce.task_id, announce.version) for announce, _ in fan.poll()}
        wanted -= {(p.announce.task_id, p.announce.version) for queue in fan.pending.values() for p in queue}
        time.sleep(0.002)


def outlast_watchdog(since: float, fan: DeltaFanIn | None = None) -> None:
    """Waits (polling, as a live rank would) until the watchdog's timeout has passed since `since`."""
    while time.monotonic() < since + WATCHDOG_S + 1.5:
        if fan is not None:
            list(fan.poll())
        time.sleep(0.01)


def one_leader(mode: str) -> dict:
    """Leader 0, rollout ranks 1 and 2; rank 2 is lost (or drains) after version 1."""
    comm = MPI.COMM_WORLD
    rank, result = comm.Get_rank(), {}
    if rank == 0:
        ch = channel(comm, 0, [1, 2])
        ch.send("t", 1, delta(1), LORA)
        comm.Barrier()
        pending_since = time.monotonic()
        ch.send("t", 2, delta(2), LORA)  # rank 2 never joins it
        comm.Barrier()  # rank 1 has posted it
        ch.remake([1], 1)  # rank 0's RanksChanged: rank 2 lost (or left)
        ch.send("t", 3, delta(3), LORA)
        outlast_watchdog(pending_since)
        ch.flush()
        result = {"epoch": ch.epoch, "broken": ch.broken}
    elif rank == 1:
        fan = fanin(comm, [0], [1, 2])
        ok = receive_until(fan, {("t", 1)})
        comm.Barrier()
        wait_posted(fan, {("t", 2)})  # version 2's broadcast posted here (the leader's waits for rank 2)
        pending_since = time.monotonic()
        comm.Barrier()
        ok &= receive_until(fan, {("t", 3)})
        outlast_watchdog(pending_since, fan)
        result = {"received": ok}
    else:
        fan = fanin(comm, [0], [1, 2])
        receive_until(fan, {("t", 1)})
        if mode == "drain":
            fan.close()  # its last poll was before version 2 was announced
        comm.Barrier()
        comm.Barrier()
    return result


def lost_leader() -> dict:
    """Leaders 0 and 1, rollout ranks 2 and 3; leader 1 is lost after announcing version 2 (its broadcast never
    comes): the rollout ranks drop it and go on with leader 0's versions."""
    comm = MPI.COMM_WORLD
    rank, result = comm.Get_rank(), {}
    if rank in (0, 1):
        order = DeltaOrder(comm, [0, 1])
        ch = channel(comm, rank, [2, 3], order)
        if rank == 1:
            MPI.COMM_WORLD.recv(source=0, tag=99)
        ch.send(f"t{rank}", 1, delta(1), LORA)
        if rank == 0:
            comm.send("sent", dest=1, tag=99)
        comm.Barrier()
        if rank == 1:  # announces version 2, then dies before its broadcast
            names = sorted(delta(2))
            announce = DeltaAnnounce("t1", 2, names, [tuple(delta(2)[n].shape) for n in names], LORA,
                                     order.next(0), 0, None)
            for target in (2, 3):
                comm.send(announce, dest=target, tag=TAG_DELTA)
        comm.Barrier()  # the rollout ranks have posted leader 1's version 2
        comm.Barrier()  # and dropped leader 1
        if rank == 0:
            ch.send("t0", 3, delta(3), LORA)
            outlast_watchdog(time.monotonic())
            ch.flush()
            result = {"epoch": ch.epoch}
    else:
        fan = fanin(comm, [0, 1], [2, 3])
        ok = receive_until(fan, {("t0", 1), ("t1", 1)})
        comm.Barrier()
        while not fan.pending[1]:
            list(fan.poll())
            time.sleep(0.002)
        pending_since = time.monotonic()
        comm.Barrier()
        fan.drop_leader(1)  # rank 0's RanksChanged: leader 1's trainer group lost
        comm.Barrier()
        ok &= receive_until(fan, {("t0", 3)})
        outlast_watchdog(pending_since, fan)
        result = {"received": ok}
    return result


def several_leaders() -> dict:
    """Leaders 0 and 1, rollout ranks 2 and 3; rank 3 is lost after version 1: both leaders remake their channels
    over rank 2, which switches to both in the leaders' order."""
    comm = MPI.COMM_WORLD
    rank, result = comm.Get_rank(), {}
    if rank in (0, 1):
        order = DeltaOrder(comm, [0, 1])
        ch = channel(comm, rank, [2, 3], order)
        ch.send(f"t{rank}", 1, delta(1), LORA)
        comm.Barrier()
        pending_since = time.monotonic()
        ch.send(f"t{rank}", 2, delta(2), LORA)  # rank 3 never joins them
        comm.Barrier()
        ch.remake([2], 1)
        ch.send(f"t{rank}", 3, delta(3), LORA)
        outlast_watchdog(pending_since)
        ch.flush()
        result = {"epoch": ch.epoch, "broken": ch.broken}
    elif rank == 2:
        fan = fanin(comm, [0, 1], [2, 3])
        ok = receive_until(fan, {("t0", 1), ("t1", 1)})
        comm.Barrier()
        wait_posted(fan, {("t0", 2), ("t1", 2)})
        pending_since = time.monotonic()
        comm.Barrier()
        ok &= receive_until(fan, {("t0", 3), ("t1", 3)})
        outlast_watchdog(pending_since, fan)
        result = {"received": ok, "epochs": [fan.epoch(0), fan.epoch(1)]}
    else:
        fan = fanin(comm, [0, 1], [2, 3])
        receive_until(fan, {("t0", 1), ("t1", 1)})
        comm.Barrier()
        comm.Barrier()
    return result


def setup_deadline() -> dict:
    """Leader 0, rollout ranks 1 and 2; rank 2 is lost just as the leader remakes its channel with it (rank 0 had
    not seen the loss yet): the set-up fails at its deadline on the leader and on rank 1, the leader counts what it
    could not send, and the next epoch (rank 0's answer to DeltaPlaneFailed) carries the newest version."""
    comm = MPI.COMM_WORLD
    rank, result = comm.Get_rank(), {}
    if rank == 0:
        ch = channel(comm, 0, [1, 2])
        ch.send("t", 1, delta(1), LORA)
        comm.Barrier()
        t0 = time.monotonic()
        ch.remake([1, 2], 1)
        setup_s, broken = time.monotonic() - t0, ch.broken
        ch.send("t", 2, delta(2), LORA)  # no channel: counted, not sent
        ch.remake([1], 2)
        ch.send("t", 3, delta(3), LORA)
        ch.flush()
        result = {"broken": broken is not None, "setup_s": round(setup_s, 1), "unsent": ch.unsent,
                  "epoch": ch.epoch}
    elif rank == 1:
        fan = fanin(comm, [0], [1, 2])
        ok = receive_until(fan, {("t", 1)})
        comm.Barrier()
        ok &= receive_until(fan, {("t", 3)})
        result = {"received": ok}
    else:
        fan = fanin(comm, [0], [1, 2])
        receive_until(fan, {("t", 1)})
        comm.Barrier()
    return result


def relay_deadline() -> dict:
    """delta.transport relay: leader 0 pushes into a chain of relays on rollout ranks 1 -> 2; rank 2 is lost as the
    tier re-forms with it: rank 1's link to it fails at the set-up deadline (not the store's 600 s), rank 1 has no
    relay until the next tier, which carries the newest version."""
    from marlaas_hpc.runtime.delta.relay_plane import RelayFeed, RelayPublisher, job_relay_layout, join_relay_tier

    comm = MPI.COMM_WORLD
    rank, result = comm.Get_rank(), {}
    tier = join_relay_tier(comm, job_relay_layout([1, 2], [0]))
    timeouts = {"timeout_s": 60.0, "setup_timeout_s": SETUP_S}
    if rank == 0:
        publisher = RelayPublisher(tier, 0, comm=comm, tolerant=True, **timeouts)
        publisher.send("t", 1, delta(1), LORA)
        comm.Barrier()
        publisher.remake([1, 2], 1)  # its own link (to relay 1) comes up: rank 1 is there
        comm.Barrier()  # rank 1 gave its tier of epoch 1 up
        publisher.remake([1], 2)
        publisher.send("t", 3, delta(3), LORA)
        publisher.flush()
        result = {"broken": publisher.broken, "epoch": publisher.epoch}
    elif rank == 1:
        feed = RelayFeed(tier, 1, [0], comm=comm, **timeouts)
        ok = _feed_until(feed, 1)
        comm.Barrier()
        t0 = time.monotonic()
        while feed.epoch < 1:
            list(feed.poll())
            time.sleep(0.002)
        reform_s, relay_lost = time.monotonic() - t0, feed.relay is None
        comm.Barrier()
        ok &= _feed_until(feed, 3)
        result = {"received": ok, "reform_s": round(reform_s, 1), "no_relay_after_failed_reform": relay_lost}
    else:
        feed = RelayFeed(tier, 2, [0], comm=comm, **timeouts)
        _feed_until(feed, 1)
        comm.Barrier()
        comm.Barrier()
    return result


def _feed_until(feed, version: int, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for announce, receive in feed.poll():
            if announce.version == version:
                expected = delta(version)
                return all(torch.equal(receive()[name], expected[name]) for name in expected)
        time.sleep(0.002)
    return False


def main() -> None:
    mode = sys.argv[1]
    patch_delta_groups(WATCHDOG_S)
    comm = MPI.COMM_WORLD
    if mode in ("lost_rollout", "drain"):
        mine = one_leader(mode)
    else:
        mine = {"lost_leader": lost_leader, "several_leaders": several_leaders, "setup_deadline": setup_deadline,
                "relay_deadline": relay_deadline}[mode]()
    results = comm.gather(mine, root=0)
    comm.Barrier()
    if comm.Get_rank() == 0:
        print(json.dumps({str(rank): result for rank, result in enumerate(results)}), flush=True)
    MPI.Finalize()
    os._exit(0)  # as a job's rank ends (runtime/process.py end_rank): abandoned gloo work would hold the exit


if __name__ == "__main__":
    main()
