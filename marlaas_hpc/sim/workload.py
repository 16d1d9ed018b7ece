"""Workload model of the simulator: what each stage costs, in a YAML file with explicit units.

    rollout:  per-token decode / prefill cost of one engine, continuous (or static) batching whose step time
              grows sub-linearly with the batch: step = decode_step * running_sequences ** batch_exponent
    env:      reward time per sample (a distribution)
    trainer:  step = (step_fixed + per_token * tokens + per_task * fused_tasks) * tp ** -tp_exponent
    network:  adapter delta = delta_latency + bytes / delta_bandwidth, bytes = adapter_bytes_per_rank * LoRA rank
    control:  world rank 0 handles one thing at a time: per scheduler event, per task admitted, per eval result
    profiles: per task kind (dataset.kind, or 'default'): prompt and response lengths, turns, tool latency, and
              the fraction of groups with equal rewards (dynamic sampling drops and replaces them)

Every time, size and bandwidth is written with its unit ('8 ms', '25 GB/s', '40 KB'); token counts are plain
numbers. `load_workload` refuses unknown fields, bare numbers, negative values and unknown distributions,
naming the field (e.g. ``rollout.decode_step``).
"""
from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from marlaas_hpc.sim.units import BANDWIDTH, SIZE, TIME, TOKENS, format_quantity, parse_quantity
from marlaas_hpc.config_loader import SpecError, check_fields, load_config

DISTRIBUTIONS = ("constant", "uniform", "lognormal", "exponential", "empirical")
BATCHING = ("continuous", "static")


def _unit(dimension: str, positive: bool = False):
    """Field metadata of a quantity written with its unit: the loader parses it ('8 ms' -> 0.008)."""
    return {"unit": dimension, "positive": positive,
            "parse": lambda value, name: _quantity(value, dimension, name, positive)}


def _random(dimension: str):
    """Field metadata of a Distribution of quantities (a plain quantity is a constant)."""
    return {"unit": dimension, "parse": lambda value, name: _distribution(value, dimension, name)}


@dataclass(kw_only=True, slots=True)
class Distribution:
    """A non-negative random quantity (seconds or tokens, by the field that holds it). A plain quantity
    ('5 ms', or a number of tokens) is shorthand for a constant."""

    dist: str = "constant"
    """'constant' (value), 'uniform' (low..high), 'lognormal' (median, sigma of log), 'exponential' (mean),
    'empirical' (values, drawn uniformly: what calibration writes)."""
    value: float = 0.0
    low: float = 0.0
    high: float = 0.0
    median: float = 0.0
    sigma: float = 0.0
    """Standard deviation of log(x) (lognormal; dimensionless)."""
    mean: float = 0.0
    values: tuple[float, ...] = ()
    cap: float | None = None
    """Upper clip of every draw (e.g. a response-length limit); None: none."""

    def sample(self, rng: random.Random) -> float:
        if self.dist == "constant":
            draw = self.value
        elif self.dist == "uniform":
            draw = rng.uniform(self.low, self.high)
        elif self.dist == "lognormal":
            draw = self.median * math.exp(rng.gauss(0.0, self.sigma))
        elif self.dist == "exponential":
            draw = rng.expovariate(1.0 / self.mean) if self.mean > 0 else 0.0
        else:
            draw = self.values[rng.randrange(len(self.values))]
        return draw if self.cap is None else min(draw, self.cap)

    def expected(self) -> float:
        """Mean of the uncapped distribution (reports and calibration checks)."""
        return {"constant": lambda: self.value, "uniform": lambda: (self.low + self.high) / 2,
                "lognormal": lambda: self.median * math.exp(self.sigma ** 2 / 2), "exponential": lambda: self.mean,
                "empirical": lambda: sum(self.values) / len(self.values)}[self.dist]()


