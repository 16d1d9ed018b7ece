"""TaskSpec: one tenant's RL run, validated on intake.

A bad spec raises `SpecError` naming the offending field (dotted path, e.g. ``lora.rank``), so intake can
reject it with a clear message without touching any running task.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

from marlaas_hpc.config_loader import SpecError, bounded, check_bounds, check_fields, fields_under, load_config

__all__ = ["AlgoSpec", "DatasetSpec", "LoraSpec", "OverlongSpec", "PromptSpec", "SpecError", "TaskSpec",
           "check_fields"]

# HF module names of a Qwen3 decoder layer that a LoRA may target.
QWEN3_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_LORA_RANK = 4096
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass(kw_only=True)
class LoraSpec:
    rank: int = bounded(8, gt=0, le=MAX_LORA_RANK)
    """LoRA rank r (> 0)."""
    alpha: float = bounded(16.0, gt=0.0)
    """LoRA alpha; the update is scaled by alpha / rank, as in PEFT."""
    target_modules: tuple[str, ...] = QWEN3_LORA_TARGETS
    """HF module names (per decoder layer) that get an adapter."""

    def validate(self, prefix: str = "lora") -> None:
        check_bounds(self, prefix)  # each field's bounds, beside it above
        if not self.target_modules:
            raise SpecError(f"{prefix}.target_modules", "must name at least one module")
        unknown = [m for m in self.target_modules if m not in QWEN3_LORA_TARGETS]
        if unknown:
            raise SpecError(f"{prefix}.target_modules",
                            f"model has no module(s) {unknown}; available: {list(QWEN3_LORA_TARGETS)}")

    @property
    def scaling(self) -> float:
        return float(self.alpha) / self.rank


@dataclass(kw_only=True)
class OverlongSpec:
    """DAPO's soft overlong punishment (arXiv 2503.14476 §3.4): a completion within `buffer_tokens` of its
    length limit L loses reward linearly, down to -penalty at L:

        R_length(y) = 0                                     |y| <= L - buffer_tokens
                    = (L - buffer_tokens - |y|) / buffer_tokens * penalty     L - buffer_tokens < |y| <= L

    L and |y| are `max_new_tokens` and the completion's tokens for a single-turn task; for a multi-turn (tool)
    task, `max_episode_tokens` and the episode's prompt + model + tool tokens (what that limit truncates)."""

    buffer_tokens: int = bounded(ge=1, le=2**24)
    """L_cache: the tokens before the limit over which the penalty ramps from 0 to -penalty (>= 1)."""
    penalty: float = bounded(1.0, ge=0.0)
    """The penalty at the limit, in reward units (DAPO: 1, the reward of a right answer)."""

    def validate(self, prefix: str = "overlong") -> None:
        check_bounds(self, prefix)

    def penalty_at(self, length: int, limit: int) -> float:
        """R_length of a completion of `length` tokens under a limit of `limit` (<= 0)."""
        excess = length - (limit - self.buffer_tokens)
        if excess <= 0:
            return 0.0
        return -min(excess, self.buffer_tokens) / self.buffer_tokens * self.penalty


