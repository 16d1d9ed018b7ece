"""Self-checking MPI program: the adapter relay tier (runtime/relay.py). World rank 0 is the trainer leader,
ranks 1, 2, 3 a chain of relays (fan-out 1), rank 4 (if any) a rollout rank, client of the LAST relay (rank 3),
so every byte it pulls went through the whole chain.

    mpirun -np 5 python tests/support/relay_scenarios.py bytes
        The leader sends v1, v2, v3 of a tiny-model adapter both by today's delta broadcast (DeltaChannel, members
        0 and 4) and by relay pushes. Rank 4 pins v1 at its relay, then takes v1..v3 from the broadcast and pulls
        v3 and v1 (pinned, though superseded); unpinned, v1 is gone. Prints whether every pulled tensor equals the
        broadcast one bit for bit, whether both v3s give the same logprobs, and what the relay held at each point.

    mpirun -np 4 python tests/support/relay_scenarios.py chain
        The leader pushes two versions of a 12 MB adapter (several chunks) while relay 3 has not started reading:
        push must return anyway. Then relay 3 starts; prints whether every relay holds v2 (v1 evicted) bit for bit.

    mpirun -np 5 python tests/support/relay_scenarios.py timing SHAPE     (SHAPE: tiny | qwen3-0.6b-r32)
        Seconds: the leader's push, until the last relay holds the version, and rank 4's pull (median of 5).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's marlaas_hpc

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

from marlaas_hpc.runtime.delta.broadcast import DeltaChannel  # noqa: E402
from marlaas_hpc.runtime.messages import TAG_DELTA  # noqa: E402
from marlaas_hpc.runtime.delta.relay import Relay, RelayClient, RelayPusher, RelayTier, RelayTierLayout  # noqa: E402
from marlaas_hpc.tasks.spec import LoraSpec  # noqa: E402

LEADER, RELAYS, CLIENT = 0, [1, 2, 3], 4
MLP = ("gate_proj", "up_proj", "down_proj")
MODULES = {  # layers, LoRA rank, (in, out) of each target: the tiny model (marlaas_hpc/tiny_weights) and Qwen3-0.6B
    "tiny": (4, 8, {"q_proj": (128, 128), "k_proj": (128, 64), "v_proj": (128, 64), "o_proj": (128, 128),
                    "gate_proj": (128, 384), "up_proj": (128, 384), "down_proj": (384, 128)}),
    "qwen3-0.6b-r32": (28, 32, {"q_proj": (1024, 2048), "k_proj": (1024, 1024), "v_proj": (1024, 1024),
                                "o_proj": (2048, 1024), "gate_proj": (1024, 3072), "up_proj": (1024, 3072),
                                "down_proj": (3072, 1024)}),
}


def adapter(version: int, shape: str = "test") -> dict[str, torch.Tensor]:
    """The adapter tensors of one version (every rank can rebuild them to check what it received)."""
    gen = torch.Generator().manual_seed(version)
    if shape == "test":  # 12 MB: several 4 MiB chunks, and more than a socket buffer holds
        return {"layers.0.q_proj.lora_A.weight": torch.randn(4, 64, generator=gen),
                "layers.0.q_proj.lora_B.weight": torch.randn(128, 4, generator=gen),
                "layers.2.up_proj.lora_B.weight": torch.randn(3 * 2 ** 18, 4, generator=gen)}
    layers, rank, modules = MODULES[shape]
    out = {}
    for layer in range(layers):
        for name, (fan_in, fan_out) in modules.items():
            prefix = f"base_model.model.model.layers.{layer}.{'mlp' if name in MLP else 'self_attn'}"
            out[f"{prefix}.{name}.lora_A.weight"] = 0.1 * torch.randn(rank, fan_in, generator=gen)
            out[f"{prefix}.{name}.lora_B.weight"] = 0.1 * torch.randn(fan_out, rank, generator=gen)
    return out


def same(got: dict, want: dict) -> bool:
    return set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)


def tier(comm, clients: bool, chunk_elems: int = 1 << 20) -> RelayTier:
    layout = RelayTierLayout(leaders=[LEADER], relays=RELAYS, clients={CLIENT: RELAYS[-1]} if clients else {},
                             chunk_elems=chunk_elems)
    return RelayTier(comm, layout)


def pull_until(client: RelayClient, task_id: str, version: int, pin: bool = False):
    """Pulls until the relay holds `version` (a rollout rank would try again at its next step)."""
    while True:
        found = client.pull(task_id, version, pin=pin)
        if found is not None:
            return found
        time.sleep(0.01)


def bytes_scenario(comm) -> None:
    rank = comm.Get_rank()
    relays = tier(comm, clients=True, chunk_elems=50_000)  # the tiny adapter (77,824 floats) in 2 chunks
    channel = DeltaChannel(comm, LEADER, [CLIENT]) if rank in (LEADER, CLIENT) else None
    relay = Relay(relays, rank).start() if rank in RELAYS else None
    result, lora = {"ok": True}, LoraSpec(rank=8)
    if rank == LEADER:
        pusher = RelayPusher(relays, LEADER)
        pusher.push("task", 1, adapter(1, "tiny"), lora)
        channel.send("task", 1, adapter(1, "tiny"), lora)
        comm.Barrier()  # rank 4 has pinned v1
        for version in (2, 3):
            pusher.push("task", version, adapter(version, "tiny"), lora)
            channel.send("task", version, adapter(version, "tiny"), lora)
        channel.flush()
        comm.Barrier()
        pusher.close()
    elif rank == CLIENT:
        client = RelayClient(relays, rank)
        pinned = pull_until(client, "task", 1, pin=True)
        comm.Barrier()
        broadcast = {}
        for version in (1, 2, 3):
            announce = comm.recv(source=LEADER, tag=TAG_DELTA)
            broadcast[announce.version] = channel.receive(announce)
        newest = pull_until(client, "task", 3)
        result["ok"] &= same(pinned[1], broadcast[1]) and same(newest[1], broadcast[3])
        result["ok"] &= newest[0].names == announce.names and newest[0].shapes == announce.shapes
        again = client.pull("task", 1)  # superseded twice, still pinned
        result["ok"] &= again is not None and same(again[1], broadcast[1])
        result["pinned_v1_held_after_v3"] = again is not None
        client.unpin("task", 1)
        result["v1_after_unpin"] = client.pull("task", 1) is not None
        result["v2_after_v3"] = client.pull("task", 2) is not None
        result["same_logprobs"] = same_logprobs(broadcast[3], newest[1], lora)
        comm.Barrier()
        client.close()
    else:
        comm.Barrier()
        comm.Barrier()
    if relay is not None:
        relay.join()
    report(comm, result, relay)


def same_logprobs(broadcast: dict, pulled: dict, lora) -> bool:
    """Installs both as two tasks of one engine (the tiny model, in-memory adapters as RolloutRank installs
    them) and compares greedy completions and their logprobs."""
    from marlaas_hpc.model import TextCodec
    from marlaas_hpc.rollout import AdapterRef, GenerationRequest, make_engine
    from marlaas_hpc.tiny_model import ensure_tiny_model

    path = ensure_tiny_model()
    engine, codec = make_engine("hf", path, seed=0), TextCodec.from_pretrained(path)
    requests = []
    for task_id, tensors in (("broadcast", broadcast), ("relay", pulled)):
        engine.add_adapter(AdapterRef(task_id, 3, tensors=tensors, lora=lora))
        requests.append(GenerationRequest(task_id, task_id, 3, codec.encode_prompt("12+7="), temperature=0.0,
                                          max_new_tokens=8, seed=1))
    by_task = {gen.task_id: gen for gen in engine.generate(requests)}
    base = engine.generate([GenerationRequest("base", "base", None, codec.encode_prompt("12+7="), temperature=0.0,
                                              max_new_tokens=8, seed=1)])[0]
    one, two = by_task["broadcast"], by_task["relay"]
    adapter_matters = base.logprobs != one.logprobs  # else equal logprobs would say nothing of the bytes
    return adapter_matters and one.completion_ids == two.completion_ids and one.logprobs == two.logprobs


def chain_scenario(comm) -> None:
    rank = comm.Get_rank()
    relays = tier(comm, clients=False)
    relay = Relay(relays, rank) if rank in RELAYS else None
    result = {"ok": True}
    if rank == LEADER:
        pusher = RelayPusher(relays, LEADER)
        for version in (1, 2):
            pusher.push("task", version, adapter(version), LoraSpec(rank=4))
        comm.send("returned", dest=RELAYS[-1], tag=TAG_DELTA)  # only now does the last relay start reading
        result["returned_before_last_relay_read"] = True
        pusher.close()
    elif rank == RELAYS[-1]:
        comm.recv(source=LEADER, tag=TAG_DELTA)
        result["last_relay_held_when_leader_returned"] = relay.store.held("task")
        relay.start()
    else:
        relay.start()
    if relay is not None:
        relay.join()
        held = relay.store.held("task")
        result["ok"] &= held == [2] and same(_pulled(relay, 2), adapter(2))
    report(comm, result, relay)


def _pulled(relay: Relay, version: int) -> dict:
    from marlaas_hpc.runtime.delta.plane import unflatten
    announce, flat = relay.store.get("task", version)
    return unflatten(announce, flat)


def timing_scenario(comm, shape: str) -> None:
    rank = comm.Get_rank()
    relays = tier(comm, clients=True)
    relay = Relay(relays, rank).start() if rank in RELAYS else None
    tensors, result, times = adapter(0, shape), {"ok": True}, []
    result["mbytes"] = round(sum(t.numel() for t in tensors.values()) * 4 / 1e6, 1)
    for version in range(1, 6):
        comm.Barrier()
        start = time.time()
        if rank == LEADER:
            pusher = RelayPusher(relays, LEADER) if version == 1 else pusher
            pusher.push("task", version, tensors, LoraSpec(rank=32))
            pushed = time.time() - start
        if rank == RELAYS[-1]:
            while relay.store.newest("task") != version:
                time.sleep(0.0005)
            held = time.time()
        if rank == CLIENT:
            client = RelayClient(relays, rank) if version == 1 else client
            comm.recv(source=RELAYS[-1], tag=TAG_DELTA)
            begin = time.time()
            found = client.pull("task", version)
            pulled = time.time() - begin
            result["ok"] &= same(found[1], tensors)
        if rank == RELAYS[-1]:
            comm.send(None, dest=CLIENT, tag=TAG_DELTA)
        starts = comm.gather(start, root=0)
        row = comm.gather({LEADER: lambda: pushed, RELAYS[-1]: lambda: held, CLIENT: lambda: pulled}.get(
            rank, lambda: None)(), root=0)
        if rank == 0:
            times.append((row[LEADER], row[RELAYS[-1]] - starts[LEADER], row[CLIENT]))
    comm.Barrier()
    if rank == LEADER:
        pusher.close()
    if rank == CLIENT:
        client.close()
    if relay is not None:
        relay.join()
    if rank == 0:
        columns = list(zip(*times))
        result.update({name: round(sorted(col)[len(col) // 2], 4)
                       for name, col in zip(("push_s", "last_relay_holds_s", "pull_s"), columns)})
    report(comm, result, relay)


def report(comm, result: dict, relay) -> None:
    ok = comm.allreduce(bool(result.pop("ok")), op=MPI.LAND)
    parts = comm.gather(result, root=0)
    if comm.Get_rank() == 0:
        merged = {k: v for part in parts for k, v in part.items()}
        print(json.dumps({"ok": ok, **merged}, sort_keys=True), flush=True)


if __name__ == "__main__":
    world = MPI.COMM_WORLD
    mode = sys.argv[1]
    if mode == "timing":
        timing_scenario(world, sys.argv[2])
    else:
        {"bytes": bytes_scenario, "chain": chain_scenario}[mode](world)