@dataclass(kw_only=True, slots=True)
class RolloutModel:
    """One rollout rank (one inference engine serving every task's LoRA in one batch)."""

    batching: str = "continuous"
    """'continuous' (vLLM: sequences join and leave the running batch every step) or 'static' (HF generate:
    the queue runs as one batch until its longest row ends; arrivals wait for the next batch)."""
    decode_step: float = field(default=0.02, metadata=_unit(TIME, positive=True))
    """Engine step time at one running sequence (every running sequence gains one token per step)."""
    batch_exponent: float = 0.3
    """Sub-linear growth of the step with the batch: step = decode_step * sequences ** batch_exponent
    (0: free batching, 1: no batching gain)."""
    step_overhead: float = field(default=0.0, metadata=_unit(TIME))
    """Host time between engine steps (polling for work and deltas, handing out results): it slows decoding
    but is not busy time."""
    prefill_per_token: float = field(default=0.0, metadata=_unit(TIME))
    """Prefill cost per prompt (or tool-output) token; it stalls the engine's decoding."""
    max_running_sequences: int = 256
    """Sequences decoding at once (vLLM max_num_seqs); more wait in the engine's queue."""
    join_wait_steps: float = 0.5
    """Engine steps a delta broadcast waits, on average, for a busy rollout rank to join it (a rank joins
    between steps; 0.5 if the broadcast comes at a random point of a step)."""
    adapter_load: float = field(default=0.0, metadata=_unit(TIME))
    """Fixed cost of installing one adapter version on the engine (stalls decoding), on top of the transfer."""


@dataclass(kw_only=True, slots=True)
class EnvModel:
    """One env rank (CPU): scores groups one after another (a group's busy time on the rank)."""

    reward_per_sample: Distribution = field(default_factory=Distribution, metadata=_random(TIME))
    """Env-rank time of one episode: its env's reset and book-keeping, plus its verifier (and tool) time over
    the env pool's workers."""
    group_overhead: float = field(default=0.0, metadata=_unit(TIME))
    """Fixed cost of every group (a one-episode eval too): opening it, handing its episodes to the env pool,
    collecting them and sending the trajectories."""
    rollout_contention: float = field(default=0.0, metadata=_unit(TIME))
    """Extra time of scoring a group while its rollout rank decodes: on the CPU twin the ranks share the
    cores; with env ranks on CPU nodes of their own (a cluster) it is about 0."""
    trainer_contention: float = field(default=0.0, metadata=_unit(TIME))
    """Extra time of scoring a group while its task's trainer computes (as rollout_contention)."""


@dataclass(kw_only=True, slots=True)
class TrainerModel:
    """One trainer group (TP x DP GPUs; a job may have several, `trainer_groups`)."""

    step_fixed: float = field(default=0.1, metadata=_unit(TIME))
    """Cost of a (possibly fused) optimizer step independent of its size, at TP=1."""
    per_token: float = field(default=1e-4, metadata=_unit(TIME))
    """Forward + backward cost per trained token (prompt + completion), at TP=1."""
    per_task: float = field(default=0.0, metadata=_unit(TIME))
    """Extra cost of each task in a fused step (its adapter and its own optimizer), at TP=1."""
    overlap_cost: float = field(default=0.0, metadata=_unit(TIME))
    """Extra time of a step run while every rollout rank decodes (pro rata for fewer): on the CPU twin the
    ranks share cores; on GPUs it is about 0."""
    tp_exponent: float = 0.8
    """TP scaling: a step at TP=t costs its TP=1 time * t ** -tp_exponent (1: perfect scaling)."""
    admit: float = field(default=0.1, metadata=_unit(TIME))
    """Creating one task's adapter and optimizer (Admit), before its version 0 is published."""
    publish_fixed: float = field(default=0.0, metadata=_unit(TIME))
    """Per published version: checkpoint write and broadcast set-up (the transfer is in `network`)."""
    broadcast_setup: float = field(default=0.0, metadata=_unit(TIME))
    """Extra cost of each of a replica's first `warm_up_broadcasts` delta broadcasts (communicator set-up)."""
    warm_up_broadcasts: int = 1
    """How many first broadcasts pay `broadcast_setup`."""


@dataclass(kw_only=True, slots=True)
class NetworkModel:
    adapter_bytes_per_rank: float = field(default=1.26e6, metadata=_unit(SIZE))
    """Bytes of one task's adapter per unit of LoRA rank (depends on the base model and target modules)."""
    delta_bandwidth: float = field(default=25e9, metadata=_unit(BANDWIDTH, positive=True))
    """Bandwidth of the adapter-delta broadcast trainer -> rollout ranks."""
    delta_latency: float = field(default=0.0, metadata=_unit(TIME))
    """Fixed latency of one delta broadcast."""
    message_latency: float = field(default=0.0, metadata=_unit(TIME))
    """One control or data message between ranks (Generate, Scored, StepDone, trajectories...)."""


