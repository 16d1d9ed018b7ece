"""transformers + PEFT rollout engine: the light engine (unit tests, small runs) and the logprob oracle.

One PeftModel over the base; every (task, version) is a separately named adapter, and one `generate` call
serves a batch mixing adapters (`adapter_names=[...]`, "__base__" = no adapter). Prompts are left padded with
an attention mask (transformers derives position ids from it). An adapter on a mixture-of-experts model's
experts is the exception: PEFT wraps the experts' fused 3D parameters (`ParamWrapper`), which refuses mixed
adapter batches, so once one is loaded each batch holds one adapter's rows.

Sampling is done here, not by transformers' warpers: `generate` runs greedy over a logits processor that
draws each row's token from softmax(logits / T) with the row's own torch.Generator (seeded by the request,
or drawn from the engine's generator). So nothing truncates the distribution (transformers' global default
top_k=50 never applies), per-row temperatures work, and a seeded row samples the same tokens whatever batch
it is in. Behaviour logprobs are log_softmax(logits / T) of the sampled tokens (log_softmax(logits) at T = 0, like
vLLM), gathered by the sampler at each decode step on the model's device: a [batch] vector per step, not the
[batch, steps, vocab] logits `output_logits` would keep (128 rows x 512 steps of a 151,936-word vocabulary: 40 GB
in float32, copied to the host after every batch).
"""
from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import torch

from marlaas_hpc.model.checkpoint import stop_token_ids
from marlaas_hpc.rollout.base import (AdapterRef, AdapterVersions, DecodeOccupancy, Generation, GenerationRequest,
                                      RolloutEngine)
from marlaas_hpc.rollout.routes import RouteRecorder, generation_routes

BASE_ADAPTER = "__base__"


