"""A joining rollout rank's start at a real model's shape, base weights from a peer against from the disk
(issue 25 Build 5; runtime/peer_weights.py), without a training job around it.

    python tools/bench_join_weights.py [--model random:qwen3-0.6b] [--joiners 1 3] [--engine hf]

Under the ULFM mpiexec, 1 + J ranks: rank 0 plays the live rollout rank and feeds its model directory
(PeerFeed, a few chunks per loop turn); the J joiners form a chain (each forwards chunks as it receives them).
Each joiner then builds its engine from the files it received and generates one group (4 completions of 16
tokens), and prints the seconds from its start to the weights in, the engine up, and the group done. The disk
runs: the same J joiners build their engines from the model directory. On one machine "disk" is the page cache
(the model's files were just read), and J joiners share the machine's cores: the figures say what the transfer
and the copy into $TMPDIR cost, not what a cluster's shared filesystem would.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def model_dir(model: str) -> Path:
    """'tiny' or 'random:<shape>' (built once, cached)."""
    if model == "tiny":
        from marlaas_hpc.tiny_model import ensure_tiny_model

        return ensure_tiny_model()
    from marlaas_hpc.model.random_checkpoints import ensure_random_checkpoint

    return ensure_random_checkpoint(model.removeprefix("random:"))


def rank_main(model: str, engine_kind: str, mode: str, out: str) -> None:
    from mpi4py import MPI

    from marlaas_hpc.model import TextCodec
    from marlaas_hpc.rollout import GenerationRequest, make_engine
    from marlaas_hpc.runtime.peer_weights import PeerFeed, WeightSender, receive_weights

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    disk = model_dir(model)
    if rank > 0 and engine_kind == "hf":  # the library imports before the clock: each run pays them alike
        import transformers.models.qwen3.modeling_qwen3  # noqa: F401
    if engine_kind == "vllm":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    comm.Barrier()
    t0 = time.time()
    if rank == 0:
        if mode == "peer":
            feed = PeerFeed(comm, disk, peer=1)
            while not feed.progress():
                time.sleep(0.001)
        rows = comm.gather(None, root=0)
        Path(os.environ["BENCH_JOIN_RESULT"]).write_text(json.dumps(rows[1:]) + "\n")
        return
    path, weights_s = disk, 0.0
    if mode == "peer":
        forward = WeightSender(comm, rank + 1) if rank + 1 < size else None
        got = receive_weights(comm, Path(out) / f"rank{rank}", disk, forward=forward, peer=rank - 1)
        if forward is not None:
            forward.wait()
        path, weights_s = got.path, time.time() - t0
    kwargs = {"device": "cpu"} if engine_kind == "hf" else {"work_dir": Path(out) / f"vllm{rank}",
                                                            "max_model_len": 512}
    engine = make_engine(engine_kind, path, seed=rank, **kwargs)
    engine_s = time.time() - t0
    codec = TextCodec.from_pretrained(path)
    engine.generate([GenerationRequest(f"r{i}", "base", None, codec.encode_prompt("12+7="), temperature=1.0,
                                       max_new_tokens=16, seed=i) for i in range(4)])
    comm.gather({"rank": rank, "weights_s": weights_s, "engine_s": engine_s, "first_group_s": time.time() - t0},
                root=0)


def run(model: str, engine: str, mode: str, joiners: int, out: Path) -> list[dict]:
    from marlaas_hpc.launch.mpi import find_local_mpi

    mpi = find_local_mpi("ulfm")
    env = mpi.environ(dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
    result = out / f"{mode}-{joiners}.json"
    code = (f"import sys, json; sys.path.insert(0, {str(ROOT / 'tools')!r}); import bench_join_weights as b; "
            f"b.rank_main({model!r}, {engine!r}, {mode!r}, {str(out)!r})")
    proc = subprocess.run([*mpi.launch_args(joiners + 1), sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-3000:] + proc.stderr[-3000:])
    return json.loads(result.read_text()) if result.exists() else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:qwen3-0.6b")
    parser.add_argument("--engine", default="hf", choices=["hf", "vllm"])
    parser.add_argument("--joiners", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--out", default="runs/bench_join_weights")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    from marlaas_hpc.runtime.peer_weights import manifest

    size = sum(s for _, s in manifest(model_dir(args.model))) / 2**20
    for joiners in args.joiners:
        for mode in ("peer", "disk"):
            os.environ["BENCH_JOIN_RESULT"] = str(out / f"{mode}-{joiners}.json")
            rows = run(args.model, args.engine, mode, joiners, out)
            for row in rows:
                print(f"{args.model} ({size:.0f} MiB), {args.engine} engine, {joiners} joiner(s), weights from {mode}: "
                      f"rank {row['rank']} weights {row['weights_s']:.2f} s, engine up {row['engine_s']:.1f} s, "
                      f"first group {row['first_group_s']:.1f} s", flush=True)


if __name__ == "__main__":
    main()