@dataclass(kw_only=True, slots=True)
class ControlModel:
    """World rank 0 (the scheduler rank), which handles one thing at a time: what arrives while it is busy waits
    its turn, and the commands of an event go out when its handling ends. Zero (the default): rank 0 is free."""

    per_event: float = field(default=0.0, metadata=_unit(TIME))
    """Rank 0's time per scheduler event: the scheduler's decision, the commands sent (a Generate's prompts
    rendered and tokenised), the records written, and its share of the status.json rewrites."""
    admit: float = field(default=0.0, metadata=_unit(TIME))
    """Per task submitted: its data loaded, its Submit handled, its Admit and base eval sent (the runtime submits
    a job's starting tasks one per turn of rank 0's loop, between events)."""
    eval_result: float = field(default=0.0, metadata=_unit(TIME))
    """Per result of one eval prompt (EvalDone)."""

    def free(self) -> bool:
        return self.per_event == self.admit == self.eval_result == 0.0


@dataclass(kw_only=True, slots=True)
class TaskProfile:
    """What one episode of a task kind looks like."""

    prompt_tokens: Distribution = field(default_factory=lambda: Distribution(value=64.0), metadata=_random(TOKENS))
    """Prompt length."""
    response_tokens: Distribution = field(default_factory=lambda: Distribution(value=128.0),
                                          metadata=_random(TOKENS))
    """Tokens generated per turn; clipped to the task's algo.max_new_tokens."""
    turns: int = 1
    """Model turns per episode; a tool call runs between consecutive turns (multi-turn: turns > 1)."""
    tool_latency: Distribution = field(default_factory=Distribution, metadata=_random(TIME))
    """Wall time of one tool call (waiting, not env-rank CPU)."""
    tool_output_tokens: Distribution = field(default_factory=Distribution, metadata=_random(TOKENS))
    """Tokens a tool call appends to the context (prefilled before the next turn)."""
    equal_reward_groups: float = 0.0
    """Fraction of prompt groups whose G rewards are all equal (every sample right, or every one wrong): a task
    with dynamic sampling (algo.dynamic_sampling) drops them after scoring and draws replacements, which cost
    rollout and env time but no trainer time. A run's own fraction is its metrics' skipped_rows / trajectories
    (rows with advantage 0). Tasks without dynamic sampling draw nothing from it."""


@dataclass(kw_only=True, slots=True)
class Workload:
    description: str = ""
    """Free text: where the figures come from (measured run, assumptions)."""
    rollout: RolloutModel = field(default_factory=RolloutModel)
    """Rollout engine costs."""
    env: EnvModel = field(default_factory=EnvModel)
    """Env rank costs."""
    trainer: TrainerModel = field(default_factory=TrainerModel)
    """Trainer costs."""
    network: NetworkModel = field(default_factory=NetworkModel)
    """Transfers and message latency."""
    control: ControlModel = field(default_factory=ControlModel)
    """World rank 0's time per event (the control plane)."""
    profiles: dict[str, TaskProfile] = field(default_factory=lambda: {"default": TaskProfile()})
    """Episode shape per task kind (a task's dataset.kind, else 'default')."""
    evals: bool = True
    """Simulate the runtime's greedy evals (dataset.eval_size prompts at admission and at the end)."""

    def validate(self, prefix: str = "") -> "Workload":
        """What the types alone do not say: the default profile, the batching, plain counts >= 1 and plain
        numbers finite and >= 0 (quantities with units are checked as they are parsed)."""
        if not isinstance(self.profiles, dict) or not self.profiles:
            raise SpecError("profiles", "must be a mapping of task kind -> profile")
        if "default" not in self.profiles:
            raise SpecError("profiles.default", "is required (the profile of task kinds not listed)")
        if self.rollout.batching not in BATCHING:
            raise SpecError("rollout.batching", f"unknown batching {self.rollout.batching!r}; known {BATCHING}")
        for name in _NESTED:
            _check_plain_numbers(getattr(self, name), name)
        for kind, profile in self.profiles.items():
            _check_plain_numbers(profile, f"profiles.{kind}")
            if not 0 <= profile.equal_reward_groups <= 1:
                raise SpecError(f"profiles.{kind}.equal_reward_groups",
                                f"must be a fraction in [0, 1], got {profile.equal_reward_groups!r}")
        return self

    def profile(self, kind: str) -> TaskProfile:
        return self.profiles.get(kind, self.profiles["default"])

    def to_dict(self) -> dict:
        return _dump(self)


