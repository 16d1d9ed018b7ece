"""Self-checking MPI program: the LoRA delta broadcast (runtime/delta.py) from world rank 0 (the trainer
leader) to every other rank (rollout ranks), each member on the device MODE gives it.

    mpirun -np N python tests/support/delta_scenarios.py MODE
    MODE: cpu (every member on the CPU) | cuda (member i on GPU i) | mixed (leader on GPU 0, the rest on the
          CPU) | same_gpu (every member on GPU 0, as under layout.share_gpus)

Rank 0 prints one JSON line: the backend the channel chose, whether every rollout rank received every tensor
bit for bit, and each member's broadcast-buffer device.

    mpirun -np 4 python tests/support/delta_scenarios.py shuffled

Two trainer leaders (ranks 0, 1) and two rollout ranks (2, 3), the announces reaching the rollout ranks in
different orders: leader 0's announce to rank 3 and leader 1's to rank 2 are held back (`HeldBack`) until each
rollout rank has taken the other one. Rank 0 prints the order in which each rollout rank posted the leaders'
broadcasts, and whether every version arrived bit for bit.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's marlaas_hpc

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

from marlaas_hpc.runtime.comm import recv_wait  # noqa: E402
from marlaas_hpc.runtime.delta.broadcast import DeltaChannel, DeltaOrder  # noqa: E402
from marlaas_hpc.runtime.delta.fanin import DeltaFanIn  # noqa: E402
from marlaas_hpc.runtime.messages import TAG_DELTA  # noqa: E402
from marlaas_hpc.tasks.spec import LoraSpec  # noqa: E402

DEVICES = {"cpu": lambda rank: "cpu", "cuda": lambda rank: f"cuda:{rank}",
           "mixed": lambda rank: "cuda:0" if rank == 0 else "cpu", "same_gpu": lambda rank: "cuda:0"}


def delta(version: int) -> dict[str, torch.Tensor]:
    """The adapter tensors of one version (every rank can rebuild them to check what it received)."""
    gen = torch.Generator().manual_seed(version)
    return {"layers.0.q_proj.lora_A.weight": torch.randn(4, 64, generator=gen),
            "layers.0.q_proj.lora_B.weight": torch.randn(128, 4, generator=gen),
            "layers.1.down_proj.lora_A.weight": torch.randn(4, 96, generator=gen),
            # 4 MB: more than a socket buffer holds, so a send that waited for the receivers would hang here
            "layers.2.up_proj.lora_B.weight": torch.randn(2 ** 18, 4, generator=gen)}


def main() -> None:
    comm = MPI.COMM_WORLD
    rank, mode = comm.Get_rank(), sys.argv[1]
    device = torch.device(DEVICES[mode](rank))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    channel = DeltaChannel(comm, 0, list(range(1, comm.Get_size())), device=device)
    ok = True
    if rank == 0:  # send does not wait for the rollout ranks: they join only after all three were posted
        for version in (1, 2, 3):
            channel.send("task", version, {name: t.to(device) for name, t in delta(version).items()}, LoraSpec(rank=4))
        comm.Barrier()
        channel.flush()
        ok &= not channel.in_flight
    else:
        comm.Barrier()
        for version in (1, 2, 3):
            tensors = delta(version)
            announce = comm.recv(source=0, tag=TAG_DELTA)
            got = channel.receive(announce)
            ok &= announce.version == version and set(got) == set(tensors)
            ok &= all(torch.equal(got[name], tensors[name]) for name in tensors)
    ok = comm.allreduce(bool(ok), op=MPI.LAND)
    buffers = comm.gather(str(channel.device), root=0)
    if rank == 0:
        print(json.dumps({"backend": channel.backend, "ok": ok, "buffer_devices": buffers}), flush=True)


class HeldBack:
    """A leader's communicator whose announce to one rollout rank leaves only at `release()`: the different
    arrival orders that ranks on different nodes see, made certain on one machine. Everything else is the real
    communicator's."""

    def __init__(self, comm, rank: int):
        self.comm, self.rank, self.held = comm, rank, []

    def __getattr__(self, name):
        return getattr(self.comm, name)

    def isend(self, message, dest: int, tag: int):
        if dest != self.rank or tag != TAG_DELTA:
            return self.comm.isend(message, dest=dest, tag=tag)
        request = _Later(lambda: self.comm.isend(message, dest=dest, tag=tag))
        self.held.append(request)
        return request

    def release(self) -> None:
        for request in self.held:
            request.send()


class _Later:
    def __init__(self, send):
        self.send_now, self.request = send, None

    def send(self) -> None:
        self.request = self.send_now()

    def wait(self):
        return self.request.wait()

    def Test(self) -> bool:  # noqa: N802 (MPI's name): not sent yet is not done
        return self.request is not None and self.request.Test()


class Recorded:
    """A rollout rank's real process group of one channel, noting the leader of each broadcast it posts."""

    def __init__(self, group, leader: int, posted: list):
        self.group, self.leader, self.posted = group, leader, posted

    def broadcast(self, tensor, root):
        self.posted.append(self.leader)
        return self.group.broadcast(tensor, root)


LEADERS, ROLLOUT = [0, 1], [2, 3]
HELD = {0: 3, 1: 2}
"""Leader -> the rollout rank its announce reaches last."""


def leader_channel(comm, rank: int) -> DeltaChannel:
    return DeltaChannel(comm, rank, ROLLOUT, order=DeltaOrder(comm, LEADERS))


def shuffled() -> None:
    comm = MPI.COMM_WORLD
    rank, ok, posted = comm.Get_rank(), True, []
    if rank in LEADERS:
        held = HeldBack(comm, HELD[rank])
        channel = leader_channel(held, rank)
        if rank == 1:  # leader 1 announces after leader 0: its broadcast comes second in the job's order
            recv_wait(comm, 99, source=0)
        channel.send(f"t{rank}", 1, delta(10 + rank), LoraSpec(rank=4))
        if rank == 0:
            comm.send("sent", dest=1, tag=99)
        comm.Barrier()  # the rollout ranks take what reached them
        comm.Barrier()
        held.release()
        channel.flush()
    else:
        fanin = DeltaFanIn(comm, [DeltaChannel(comm, leader, ROLLOUT) for leader in LEADERS])
        for leader, channel in fanin.channels.items():
            channel.process_group = Recorded(channel.process_group, leader, posted)
        first = next(leader for leader in LEADERS if HELD[leader] != rank)
        comm.Barrier()
        _until_arrived(comm, first)
        got = list(fanin.poll())
        comm.Barrier()
        while len(got) < len(LEADERS):
            got += list(fanin.poll())
        for announce, receive in got:
            tensors, expected = receive(), delta(10 + int(announce.task_id[1:]))
            ok &= all(torch.equal(tensors[name], expected[name]) for name in expected)
    ok = comm.allreduce(bool(ok), op=MPI.LAND)
    orders = comm.gather(posted, root=0)
    if rank == 0:
        print(json.dumps({"ok": ok, "posted": {r: orders[r] for r in ROLLOUT}}), flush=True)


def _until_arrived(comm, source: int) -> None:
    """Until the announce of `source` can be received (a poll then takes it, and nothing held back)."""
    while not comm.Iprobe(source=source, tag=TAG_DELTA):
        time.sleep(0.002)


if __name__ == "__main__":
    shuffled() if sys.argv[1] == "shuffled" else main()
