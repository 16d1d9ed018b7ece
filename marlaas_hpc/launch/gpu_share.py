"""A GPU that a rollout engine and trainer ranks share after start-up (layout.share_gpus).

Start-up is ordered (runtime/roles.py: the trainers build their models once every engine has started), but an engine
changes its memory later too: `RestartingEngine` rebuilds a failed engine, `marlaas scale` starts a joiner, an
`EngineSet` sleeps one model and wakes another. vLLM checks the whole device's memory at each of those moments
(`free >= gpu_memory_utilization x total` when it starts, its KV cache sized from what it measures while it
profiles, "Memory usage increased after sleeping" when it sleeps), and a trainer allocating on the same GPU
meanwhile trips the checks or makes the engine size its cache wrong. Three measures, one owner:

- Turns (`GpuTurns`): a node-local lock file per GPU. An engine takes it exclusively while it starts, rebuilds,
  sleeps or wakes; a trainer rank takes it shared for each fused training step. An engine change waits for the step
  under way; the next step waits for the change. Writers go first: an engine announces itself on a second file, so
  that back-to-back steps cannot starve it.
- A cap (`trainer_memory_fraction`): the trainer's caching allocator may hold at most what vLLM's share leaves, so
  a trainer that outgrows the plan gets its own CUDA out-of-memory (redone or failed by its group,
  runtime/group_guard.py) instead of taking the engine's memory mid-decode.
- An explicit KV-cache budget for rebuilds (`rebuild_engine_kwargs`): an engine started again beside a live trainer
  reuses the KV-cache size its first start measured (vLLM's `kv_cache_memory_bytes`, no profiling), and asks only
  for the memory that is free.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Mapping

from marlaas_hpc.launch.slurm_env import node_scratch



class GpuTurns:
    """Turns on the GPUs one rank uses (a tensor-parallel engine uses several; a trainer rank one)."""

    def __init__(self, lock_dir: Path, gpus: tuple[str, ...], log: Callable[[str], None] | None = None):
        self.lock_dir = Path(lock_dir)
        self.gpus = tuple(sorted(gpus))  # one order for every rank: no two engines wait on each other
        self.log = log
        self._depth = 0  # re-entrant within a process: an EngineSet's switch and the engine it rebuilds
        self._files: list = []
        self.waited_s = 0.0
        """Seconds this rank has waited for its turns so far."""
        self.lock_dir.mkdir(parents=True, exist_ok=True)

    def _path(self, gpu: str, kind: str) -> Path:
        return self.lock_dir / f"gpu-{gpu.replace('/', '_')}.{kind}"

    @contextmanager
    def engine_change(self, what: str) -> Iterator[None]:
        """An engine starts, rebuilds, sleeps or wakes: no trainer step runs on its GPUs meanwhile."""
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        start = time.monotonic()
        intents = [self._lock(self._path(gpu, "intent"), fcntl.LOCK_EX) for gpu in self.gpus]
        locks = [self._lock(self._path(gpu, "lock"), fcntl.LOCK_EX) for gpu in self.gpus]
        self._note(time.monotonic() - start, f"{what} waited for the training step on GPU {','.join(self.gpus)}")
        self._depth = 1
        try:
            yield
        finally:
            self._depth = 0
            for handle in locks + intents:
                handle.close()  # closing the file releases its lock

    @contextmanager
    def training_step(self) -> Iterator[None]:
        """A trainer rank's fused step: waits while an engine on its GPU changes."""
        start = time.monotonic()
        for gpu in self.gpus:  # an engine waiting for its turn goes first
            self._lock(self._path(gpu, "intent"), fcntl.LOCK_SH).close()
        locks = [self._lock(self._path(gpu, "lock"), fcntl.LOCK_SH) for gpu in self.gpus]
        self._note(time.monotonic() - start, f"the training step waited for the engine on GPU {','.join(self.gpus)}")
        try:
            yield
        finally:
            for handle in locks:
                handle.close()

    @staticmethod
    def _lock(path: Path, mode: int):
        handle = open(path, "a+")
        fcntl.flock(handle, mode)
        return handle

    def _note(self, waited: float, message: str) -> None:
        self.waited_s += waited
        if waited >= 1.0 and self.log is not None:
            self.log(f"[gpu] {message} {waited:.1f} s")


def turns_dir(run_dir: Path, environ: Mapping[str, str] = os.environ) -> Path:
    """Node-local directory of one job's lock files: `<$SLURM_TMPDIR or $TMPDIR or /tmp>/marlaas_hpc-<uid>/
    gpu-turns/<hash of the run dir>` (every rank of the job on the node finds the same one)."""
    job = hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]
    return node_scratch(environ) / "gpu-turns" / job  # node-local: flock on NFS is unreliable


def gpu_turns(share_gpus: bool, binding, run_dir: Path, environ: Mapping[str, str] = os.environ,
              log: Callable[[str], None] | None = None) -> GpuTurns | None:
    """The turns of a GPU rank of a job whose engines and trainers may share GPUs (layout.share_gpus: a joiner
    too, whichever GPU it is given); None otherwise. A GPU no other rank uses costs an uncontended lock."""
    if not share_gpus or binding is None or not binding.is_cuda or not binding.gpus:
        return None
    return GpuTurns(turns_dir(run_dir, environ), binding.gpus, log)


def trainer_memory_fraction(engine_share: float, engines: int = 1) -> float:
    """The part of a shared GPU a trainer rank's caching allocator may hold: what `engines` vLLM engines of
    `gpu_memory_utilization` `engine_share` leave (the plan gives the trainer the same, plan/command.py)."""
    left = 1.0 - engine_share * engines
    if left <= 0.05:
        raise ValueError(f"vLLM's share {engine_share:g} x {engines} engine(s) leaves the trainer {left:.2f} of the "
                         "GPU: lower vllm.gpu_memory_utilization")
    return left


def cap_trainer_memory(fraction: float, device: str) -> None:
    """Caps this process's CUDA caching allocator on `device` (torch raises OutOfMemoryError past it)."""
    import torch

    torch.cuda.set_per_process_memory_fraction(fraction, torch.device(device))


def rebuild_engine_kwargs(kv_cache_bytes: int | None, utilization: float, free_bytes: int,
                          total_bytes: int) -> dict:
    """vLLM keyword arguments of an engine started again beside a live trainer: the KV cache its first start sized
    (`kv_cache_memory_bytes`: vLLM then skips the profiling that measures the whole device), and a utilization no
    larger than what is free (vLLM refuses to start when `free < gpu_memory_utilization x total`, which a
    trainer's CUDA context and NCCL buffers outside the allocator's cap can make true). Empty without a first
    start's figure."""
    if not kv_cache_bytes:
        return {}
    free_share = 0.98 * free_bytes / total_bytes
    return {"kv_cache_memory_bytes": int(kv_cache_bytes),
            "gpu_memory_utilization": round(max(0.01, min(utilization, free_share)), 4)}