class _RowSampler:
    """Logits processor: replaces each row's scores by a one-hot of the token it samples.

    Inverse-CDF sampling, batched on the scores' device: each row draws one uniform number from its own
    generator (on the host: a seeded row samples the same tokens whatever batch it is in), and the token is where
    that number falls in the row's cumulative softmax(logits / T). A per-row multinomial over the host copy of the
    logits cost ~1 ms per row and step (151,936-word vocabulary), which left a GPU idle most of a generate call."""

    def __init__(self, temperatures: list[float], generators: list[torch.Generator]):
        self.temperatures = temperatures
        self.generators = generators
        self.greedy = torch.tensor([t == 0 for t in temperatures])
        self.temps = torch.tensor([t if t > 0 else 1.0 for t in temperatures])
        self.logprobs: list[torch.Tensor] = []
        """Per decode step, each row's log_softmax(logits / T) at the token it sampled ([batch], on the device)."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logits = scores.detach().float()  # the unprocessed logits: this is the only processor
        if self.temps.device != logits.device:
            self.greedy, self.temps = self.greedy.to(logits.device), self.temps.to(logits.device)
        greedy, temps = self.greedy, self.temps
        scaled = logits / temps[:, None]
        probs = torch.softmax(scaled, dim=-1)
        # a diverged adapter (inf/NaN logits) must not take the engine down with every other task: sample
        # anything; its NaN behaviour logprobs make the trainer fail that task alone
        broken = ~torch.isfinite(probs).all(dim=-1)
        probs = torch.where(broken[:, None], torch.ones_like(probs), probs)
        cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # float32 sums of 150k terms drift by ~1e-4
        uniform = torch.cat([torch.rand(1, generator=gen, dtype=torch.float64) for gen in self.generators])
        target = uniform.to(logits.device) * cdf[:, -1]
        sampled = torch.searchsorted(cdf, target[:, None], right=True)[:, 0].clamp_(max=logits.shape[-1] - 1)
        chosen = torch.where(greedy, logits.argmax(dim=-1), sampled)
        self.logprobs.append(torch.log_softmax(scaled, dim=-1).gather(1, chosen[:, None])[:, 0])
        out = torch.full_like(scores, float("-inf"))
        out.scatter_(1, chosen[:, None], 0.0)
        return out


class _RowMaxNewTokens:
    """Stopping criterion: row i is done after max_new_tokens[i] new tokens."""

    def __init__(self, prompt_width: int, max_new_tokens: list[int], device):
        self.prompt_width = prompt_width
        self.limits = torch.tensor(max_new_tokens, device=device)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        return (input_ids.shape[1] - self.prompt_width) >= self.limits


class HfEngine(RolloutEngine):
    """transformers + PEFT engine; `step()` generates everything queued as one batch.

    Args:
        model_path: HF model directory (tokenizer included).
        device: torch device (default cuda if available, else cpu).
        dtype: model dtype.
        seed: seeds the engine generator (used by requests without a seed).
        max_batch_size: split a step's work into batches of at most this many rows (None: one batch).
        step_tokens: a step decodes at most this many tokens per request; the unfinished ones stay queued as
            continuations (prompt + what they sampled, prefilled again next step), so `abort` can cut them
            mid-way (None: a step runs its requests to the end).
    """

    def __init__(self, model_path: str | Path, *, device: str | None = None, dtype: torch.dtype = torch.float32,
                 seed: int = 0, max_batch_size: int | None = None, step_tokens: int | None = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.base = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype).to(self.device).eval()
        # sampling is _RowSampler's: the checkpoint's sampling defaults (Qwen3: temperature 0.6, top_k 20, top_p
        # 0.95) would be merged into every greedy generate call, and transformers warns about each of them
        self.base.generation_config = GenerationConfig()
        tok = AutoTokenizer.from_pretrained(str(model_path))
        self.eos_id = tok.eos_token_id
        # the tokenizer's eos plus generation_config.json's (Qwen3: <|im_end|>, <|endoftext|>), as the vLLM engine
        self.stop_ids = stop_token_ids(model_path, tok)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.model = None  # PeftModel once the first adapter is loaded
        self._on_experts = False
        """Whether an adapter on experts was ever loaded (PEFT's ParamWrapper: one adapter per batch from then)."""
        self.versions = AdapterVersions()
        self._name_of: dict[tuple[str, int], str] = {}  # adapters loaded in the PeftModel
        self._refs: dict[tuple[str, int], AdapterRef] = {}
        self._retired: list[AdapterRef] = []
        self._queue: list[tuple[GenerationRequest, torch.Generator]] = []
        self._generator = torch.Generator().manual_seed(seed)
        self.max_batch_size = max_batch_size
        if step_tokens is not None and step_tokens < 1:
            raise ValueError(f"step_tokens must be at least 1, not {step_tokens}")
        self.step_tokens = step_tokens
        self.decode = DecodeOccupancy()
        self._recorder: RouteRecorder | None = None
        """Routing replay's hooks on the routers, made when a request first asks for routes."""

    # ----------------------------------------------------------------- adapters
    def add_adapter(self, adapter: AdapterRef) -> None:
        from peft import PeftModel

        if not adapter.in_memory and not (Path(adapter.path) / "adapter_config.json").is_file():
            raise FileNotFoundError(f"no PEFT adapter at {adapter.path} ({adapter.task_id} v{adapter.version})")
        name = f"a{self.versions.check_new(adapter)}"  # task ids may hold '.', which module names cannot
        with warnings.catch_warnings():
            # PEFT converting an expert adapter for transformers 5's fused experts sets a rank and alpha pattern
            # for `gate_up_proj`, then wraps the parameter under another name and warns that the pattern matched
            # nothing; the wrapped adapter has the fused rank regardless (tests/test_trainer_moe.py)
            warnings.filterwarnings("ignore", message="The following (rank|alpha)_pattern keys did not match")
            if adapter.in_memory:
                self._load_from_memory(adapter, name)
            elif self.model is None:
                self.model = PeftModel.from_pretrained(self.base, str(adapter.path), adapter_name=name,
                                                       is_trainable=False).eval()
            else:
                self.model.load_adapter(str(adapter.path), adapter_name=name, is_trainable=False)
        retired = self.versions.add(adapter)
        self._on_experts = self._on_experts or _wraps_parameters(self.model)
        key = (adapter.task_id, adapter.version)
        self._name_of[key] = name
        self._refs[key] = adapter
        self._retire(retired)

    def _load_from_memory(self, adapter: AdapterRef, name: str) -> None:
        """What `load_adapter` does with a directory, from PEFT-named tensors: add the adapter, copy them in."""
        from peft import PeftModel, set_peft_model_state_dict

        from marlaas_hpc.trainer.peft_io import peft_config

        config = peft_config(adapter.lora)
        if self.model is None:
            self.model = PeftModel(self.base, config, adapter_name=name).eval()
        else:
            self.model.add_adapter(name, config)
        result = set_peft_model_state_dict(self.model, adapter.tensors, adapter_name=name)
        missing = [k for k in result.missing_keys if "lora_" in k and f".{name}." in k]
        if missing or result.unexpected_keys:
            self.model.delete_adapter(name)
            raise ValueError(f"adapter {adapter.task_id} v{adapter.version}: tensors missing {missing[:3]}, "
                             f"unexpected {list(result.unexpected_keys)[:3]}")
        self.model.eval()

    def adapter_name(self, task_id: str, version: int | None) -> str:
        """PEFT adapter name of a live (task, version); "__base__" for None."""
        if version is None:
            return BASE_ADAPTER
        if (task_id, version) not in self._name_of:
            raise KeyError(f"adapter {task_id} v{version} is not loaded (live: {self.versions.live(task_id)})")
        return self._name_of[(task_id, version)]

    def loaded_adapters(self) -> set[tuple[str, int]]:
        """(task, version) adapters currently held by the PeftModel."""
        return set(self._name_of)

    def pop_retired(self) -> list[AdapterRef]:
        """Adapters dropped since the last call: their files are no longer needed by this engine."""
        out, self._retired = self._retired, []
        return out

    def _retire(self, keys: list[tuple[str, int]]) -> None:
        for key in keys:
            with warnings.catch_warnings():  # "adapter X was active ...": irrelevant, rows name their adapter
                warnings.filterwarnings("ignore", message="Adapter .* was active which is now deleted")
                self.model.delete_adapter(self._name_of.pop(key))
            self._retired.append(self._refs.pop(key))

    # ----------------------------------------------------------------- requests
    def submit(self, requests: list[GenerationRequest]) -> None:
        pinned = []
        try:
            ids = {r.request_id for r, _ in self._queue}
            for req in requests:
                if req.request_id in ids:
                    raise ValueError(f"request id {req.request_id!r} is already in flight")
                if req.temperature < 0 or req.remaining_tokens < 1 or not req.prompt_ids \
                        or len(req.partial_logprobs) != len(req.partial_ids):
                    raise ValueError(f"request {req.request_id!r}: need temperature >= 0, max_new_tokens >= 1 "
                                     "past its partial tokens (one logprob each) and a non-empty prompt")
                ids.add(req.request_id)
                if req.adapter_version is not None:
                    self.versions.acquire(req.task_id, req.adapter_version)
                pinned.append(req)
        except BaseException:
            for req in pinned:
                if req.adapter_version is not None:
                    self.versions.release(req.task_id, req.adapter_version)
            raise
        for req in requests:
            if req.seed is None:  # kept in the request: a continuation elsewhere draws the same stream
                req = dataclasses.replace(req, seed=int(torch.randint(2**62, (), generator=self._generator)))
            generator = torch.Generator().manual_seed(req.seed)
            if req.partial_ids:  # one uniform per sampled token (_RowSampler): skip those the partial drew
                torch.rand(len(req.partial_ids), generator=generator, dtype=torch.float64)
            self._queue.append((req, generator))

    def abort(self, request_ids: list[str]) -> list[GenerationRequest]:
        """The queued requests among `request_ids`, taken out: each as its continuation (`partial_ids`: what
        earlier steps sampled; with `step_tokens`, a step leaves unfinished requests queued so). A seeded one
        continues its seed's stream on an HfEngine: the continuing engine skips the draws its partial took."""
        wanted, kept, out = set(request_ids), [], []
        for req, generator in self._queue:
            (out if req.request_id in wanted else kept).append((req, generator))
        self._queue = kept
        for req, _ in out:
            if req.adapter_version is not None:
                self._retire(self.versions.release(req.task_id, req.adapter_version))
        return [req for req, _ in out]

    def step(self) -> list[Generation]:
        queue, self._queue = self._queue, []
        done = []
        # a batch either ends rows at stop tokens or samples through them; greedy rows (evals) decode apart from
        # sampled (training) rows: a row's fp32 logprobs change in their last bits with its batch's make-up, and
        # an eval reaches the rank at a timing-dependent moment, so sharing its step would make a training
        # group's logprobs (and the adapters trained on them) differ between two runs of one job
        for part in self._parts(queue):
            size = self.max_batch_size or max(len(part), 1)
            for i in range(0, len(part), size):
                finished, unfinished = self._generate_batch(part[i:i + size])
                done += finished
                self._queue += unfinished
        for gen in done:
            if gen.adapter_version is not None:
                self._retire(self.versions.release(gen.task_id, gen.adapter_version))
        return done

    def _generate(self, reqs: list[GenerationRequest], kwargs: dict):
        """`generate` with each row's adapter: named per row (a mixed batch), or, with adapters on experts, the
        one adapter of the batch made the active one (the base model: every adapter disabled)."""
        if self.model is None:
            return self.base.generate(**kwargs)
        names = [self.adapter_name(r.task_id, r.adapter_version) for r in reqs]
        if not self._on_experts:
            return self.model.generate(**kwargs, adapter_names=names)
        if names[0] == BASE_ADAPTER:
            with self.model.disable_adapter():
                return self.model.generate(**kwargs)
        self.model.set_adapter(names[0], inference_mode=True)
        return self.model.generate(**kwargs)

    def _parts(self, queue: list) -> list[list]:
        """The queue split into what may share a batch: the same stop rule and greedy or sampled (above); and,
        once an adapter on experts is loaded (PEFT's ParamWrapper takes one adapter per forward), one adapter."""
        keys = {}
        for req, generator in queue:
            key = (req.ignore_stop, req.temperature == 0,
                   None if not self._on_experts else self.adapter_name(req.task_id, req.adapter_version))
            keys.setdefault(key, []).append((req, generator))
        return [keys[key] for key in sorted(keys, key=str)]

    def _route_recorder(self) -> RouteRecorder:
        """Hooks on the base model's routers (PEFT wraps the base in place: the same modules)."""
        if self._recorder is None:
            self._recorder = RouteRecorder(self.base)
        return self._recorder

    def has_unfinished(self) -> bool:
        return bool(self._queue)

    def occupancy(self) -> dict:
        return self.decode.as_dict()

    def progress(self) -> dict[str, int]:
        return {req.request_id: len(req.partial_ids) for req, _ in self._queue}

    @torch.inference_mode()
    def _generate_batch(self, batch: list[tuple[GenerationRequest, torch.Generator]]
                        ) -> tuple[list[Generation], list[tuple[GenerationRequest, torch.Generator]]]:
        """Decodes one batch; returns the finished requests' Generations and, under `step_tokens`, the others
        as continuations (each keeps its generator: every row cut here drew exactly this batch's decode steps)."""
        from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

        reqs = [r for r, _ in batch]
        contexts = [list(r.prompt_ids) + list(r.partial_ids) for r in reqs]  # a continuation is prefilled again
        limits = [min(r.remaining_tokens, self.step_tokens or r.remaining_tokens) for r in reqs]
        width = max(len(c) for c in contexts)
        input_ids = torch.full((len(reqs), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(reqs), width), dtype=torch.long)
        for row, context in enumerate(contexts):
            input_ids[row, width - len(context):] = torch.tensor(context)
            attention_mask[row, width - len(context):] = 1
        max_new = max(limits)
        config = GenerationConfig(
            max_new_tokens=max_new, min_new_tokens=0, do_sample=False, num_beams=1, num_return_sequences=1,
            eos_token_id=None if reqs[0].ignore_stop else self.stop_ids, pad_token_id=self.pad_id, repetition_penalty=1.0, no_repeat_ngram_size=0,
            return_dict_in_generate=True, use_cache=True)
        sampler = _RowSampler([r.temperature for r in reqs], [g for _, g in batch])
        kwargs = dict(input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                      generation_config=config, logits_processor=LogitsProcessorList([sampler]),
                      stopping_criteria=StoppingCriteriaList([_RowMaxNewTokens(width, limits, self.device)]))
        recorder = self._route_recorder() if any(r.return_routes for r in reqs) else None
        if recorder is None:
            out = self._generate(reqs, kwargs)
        else:
            with recorder.recording():
                out = self._generate(reqs, kwargs)
            forwards = recorder.by_position(len(reqs))
        new_tokens = out.sequences[:, width:].cpu()
        logprobs = torch.stack(sampler.logprobs, dim=1).cpu()  # [batch, steps]: one copy to the host per batch
        gens, unfinished, lengths = [], [], []
        for row, (req, generator) in enumerate(batch):
            toks = new_tokens[row, :limits[row]].tolist()
            finish = "length"
            stop = None if req.ignore_stop else next((i for i, t in enumerate(toks) if t in self.stop_ids), None)
            if stop is not None:
                toks = toks[: stop + 1]
                finish = "stop"
            lps = logprobs[row, :len(toks)].tolist()
            lengths.append(len(toks))
            if stop is None and len(toks) < req.remaining_tokens:  # cut by step_tokens: queued again
                unfinished.append((dataclasses.replace(req, partial_ids=list(req.partial_ids) + toks,
                                                       partial_logprobs=list(req.partial_logprobs) + lps), generator))
                continue
            routes = generation_routes(forwards, row, len(contexts[row]), width, len(toks)) \
                if req.return_routes else None
            gens.append(Generation(request_id=req.request_id, task_id=req.task_id,
                                   adapter_version=req.adapter_version, prompt_ids=list(req.prompt_ids),
                                   completion_ids=list(req.partial_ids) + toks,
                                   logprobs=list(req.partial_logprobs) + lps, finish_reason=finish,
                                   routes=routes))
        self.decode.add_batch(lengths)
        return gens, unfinished


def _wraps_parameters(model) -> bool:
    """Whether PEFT wrapped a parameter of `model` (an MoE's fused experts), not only Linear modules."""
    from peft.tuners.lora.layer import ParamWrapper

    return any(isinstance(module, ParamWrapper) for module in model.modules())
