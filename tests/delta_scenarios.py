"""Self-checking MPI program: the LoRA delta broadcast (runtime/delta.py) from world rank 0 (the trainer
leader) to every other rank (rollout ranks), each member on the device MODE gives it.

    mpirun -np N python tests/delta_scenarios.py MODE
    MODE: cpu (every member on the CPU) | cuda (member i on GPU i) | mixed (leader on GPU 0, the rest on the
          CPU) | same_gpu (every member on GPU 0, as under layout.share_gpus)

Rank 0 prints one JSON line: the backend the channel chose, whether every rollout rank received every tensor
bit for bit, and each member's broadcast-buffer device.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's marlaas_hpc

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

from marlaas_hpc.runtime.delta import DeltaChannel  # noqa: E402
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


if __name__ == "__main__":
    main()
