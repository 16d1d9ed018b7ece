"""Runs a function on N local processes joined in a default process group (tests, TP checks, benchmarks).

`run_local(fn, world_size, *args)` spawns N processes (spawn start method, `threads` intra-op threads each), sets
the torchrun-style env (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK), initialises the default group
(gloo, or nccl with rank i on cuda:i) and calls `fn(rank, *args)`; returns the list of per-rank results
(picklable via torch.save) or raises with the failing rank's traceback. `fn` must be importable by module path.

The trainer tests' checkpoints-at-TP=1-and-TP=2 pattern: `per_checkpoint` runs a scenario for each checkpoint in one
process, `run_at_tp1_and_tp2` runs that on a TP=1 process and a TP=2 pair at once, and `checkpoint_records` gives one
checkpoint's records to its tests (failing them alone if its scenario failed).
"""
from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _save(torch, record: dict, path: Path) -> None:
    staging = path.with_suffix(".tmp")
    torch.save(record, staging)
    os.replace(staging, path)


def _worker(rank: int, world_size: int, port: int, out_dir: str, fn, args, backend: str, threads: int) -> None:
    import torch

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=str(threads))
    torch.set_num_threads(threads)
    result_path = Path(out_dir) / f"rank{rank}.pt"
    import torch.distributed as dist

    try:
        if backend == "nccl":  # one GPU per rank, selected before NCCL binds to the current device
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        result = fn(rank, *args)
    except BaseException:
        _save(torch, {"ok": False, "error": traceback.format_exc()}, result_path)
        os._exit(1)  # peers may be blocked in a collective: no orderly group teardown
    _save(torch, {"ok": True, "result": result}, result_path)
    dist.destroy_process_group()


def run_local(fn, world_size: int, *args, timeout: float = 300.0, backend: str = "gloo", threads: int = 1) -> list:
    """fn(rank, *args) on `world_size` spawned processes in a `backend` group; returns [result of rank 0, ...]."""
    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="marlaas-local-") as out_dir:
        port = free_port()
        procs = [ctx.Process(target=_worker, args=(rank, world_size, port, out_dir, fn, args, backend, threads),
                             daemon=False) for rank in range(world_size)]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout
        try:
            # poll: a rank that fails leaves its peers blocked in a collective, so stop them all
            while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
                time.sleep(0.05)
        finally:
            alive = [p for p in procs if p.is_alive()]
            for proc in alive:
                proc.kill()
                proc.join()
        results, errors = [], []
        for rank in range(world_size):
            path = Path(out_dir) / f"rank{rank}.pt"
            if not path.exists():
                errors.append(f"rank {rank}: no result (exit code {procs[rank].exitcode}"
                              f"{', timed out' if procs[rank] in alive else ''})")
                results.append(None)
                continue
            record = torch.load(path, weights_only=False)
            if record["ok"]:
                results.append(record["result"])
            else:
                errors.append(f"rank {rank}:\n{record['error']}")
                results.append(None)
        if errors:
            raise RuntimeError("distributed run failed:\n" + "\n".join(errors))
        return results


# ---------------------------------------------------------------------------------- trainer scenarios per checkpoint
def per_checkpoint(scenario, rank: int, runs: dict[str, tuple]) -> dict[str, dict]:
    """{checkpoint: scenario(rank, *args)} for each (checkpoint, args) in turn, in this process (one megatron import
    for every checkpoint). A checkpoint whose scenario raises gets {"error": its traceback} and the next one runs
    (every TP rank raises alike: a shape or a value error, not a rank that stops in a collective alone)."""
    out = {}
    for checkpoint, args in runs.items():
        try:
            out[checkpoint] = scenario(rank, *args)
        except Exception:  # noqa: BLE001 (reported to the checkpoint's tests, which fail with it)
            out[checkpoint] = {"error": traceback.format_exc()}
    return out


def run_at_tp1_and_tp2(runner, runs: dict[int, dict[str, tuple]], timeout: float) -> dict[str, dict[int, list]]:
    """{checkpoint: {tp: [record of each rank]}}: `runner(rank, runs[tp])` (a `per_checkpoint` of a scenario) on one
    process for TP=1 and a pair for TP=2, the two groups at once."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        futures = {tp: pool.submit(run_local, runner, tp, runs[tp], timeout=timeout) for tp in (1, 2)}
        by_rank = {tp: future.result() for tp, future in futures.items()}
    return {checkpoint: {tp: [records[checkpoint] for records in by_rank[tp]] for tp in (1, 2)}
            for checkpoint in runs[1]}


def checkpoint_records(all_runs: dict[str, dict[int, list]], checkpoint: str, what: str) -> dict[int, list]:
    """{tp: [record of each rank]} of one checkpoint; the calling test fails with the ranks' tracebacks if its
    scenario failed (only that checkpoint's tests fail)."""
    import pytest

    failed = [f"TP={tp} rank {rank}:\n{record['error']}" for tp, records in all_runs[checkpoint].items()
              for rank, record in enumerate(records) if "error" in record]
    if failed:
        pytest.fail(f"{checkpoint}: the {what} failed\n" + "\n".join(failed))
    return all_runs[checkpoint]