# ---------------------------------------------------------------- loading
_NESTED = {"rollout": RolloutModel, "env": EnvModel, "trainer": TrainerModel, "network": NetworkModel,
           "control": ControlModel}


def load_workload(path: str | Path) -> Workload:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as exc:
        raise SpecError("workload", f"{path} is not valid YAML: {exc}") from None
    return workload_from_dict(data)


def workload_from_dict(data: Any) -> Workload:
    return load_config(Workload, data, root="workload")


def _check_plain_numbers(model: Any, prefix: str) -> None:
    for spec in dataclasses.fields(model):
        value = getattr(model, spec.name)
        if "unit" in spec.metadata or isinstance(value, (bool, str)):
            continue
        if isinstance(value, int):
            if value < 1:
                raise SpecError(f"{prefix}.{spec.name}", f"must be an integer >= 1, got {value!r}")
        else:
            _check_sign(value, f"{prefix}.{spec.name}")


def _check_sign(value: float, name: str, positive: bool = False) -> None:
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise SpecError(name, f"must be {'> 0' if positive else '>= 0'} (a duration, size or rate cannot be "
                              f"negative), got {value!r}")


def _distribution(value: Any, dimension: str, name: str) -> Distribution:
    if not isinstance(value, dict):
        return Distribution(value=_quantity(value, dimension, name))
    dist = value.get("dist", "constant")
    if dist not in DISTRIBUTIONS:
        raise SpecError(f"{name}.dist", f"unknown distribution {dist!r}; known: {list(DISTRIBUTIONS)}")
    check_fields(Distribution, value, name, f"{name}.")
    needs = {"constant": ("value",), "uniform": ("low", "high"), "lognormal": ("median", "sigma"),
             "exponential": ("mean",), "empirical": ("values",)}[dist]
    for key in needs:
        if key not in value:
            raise SpecError(f"{name}.{key}", f"is required by a {dist} distribution")
    kwargs: dict = {"dist": dist}
    for key, raw in value.items():
        if key in ("dist",):
            continue
        if key == "sigma":
            if isinstance(raw, bool) or not isinstance(raw, (int, float)):
                raise SpecError(f"{name}.sigma", f"must be a number (std of log, no unit), got {raw!r}")
            _check_sign(float(raw), f"{name}.sigma")
            kwargs[key] = float(raw)
        elif key == "values":
            if not isinstance(raw, list) or not raw:
                raise SpecError(f"{name}.values", "must be a non-empty list")
            kwargs[key] = tuple(_quantity(v, dimension, f"{name}.values[{i}]") for i, v in enumerate(raw))
        else:
            kwargs[key] = _quantity(raw, dimension, f"{name}.{key}")
    if dist == "uniform" and kwargs["low"] > kwargs["high"]:
        raise SpecError(f"{name}.low", f"low {kwargs['low']} exceeds high {kwargs['high']}")
    return Distribution(**kwargs)


def _quantity(value: Any, dimension: str, name: str, positive: bool = False) -> float:
    quantity = parse_quantity(value, dimension, name)
    _check_sign(quantity, name, positive)
    return quantity


# ---------------------------------------------------------------- writing (calibration output)
def _dump(obj) -> Any:
    if isinstance(obj, dict):
        return {key: _dump(value) for key, value in obj.items()}
    out = {}
    for spec in dataclasses.fields(obj):
        value = getattr(obj, spec.name)
        unit = spec.metadata.get("unit")
        if isinstance(value, Distribution):
            out[spec.name] = _dump_distribution(value, unit)
        elif dataclasses.is_dataclass(value) or isinstance(value, dict):
            out[spec.name] = _dump(value)
        elif unit is not None:
            out[spec.name] = format_quantity(value, unit)
        else:
            out[spec.name] = value
    return out


def _dump_distribution(dist: Distribution, unit: str) -> Any:
    def q(x):
        return round(x, 6) if unit == TOKENS else format_quantity(x, unit)

    keys = {"constant": ("value",), "uniform": ("low", "high"), "lognormal": ("median", "sigma"),
            "exponential": ("mean",), "empirical": ("values",)}[dist.dist]
    out: dict = {"dist": dist.dist}
    for key in keys:
        value = getattr(dist, key)
        out[key] = round(value, 4) if key == "sigma" else [q(v) for v in value] if key == "values" else q(value)
    if dist.cap is not None:
        out["cap"] = q(dist.cap)
    return out
