"""A rollout rank's engine as its role builds it (runtime/roles.py, runtime/join.py): one engine rebuilt in place
if it fails (rollout/restart.py), one per base model in a job of several (rollout/model_engines.py), and its part
in repack (runtime/repack.py)."""
from __future__ import annotations

import os
from pathlib import Path

from marlaas_hpc.config import JobConfig


def model_engines(job: JobConfig, model_paths: dict[str, Path], rank: int, seed: int, device: str, run_dir: Path):
    """A rollout rank's engines of a job of several base models: one per model, the first awake
    (rollout/model_engines.py)."""
    from marlaas_hpc.rollout.engine_set import EngineSet
    from marlaas_hpc.rollout.model_engines import ModelEngines

    return ModelEngines(EngineSet({
        name: (lambda path=path, name=name: rollout_engine(job, path, rank, seed, device, run_dir, name))
        for name, path in model_paths.items()}))


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


def rollout_engine(job: JobConfig, model_path: Path, rank: int, seed: int, device: str, run_dir: Path,
                   model: str | None = None):
    """A rollout rank's engine, rebuilt in place if it fails (rollout/restart.py). `model`: its name, in a job
    of several (its vLLM work dir)."""
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
                  "own_process": job.vllm.own_process(models, on_gpu), "seeded_sampling": job.vllm.seeded(on_gpu)}
        if models > 1 and on_gpu:  # an EngineSet's engines sleep and wake (vLLM's sleep mode, cumem allocator)
            from marlaas_hpc.rollout.engine_set import SLEEP_MODE_KWARGS

            kwargs.update(SLEEP_MODE_KWARGS)
    else:
        kwargs = {"device": device}
        if job.repack.enabled:  # requests cut every step_tokens tokens, so that a tail can be handed over
            kwargs["step_tokens"] = job.repack.step_tokens
    return RestartingEngine(lambda: make_engine(job.engine, model_path, seed=seed + rank, **kwargs))
