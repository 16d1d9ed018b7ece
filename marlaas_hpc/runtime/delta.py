"""LoRA delta broadcast: trainer leader -> every rollout rank, over a torch.distributed group of its own.

The group {trainer leader} ∪ {rollout ranks} is built straight from a TCPStore, not from the default group:
on rollout ranks an in-process vLLM engine owns the default group (world size 1), and on trainer ranks the
default group is megatron's (the trainer ranks). gloo on CPU; NCCL on GPU (FACTS.md: vLLM section).
"""
from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from marlaas_hpc.runtime.messages import TAG_DELTA, DeltaAnnounce


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


class DeltaGroup:
    """Member 0 is the trainer leader (source of every broadcast); members 1.. are rollout ranks."""

    def __init__(self, comm, leader: int, rollout_ranks: list[int], host: str | None = None,
                 timeout_s: float = 600.0):
        self.comm, self.leader, self.rollout_ranks = comm, leader, list(rollout_ranks)
        members = [leader] + self.rollout_ranks
        me = comm.Get_rank()
        self.member = members.index(me)
        self.size = len(members)
        if me == leader:
            address = (host or socket.gethostname(), free_port())
            for rank in self.rollout_ranks:
                comm.send(address, dest=rank, tag=TAG_DELTA)
        else:
            address = comm.recv(source=leader, tag=TAG_DELTA)
        store = dist.TCPStore(address[0], address[1], self.size, is_master=self.member == 0,
                              timeout=timedelta(seconds=timeout_s))
        self.use_cuda = torch.cuda.is_available()
        if self.use_cuda:  # the GPU path: NCCL outside the default group
            self.device = torch.device("cuda", torch.cuda.current_device())
            self.group = dist.ProcessGroupNCCL(store, self.member, self.size)
        else:
            self.device = torch.device("cpu")
            self.group = dist.ProcessGroupGloo(store, self.member, self.size)

    def send(self, task_id: str, version: int, tensors: dict[str, torch.Tensor], lora) -> None:
        """Leader: announce over MPI, then broadcast one flat buffer of every tensor."""
        names = sorted(tensors)
        announce = DeltaAnnounce(task_id, version, names, [tuple(tensors[n].shape) for n in names], lora)
        requests = [self.comm.isend(announce, dest=rank, tag=TAG_DELTA) for rank in self.rollout_ranks]
        flat = torch.cat([tensors[n].detach().reshape(-1).float() for n in names]).to(self.device)
        self.group.broadcast(flat, 0).wait()
        for request in requests:
            request.wait()

    def receive(self, announce: DeltaAnnounce) -> dict[str, torch.Tensor]:
        """Rollout rank: join the broadcast that follows `announce` and unflatten it."""
        total = sum(int(torch.Size(s).numel()) for s in announce.shapes)
        flat = torch.empty(total, dtype=torch.float32, device=self.device)
        self.group.broadcast(flat, 0).wait()
        flat = flat.cpu()
        out, offset = {}, 0
        for name, shape in zip(announce.names, announce.shapes):
            n = int(torch.Size(shape).numel())
            out[name] = flat[offset: offset + n].view(shape).clone()
            offset += n
        return out
