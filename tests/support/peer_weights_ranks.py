"""Run under the ULFM mpiexec by tests/test_peer_weights.py: rank 0 is a live rollout rank feeding its model
directory (PeerFeed, a few chunks per loop turn), ranks 1.. are joiners in a chain (each receives from the one
before and forwards to the next as it receives). Each joiner then builds the hf engine from the files it received,
rank 0 from the disk, and all three sample the same requests with the same adapter at the same version; rank 0
prints one JSON line with what each rank found.

    python tests/support/peer_weights_ranks.py MODEL_DIR OUT_DIR ADAPTER_DIR [--kill-feeder-after N | --bad-sums]
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from mpi4py import MPI

from marlaas_hpc.runtime import peer_weights
from marlaas_hpc.runtime.peer_weights import PeerFeed, WeightSender, receive_weights

peer_weights.CHUNK_BYTES = 1 << 16  # many chunks from the tiny model (its safetensors file is ~3 MB)


def logprobs(model_dir: Path, adapter: str) -> list:
    from marlaas_hpc.model import TextCodec
    from marlaas_hpc.rollout import AdapterRef, GenerationRequest, make_engine

    engine, codec = make_engine("hf", model_dir, seed=0), TextCodec.from_pretrained(model_dir)
    engine.add_adapter(AdapterRef("t", 3, adapter))
    gens = engine.generate([GenerationRequest(f"r{i}", "t", 3, codec.encode_prompt(p), temperature=1.0,
                                              max_new_tokens=8, seed=11 + i) for i, p in enumerate(["12+7=", "3*4="])])
    return [(g.completion_ids, g.logprobs) for g in gens]


def main() -> None:
    model_dir, out_dir, adapter = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    kill_after = int(sys.argv[sys.argv.index("--kill-feeder-after") + 1]) if "--kill-feeder-after" in sys.argv else None
    comm = MPI.COMM_WORLD
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    rank, size = comm.Get_rank(), comm.Get_size()
    result = {"rank": rank}
    if rank == 0:
        feed, turns = PeerFeed(comm, model_dir, peer=1), 0
        if "--bad-sums" in sys.argv:  # what a chunk damaged on the way would look like: every crc32 differs
            finish = feed.sender.finish
            feed.sender.finish = lambda sums: finish([(x + 1) % 2**32 for x in sums])
        while not feed.progress():
            turns += 1  # a live rollout rank's loop: an engine step between turns
            if kill_after is not None and feed.sender.sent_bytes >= kill_after:
                os.kill(os.getpid(), 9)  # the feeder dies mid-transfer (SIGKILL: reported to ULFM peers)
            time.sleep(0.001)
        result["turns"] = turns
        result["received"] = None
        mine = logprobs(model_dir, adapter)
    else:
        forward = WeightSender(comm, rank + 1) if rank + 1 < size else None
        lines = []
        got = receive_weights(comm, out_dir / f"rank{rank}", model_dir, forward=forward, peer=rank - 1,
                              log=lines.append, feeder=f"rank {rank - 1}")
        if forward is not None:
            forward.wait()
        result.update(peer_bytes=got.peer_bytes, fell_back_lines=len(lines), fell_back=got.fell_back, lines=lines, path=str(got.path))
        mine = logprobs(got.path, adapter)
    if kill_after is not None:  # rank 0 is gone: no collective; each joiner prints its own line
        print(json.dumps({**result, "logprobs": mine, "disk": logprobs(model_dir, adapter)}), flush=True)
        os._exit(0)
    if "--bad-sums" in sys.argv and rank > 0:
        print(json.dumps(result), flush=True)
    everyone = comm.gather((result, mine), root=0)
    if rank == 0:
        disk = everyone[0][1]
        print(json.dumps({"ranks": [r for r, _ in everyone], "same_logprobs": [m == disk for _, m in everyone]}), flush=True)
    comm.Barrier()


if __name__ == "__main__":
    main()