@dataclass(kw_only=True)
class AlgoSpec:
    """The task's RL algorithm: its objective (`loss`, trainer/objectives.py) and the knobs around it. A field
    left unset (None) takes the value of the chosen objective's paper (tasks/registry.py `OBJECTIVE_DEFAULTS`;
    docs/configuration.md: the objectives table)."""

    loss: str = "grpo"
    """The objective: 'grpo' (token-level PPO-clip, token mean over the task's batch), 'dr_grpo' (Dr. GRPO: a
    constant length normaliser, no std normalisation), 'dapo' (DAPO: the token-level loss with clip-higher and
    dynamic sampling), 'gspo' (GSPO: one importance ratio per sequence, clipped per sequence), 'cispo' (CISPO:
    the clipped ratio as a coefficient without gradient, so every token keeps its gradient)."""
    group_size: int = bounded(8, ge=2, le=4096)
    """G: completions sampled per prompt (>= 2: the advantage is relative to the group)."""
    batch_prompts: int = bounded(8, ge=1, le=65536)
    """B: prompt groups per optimizer step."""
    lr: float = bounded(1e-3, gt=0.0)
    """AdamW learning rate of this task's adapter."""
    weight_decay: float = bounded(0.0, ge=0.0, le=1.0)
    """AdamW weight decay."""
    clip_eps: float | None = bounded(None, ge=0.0, le=1.0)  # the lower clip 1 - eps stays >= 0
    """PPO clip epsilon on the ratio pi_theta / pi_old: the ratio is clipped below at 1 - clip_eps (and above at
    1 + clip_eps_high). None: the objective's (0.2; gspo 3e-4; cispo 1.0, no lower clip)."""
    clip_eps_high: float | None = bounded(None, ge=0.0, le=1.0)
    """Clip-higher (DAPO): the ratio's upper clip is 1 + clip_eps_high. None: clip_eps if that is set, else the
    objective's (dapo and cispo 0.28, gspo 4e-4, else 0.2)."""
    kl_beta: float = bounded(0.0, ge=0.0)
    """Weight of the KL penalty to the base model (adapter off); 0 disables it."""
    kl_estimator: str = "k3"
    """Per-token estimator of KL(pi_theta || pi_base), with d = log pi_base - log pi_theta: 'k1' (-d), 'k2'
    (d^2 / 2) or 'k3' (e^d - d - 1, unbiased and >= 0)."""
    tis_cap: float | None = bounded(None, ge=1.0)  # below 1 it would scale down tokens both sides agree on
    """Truncated importance sampling: weight each token's loss by min(pi_trainer / pi_rollout, tis_cap), both at
    the token's behaviour version, and clip the ratio against pi_trainer (the rollout engine and the trainer
    compute different numbers for the same policy: bf16 kernels). >= 1; None: off, the ratio is taken against
    the rollout engine's logprobs (docs/architecture.md §10, how pi_trainer at the behaviour version is had)."""
    icepop_band: tuple[float, float] | None = None
    """IcePop masking, [low, high], for the same mismatch as TIS (larger on MoE models, whose routing the two
    engines may decide differently): a token whose k = pi_trainer / pi_rollout, both at its behaviour version,
    lies outside [low, high] gets no gradient (its term, KL included, is 0; it still counts in the normaliser);
    one inside is weighted by k; the ratio is clipped against pi_trainer, as with TIS (gspo: k of the sequence,
    as its ratio). 0 < low < 1 < high, e.g. [0.5, 5.0]; None: off. Not with tis_cap: both weigh the token."""
    routing_replay: bool = bounded(False)
    """Routing replay (mixture-of-experts base models only): the rollout engine records the experts it chose for
    every token it fed (prompt and completion, every MoE layer), and the trainer's forwards of this task's rows
    route those tokens to the recorded experts instead of recomputing its own top k; the gate weights still come
    from the trainer's router at those experts. Removes the share of the rollout / trainer mismatch that comes
    from the two engines picking different experts (the trainer reports `route_mismatch`: the share of trained
    tokens whose own top k differs somewhere). Costs top_k x MoE layers int16 per token on the wire. Refused on a
    dense model (docs/architecture.md: Routing replay)."""
    temperature: float = bounded(1.0, gt=0.0, le=100.0)
    """Sampling temperature of rollouts; behaviour and trainer logprobs are taken at this temperature."""
    max_new_tokens: int = bounded(16, ge=1, le=2**20)
    """Longest completion sampled, in tokens (also Dr. GRPO's constant length normaliser)."""
    normalize_adv_std: bool | None = bounded(None)
    """Divide group-relative advantages by the group's std (GRPO original); False only centres them.
    None: the objective's (False for dr_grpo, True otherwise)."""
    dynamic_sampling: bool | None = bounded(None)
    """DAPO's dynamic sampling: a prompt group whose G rewards are all equal (no learning signal) is not
    trained, and the scheduler issues another prompt in its place, within the staleness bound, so each step
    still trains B informative groups. None: the objective's (True for dapo, False otherwise)."""
    dynamic_sampling_patience: int = bounded(8, ge=1, le=10**6)
    """Dynamic sampling gives up after this many batches (x B) of uninformative groups in a row and trains
    them as they come until an informative one arrives: a task whose rewards saturate (every sample right, or
    every one wrong) would otherwise draw prompts for ever."""
    overlong: OverlongSpec | None = None
    """DAPO's soft overlong punishment added to the reward of a completion near its length limit (the advantage
    is computed from it; `reward` in records stays the verifier's). None: off."""
    grad_clip: float = bounded(1.0, ge=0.0)
    """Max global grad norm of the adapter; 0 disables clipping."""
    max_turns: int = bounded(4, ge=1, le=1024)
    """Multi-turn (tool) tasks: model turns per episode; an episode still calling tools after its last turn
    ends with the env's truncation reward (0.0). Single-turn tasks ignore it."""
    max_episode_tokens: int = bounded(256, ge=2, le=2**24)
    """Multi-turn (tool) tasks: prompt + model + tool tokens per episode; each turn is capped to fit and an
    observation that does not fit ends the episode with the truncation reward (0.0)."""

    def validate(self, prefix: str = "algo") -> None:
        from marlaas_hpc.tasks.registry import KL_ESTIMATORS, OBJECTIVES

        if self.loss not in OBJECTIVES:
            raise SpecError(f"{prefix}.loss", f"unknown objective {self.loss!r}; known: {list(OBJECTIVES)}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise SpecError(f"{prefix}.kl_estimator", f"must be one of {list(KL_ESTIMATORS)}, got {self.kl_estimator!r}")
        check_bounds(self, prefix)  # each field's bounds, beside it above (numbers finite)
        # cispo clips an importance weight, not the update, and leaves its lower side open (clip_eps 1.0)
        if self.loss != "cispo" and self.clip_high < self.clip_low:
            raise SpecError(f"{prefix}.clip_eps_high", f"must be >= clip_eps ({self.clip_low:g}): clip-higher widens "
                                                       f"the upper clip, got {self.clip_high:g}")
        self._validate_icepop(prefix)
        if self.overlong is not None:
            if not isinstance(self.overlong, OverlongSpec):
                raise SpecError(f"{prefix}.overlong", "must be a mapping {buffer_tokens, penalty}")
            self.overlong.validate(f"{prefix}.overlong")

    def _validate_icepop(self, prefix: str) -> None:
        band = self.icepop_band
        if band is None:
            return
        numbers = isinstance(band, (tuple, list)) and len(band) == 2 and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in band)
        if not numbers or not 0 < band[0] < 1 < band[1]:
            raise SpecError(f"{prefix}.icepop_band", f"must be [low, high] with 0 < low < 1 < high (a band around "
                                                     f"pi_trainer = pi_rollout), got {band!r}")
        if self.tis_cap is not None:
            raise SpecError(f"{prefix}.icepop_band", f"conflicts with {prefix}.tis_cap ({self.tis_cap:g}): both set "
                                                     "each token's mismatch weight; set one of them")

    @property
    def mismatch_correction(self) -> str | None:
        """'TIS' (`tis_cap`) or 'IcePop' (`icepop_band`): the loss corrects the rollout engine / trainer mismatch,
        and needs the trainer's logprobs at each token's behaviour version; None: it does not."""
        if self.tis_cap is not None:
            return "TIS"
        return "IcePop" if self.icepop_band is not None else None

    def _default(self, index: int):
        from marlaas_hpc.tasks.registry import OBJECTIVE_DEFAULTS

        return OBJECTIVE_DEFAULTS[self.loss][index]

    @property
    def clip_low(self) -> float:
        """epsilon of the ratio's lower clip 1 - epsilon."""
        return self._default(0) if self.clip_eps is None else self.clip_eps

    @property
    def clip_high(self) -> float:
        """epsilon of the ratio's upper clip 1 + epsilon: the objective's pair applies only as a pair."""
        if self.clip_eps_high is not None:
            return self.clip_eps_high
        return self._default(1) if self.clip_eps is None else self.clip_eps

    @property
    def std_normalized(self) -> bool:
        """Whether group-relative advantages are divided by the group's std."""
        return self._default(2) if self.normalize_adv_std is None else self.normalize_adv_std

    @property
    def filters_groups(self) -> bool:
        """Whether dynamic sampling drops groups with equal rewards."""
        return self._default(3) if self.dynamic_sampling is None else self.dynamic_sampling


