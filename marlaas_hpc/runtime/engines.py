"""A rollout rank's engine as its role builds it (runtime/roles.py, runtime/join.py): one engine rebuilt in place
if it fails (rollout/restart.py), one per base model in a job of several (rollout/model_engines.py), and its part
in repack (runtime/repack.py)."""
from __future__ import annotations

import functools
import os
from pathlib import Path

from marlaas_hpc.config import JobConfig
from marlaas_hpc.launch.gpu_share import GpuTurns


def model_engines(job: JobConfig, model_paths: dict[str, Path], rank: int, seed: int, device: str, run_dir: Path,
                  turns: GpuTurns | None = None):
    """A rollout rank's engines of a job of several base models: one per model, the first awake
    (rollout/model_engines.py); on a shared GPU each sleep and wake in its turn (launch/gpu_share.py)."""
    from marlaas_hpc.rollout.engine_set import EngineSet
    from marlaas_hpc.rollout.model_engines import ModelEngines

    return ModelEngines(EngineSet({
        name: (lambda path=path, name=name: rollout_engine(job, path, rank, seed, device, run_dir, name, turns))
        for name, path in model_paths.items()}, turn=turns.engine_change if turns else None))


def repack_roles(job: JobConfig, rank: int, rollout_ranks: list[int]) -> dict:
    """A rollout rank's part in repack (runtime/repack.py), as RolloutRank's keyword arguments: a tail rank keeps
    the newest (largest max_staleness + 1) versions of every task; the others hand their long tails over."""
    if not job.repack.enabled:
        return {}
    from marlaas_hpc.runtime.repack import Repacker, TailVersions
    from marlaas_hpc.tasks.spec import AlgoSpec

    tails = job.repack.tails(rollout_ranks)
    if rank in tails:
        return {"tail": TailVersions(keep=job.largest_staleness() + 1)}
    group = max((task.algo.group_size for task in job.tasks), default=AlgoSpec().group_size)
    return {"repacker": Repacker(job.repack, job.rollout_slots * group, tails)}


def _replays(job: JobConfig, model: str | None) -> bool:
    """Whether a task sampled on this model replays its routing (`algo.routing_replay`): its engine records routes."""
    from marlaas_hpc.tasks.spec import check_base_model

    names = job.model_names()
    return any(task.algo.routing_replay and (model is None or check_base_model(task.base_model, names) == model)
               for task in job.tasks)


def rollout_engine(job: JobConfig, model_path: Path, rank: int, seed: int, device: str, run_dir: Path,
                   model: str | None = None, turns: GpuTurns | None = None):
    """A rollout rank's engine, rebuilt in place if it fails (rollout/restart.py). `model`: its name, in a job
    of several (its vLLM work dir); `turns`: on a GPU trainers may share, each start waits for its turn."""
    from marlaas_hpc.launch.slurm_env import compile_cache_dir
    from marlaas_hpc.model.cache import default_cache_dir
    from marlaas_hpc.rollout import make_engine
    from marlaas_hpc.rollout.restart import RestartingEngine

    # compiled-kernel caches persist across runs (a cold inductor cache costs tens of seconds at start); under
    # Slurm on node-local storage, not the home directory's NFS share (compile_cache_dir)
    if job.engine == "vllm":  # vLLM finds its GPUs through CUDA_VISIBLE_DEVICES (all of them: its TP size)
        work_dir = run_dir / "rollout" / f"rank{rank}" / (model or "")
        on_gpu, models = device.startswith("cuda"), len(job.model_names())
        kwargs = {"work_dir": work_dir, "cache_dir": compile_cache_dir(os.environ, default_cache_dir() / "vllm"),
                  **job.vllm.engine_kwargs(job.max_adapters, job.max_lora_rank, job.largest_staleness()),
                  "own_process": job.vllm.own_process(models, on_gpu), "seeded_sampling": job.vllm.seeded(on_gpu),
                  "return_routes": _replays(job, model)}
        if models > 1 and on_gpu:  # an EngineSet's engines sleep and wake (vLLM's sleep mode, cumem allocator)
            from marlaas_hpc.rollout.engine_set import SLEEP_MODE_KWARGS

            kwargs.update(SLEEP_MODE_KWARGS)
    else:
        kwargs = {"device": device}
        if job.repack.enabled:  # requests cut every step_tokens tokens, so that a tail can be handed over
            kwargs["step_tokens"] = job.repack.step_tokens

    def build(**extra):
        return make_engine(job.engine, model_path, seed=seed + rank, **kwargs, **extra)

    if turns is None:
        return RestartingEngine(build)
    sized = job.engine == "vllm" and device.startswith("cuda")  # vLLM sizes its KV cache from the device's memory
    return RestartingEngine(TurnTakingBuild(build, turns, job.vllm.gpu_memory_utilization,
                                            functools.partial(cuda_memory, device) if sized else None))


def cuda_memory(device: str) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device, as the driver counts them (every process's use included)."""
    import torch

    return torch.cuda.mem_get_info(torch.device(device))


class TurnTakingBuild:
    """Builds a rollout engine on a GPU that trainers may share (launch/gpu_share.py): each start in its turn
    (no training step runs meanwhile), and every start after the first (a rebuild, beside a live trainer) with the
    KV cache the first start sized, asking vLLM only for the memory that is free."""

    def __init__(self, build, turns: GpuTurns, utilization: float, device_memory=None):
        """`device_memory()`: (free, total) bytes of the engine's GPU, for a vLLM engine on a GPU (None: the
        engine sizes nothing from the device)."""
        self.build, self.turns = build, turns
        self.utilization, self.device_memory = utilization, device_memory
        self.kv_cache_bytes: int | None = None
        """What the first start's profiling gave the KV cache (vLLM on a GPU; None before it, or elsewhere)."""
        self.starts = 0

    def __call__(self):
        from marlaas_hpc.launch.gpu_share import rebuild_engine_kwargs

        with self.turns.engine_change("the engine's start" if not self.starts else "the engine's rebuild"):
            extra = {}
            if self.starts and self.device_memory is not None:
                extra = rebuild_engine_kwargs(self.kv_cache_bytes, self.utilization, *self.device_memory())
            engine = self.build(**extra)
        if not self.starts and self.device_memory is not None:
            self.kv_cache_bytes = engine.kv_cache_bytes()
        self.starts += 1
        return engine