@dataclass(kw_only=True)
class DatasetSpec:
    kind: str = "addition"
    """Task type: a synthetic task (addition, reverse, count, sort), 'gsm8k' (GSM8K-format data on disk),
    'math' (a math dataset on disk: the answer column is the final answer or a solution ending in '#### N' or
    \\boxed{}), 'gsm8k_synth' (generated GSM8K-style word problems), 'gsm8k_easy' (generated one-step ones a
    small model learns on a CPU), 'custom', or an env workload (gsm8k_tool, gsm8k_plain, hotpotqa, lookup)."""
    path: str | None = None
    """Data of file-backed kinds (gsm8k, math, custom; gsm8k_tool, gsm8k_plain): a JSONL (one sample per line),
    JSON or parquet file, or a folder written by `datasets`' save_to_disk (tasks/dataset_files.py); hotpotqa: JSONL."""
    fields: dict[str, str] = field(default_factory=dict)
    """Which column holds each part of a sample (gsm8k, math, custom): {prompt: ..., answer: ...}; a dotted name
    reaches into a nested column (verl's parquet: {prompt: prompt, answer: reward_model.ground_truth}). An unset
    part keeps the kind's column: gsm8k question / answer, math problem / answer, custom prompt / answer. The
    prompt column holds text or chat messages [{role, content}, ...] (these need prompt.format: chat)."""
    split: str | None = None
    """A save_to_disk folder holding several splits (a DatasetDict): the one to read (None: 'train'). The task
    still draws its own eval samples from it (eval_size)."""
    reward_fn: str | None = None
    """'path/to/file.py:function' (relative to the spec; run only in env ranks' sandboxed workers) computing
    reward(sample, completion) -> float in [0, 1] (custom kind); for an env workload (gsm8k_tool, gsm8k_plain,
    hotpotqa, lookup) it replaces the built-in verifier of the final turn."""
    seed: int = bounded(0, ge=0, le=2**63 - 1)
    """Seed of the train/eval split and of synthetic generation."""
    eval_size: int = bounded(128, ge=1, le=10**7)
    """Held-out samples used for eval accuracy."""
    corpus: str | None = None
    """Search corpus JSONL for tool workloads (hotpotqa); None: the data file's own context documents."""
    metric: str | None = bounded(None, choices=("f1", "em"))
    """QA reward: 'f1' (default) or 'em' (exact match)."""
    syntax: str | None = bounded(None, choices=("compact", "xml"))
    """Tool-call syntax of the lookup workload: 'compact' (default, for the tiny model) or 'xml'."""
    answer_format: str | None = bounded(None, choices=("hash", "boxed"))
    """GSM8K kinds: where the scored final answer is, and what chat prompts ask for: 'hash' (after '####'),
    'boxed' (the last \\boxed{...}), or None: after '####', else boxed, else the whole completion."""
    tool_latency_s: float = bounded(0.0, ge=0.0, le=60.0, unit="seconds")
    """Lookup workload: extra seconds every lookup call takes (a remote key-value service; tests and
    benchmarks of slow tools). 0: answer at once."""

    def validate(self, prefix: str = "dataset") -> None:
        from marlaas_hpc.tasks.registry import TASK_KINDS

        if self.kind not in TASK_KINDS:
            raise SpecError(f"{prefix}.kind", f"unknown task type {self.kind!r}; known: {sorted(TASK_KINDS)}")
        check_bounds(self, prefix)  # each field's bounds, beside it above
        if self.kind in ("gsm8k", "math", "custom", "gsm8k_tool", "gsm8k_plain", "hotpotqa") and not self.path:
            raise SpecError(f"{prefix}.path", f"task type {self.kind!r} needs a data file")
        self._validate_columns(prefix)
        if self.kind == "custom" and not self.reward_fn:
            raise SpecError(f"{prefix}.reward_fn", "custom tasks name a reward function as 'path/to/file.py:function'")


    def _validate_columns(self, prefix: str) -> None:
        if not isinstance(self.fields, dict) or not all(
                isinstance(k, str) and isinstance(v, str) and v.strip() for k, v in self.fields.items()):
            raise SpecError(f"{prefix}.fields", f"must map sample parts to column names, got {self.fields!r}")
        unknown = sorted(set(self.fields) - set(SAMPLE_PARTS))
        if unknown:
            raise SpecError(f"{prefix}.fields", f"unknown sample part(s) {unknown}; map {list(SAMPLE_PARTS)}")
        for name in ("fields", "split"):
            if getattr(self, name) and self.kind not in MAPPED_KINDS:
                raise SpecError(f"{prefix}.{name}", f"applies to kinds {list(MAPPED_KINDS)}, not {self.kind!r}")
        if self.split is not None and (not isinstance(self.split, str) or not self.split.strip()):
            raise SpecError(f"{prefix}.split", f"must name a split, got {self.split!r}")


SAMPLE_PARTS = ("prompt", "answer")
"""The parts of a sample `DatasetSpec.fields` maps to columns."""
MAPPED_KINDS = ("gsm8k", "math", "custom", "gsm8k_tool", "gsm8k_plain")
"""Kinds whose data is read by tasks/dataset_files.py (any format, a field map)."""

PROMPT_FORMATS = ("raw", "chat")


@dataclass(kw_only=True)
class PromptSpec:
    format: str = "raw"
    """'raw': the task's prompt text as is, after the tokenizer's bos token if it has one (base models, the tiny
    model). 'chat': the prompt is the user message, rendered with the tokenizer's chat template and
    add_generation_prompt (instruct models such as Qwen3); tool output of multi-turn tasks becomes a tool turn."""
    system: str | None = None
    """Chat only: a system message before the user message (None: none)."""
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Chat only: extra variables of the chat template, e.g. {enable_thinking: false} for Qwen3."""

    def validate(self, prefix: str = "prompt") -> None:
        if self.format not in PROMPT_FORMATS:
            raise SpecError(f"{prefix}.format", f"must be one of {list(PROMPT_FORMATS)}, got {self.format!r}")
        if self.system is not None and not isinstance(self.system, str):
            raise SpecError(f"{prefix}.system", f"must be a string, got {self.system!r}")
        if not isinstance(self.template_kwargs, dict) or not all(
                isinstance(k, str) and isinstance(v, (str, int, float, bool)) for k, v in self.template_kwargs.items()):
            raise SpecError(f"{prefix}.template_kwargs", "must map names to strings, numbers or booleans")
        if self.format == "raw" and (self.system is not None or self.template_kwargs):
            field_name = "system" if self.system is not None else "template_kwargs"
            raise SpecError(f"{prefix}.{field_name}", "applies to chat prompts only (set prompt.format: chat)")


@dataclass(kw_only=True)
class TaskSpec:
    task_id: str
    """Unique id of the task within the job (letters, digits, '_', '-', '.')."""
    tenant: str = "default"
    """Owner of the task; outputs go to tasks/<tenant>/<task_id>/."""
    base_model: str | None = None
    """The base model the task fine-tunes: a name in the job's `models` (or the path of one of them, as with a
    single `model:`); None: the job's first model."""
    dataset: DatasetSpec = field(default_factory=DatasetSpec)
    """Where samples and rewards come from."""
    prompt: PromptSpec = field(default_factory=PromptSpec)
    """How prompts reach the model: raw text or the tokenizer's chat template."""
    lora: LoraSpec = field(default_factory=LoraSpec)
    """This task's adapter shape."""
    algo: AlgoSpec = field(default_factory=AlgoSpec)
    """The RL objective and its hyper-parameters."""
    total_steps: int = bounded(20, ge=1, le=10**7)
    """Optimizer steps to run; the task is done at policy version == total_steps."""
    max_staleness: int = bounded(1, ge=0, le=10**6)
    """k: the step producing version v+1 may use samples from versions >= v - k (0 = on-policy)."""
    priority: int = bounded(0, ge=-2**31, le=2**31 - 1)
    """Higher runs first when the scheduler orders by priority."""
    keep_versions: tuple[int, ...] = ()
    """Adapter versions of this task that its run dir keeps whatever the job's retention policy (`adapters:`
    keeps the last few, every N-th and the final one; e.g. [5, 12]). Each in [0, total_steps]."""

    def validate(self, prefix: str = "") -> "TaskSpec":
        """Checks every field; errors name it under `prefix` (the spec's place in its file, e.g. 'tasks[0]')."""
        with fields_under(prefix):
            self._validate()
        return self

    def _validate(self) -> None:
        for name in ("task_id", "tenant"):
            value = getattr(self, name)
            if not isinstance(value, str) or not _SAFE_NAME.match(value) or ".." in value:
                raise SpecError(name, f"{value!r} is not a safe name (letters, digits, '_', '-', '.'; "
                                      "no path separators or '..', at most 64 chars)")
        check_bounds(self)  # each field's bounds, beside it above
        if not isinstance(self.keep_versions, tuple):
            raise SpecError("keep_versions", f"must be a list of versions, got {self.keep_versions!r}")
        for i, version in enumerate(self.keep_versions):
            _int_at_least(version, 0, f"keep_versions[{i}]", high=self.total_steps)
        self.dataset.validate()
        self.prompt.validate()
        self.lora.validate()
        self.algo.validate()
        self._validate_overlong()

    def _validate_overlong(self) -> None:
        """The overlong buffer must fit under the length limit it punishes near (OverlongSpec)."""
        from marlaas_hpc.tasks.registry import ENV_TASK_KINDS

        overlong = self.algo.overlong
        if overlong is None:
            return
        multi_turn = self.dataset.kind in ENV_TASK_KINDS
        limit = self.algo.max_episode_tokens if multi_turn else self.algo.max_new_tokens
        if overlong.buffer_tokens > limit:
            name = "max_episode_tokens" if multi_turn else "max_new_tokens"
            raise SpecError("algo.overlong.buffer_tokens", f"{overlong.buffer_tokens} exceeds the length limit it "
                                                           f"ramps up to (algo.{name} = {limit})")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TaskSpec":
        """Builds and validates a spec from plain data (YAML); unknown or mistyped fields name themselves."""
        return load_config(cls, data, root="spec")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _int_at_least(value: Any, low: int, name: str, high: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise SpecError(name, f"must be an integer >= {low}, got {value!r}")
    if high is not None and value > high:
        raise SpecError(name, f"must be an integer <= {high}, got {value!r}")


def check_base_model(base_model: str | None, models: dict[str, str], field: str = "base_model") -> str:
    """The name of the job's model a task's `base_model` names (None: the first); SpecError naming `field` if it
    names none of them. A path is matched against the models' paths (a single `model:` job names its model by
    its path)."""
    if base_model is None:
        return next(iter(models))
    if base_model in models:
        return base_model
    for name, path in models.items():
        if _same_path(base_model, path):
            return name
    raise SpecError(field, f"unknown model {base_model!r}: it differs from the job's base model(s) "
                           f"{sorted(models)}")


def check_trained(model: str, group_models: list[str], field: str = "base_model") -> None:
    """SpecError naming `field` unless a trainer group loads `model` (`group_models`: each group's model,
    JobConfig.group_models)."""
    if model not in group_models:
        raise SpecError(field, f"no trainer group loads model {model!r} (layout.trainer_group_models: "
                               f"{group_models})")


def with_base_model(spec: TaskSpec, models: dict[str, str]) -> TaskSpec:
    """The spec with its `base_model` named as the job names it (None: the first model; a path: its name), as
    rank 0 admits it: summary.json, status.json and trainer placement read the name. SpecError as
    `check_base_model`."""
    return dataclasses.replace(spec, base_model=check_base_model(spec.base_model, models))


def _same_path(a: str, b: str) -> bool:
    from pathlib import Path

    return a == b or (Path(a).exists() and Path(b).exists() and Path(a).resolve() == Path(b).resolve())
