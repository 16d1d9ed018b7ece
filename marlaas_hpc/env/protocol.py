"""Environment protocol: an episode is reset(sample) -> prompt text, then step(model turn) until Final.

    env = environment_for(task)            # a fresh episode of the task
    prompt = env.reset(sample)
    result = env.step(model_turn_text)     # Observation: append result.text, generate the next turn
                                           # Final: the episode is over with result.reward in [0, 1]

A single-turn verifier task (any TaskData) is the one-step case: `SingleTurnEnv` scores the first turn.
Limits (`EpisodeLimits`) are enforced by the episode runner, which then asks the env for
`env.truncated(reason)`; the default is reward 0.0: an episode cut off by max_turns or max_total_tokens
never gave a final answer (and a runaway tool loop must not be rewarded).

Environments are per-episode objects and cheap to copy; the heavy, shared part (data, verifier, tools,
search index) lives in `env.task`. A process pool pickles the env without its task and re-attaches the
worker's copy of the task (see `EnvPool`).
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from marlaas_hpc.tasks.base import Sample, TaskData


@dataclass(frozen=True)
class Observation:
    """The episode continues: `text` is appended to the transcript (tokenised, masked out of the loss)."""

    text: str
    tool_calls: int = 0
    """Tool calls answered by this observation (well-formed or not)."""
    tool_errors: int = 0
    """Of those, calls that were malformed or failed."""
    timings: dict[str, float] = field(default_factory=dict)
    """Stage -> seconds spent in this step, e.g. {'tool:search': 0.002}."""


@dataclass(frozen=True)
class Final:
    """The episode is over."""

    reward: float
    reason: str = "answer"
    """'answer' (the verifier scored a final answer), 'max_turns' or 'max_tokens' (cut off by a limit)."""
    timings: dict[str, float] = field(default_factory=dict)
    """Stage -> seconds, e.g. {'reward': 0.01}."""


StepResult = Observation | Final


@dataclass(kw_only=True, frozen=True)
class EpisodeLimits:
    max_turns: int = 4
    """Model turns per episode; an observation after the last allowed turn ends the episode (truncated)."""
    max_total_tokens: int = 256
    """Prompt + model + tool tokens; a turn is cut to fit, an observation that does not fit ends the episode."""

    def validate(self) -> "EpisodeLimits":
        for name in ("max_turns", "max_total_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"episode.{name} must be an integer >= 1, got {value!r}")
        return self


class Environment(ABC):
    """One episode of a task."""

    def __init__(self, task: TaskData):
        self.task = task
        self.sample: Sample | None = None

    @abstractmethod
    def reset(self, sample: Sample) -> str:
        """Starts the episode on `sample`; returns the prompt text."""

    @abstractmethod
    def step(self, model_turn: str) -> StepResult:
        """Consumes one model turn (decoded text, without eos). Raises RewardError if the verifier fails."""

    def service_waits(self, model_turn: str) -> frozenset[str]:
        """Names of the tools that step(model_turn) will wait on a service for (`Tool.waits_on_service`): the
        env pool runs such a step on its I/O lane, not on a worker. Cheap and side-effect free; none by
        default."""
        return frozenset()

    def truncated(self, reason: str) -> Final:
        """The reward of an episode cut off by a limit ('max_turns' / 'max_tokens'): 0.0."""
        return Final(0.0, reason)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["task"] = None  # shared and heavy: a process pool re-attaches its own copy
        return state


class SingleTurnEnv(Environment):
    """A verifier task as a one-step episode: the first turn is the answer."""

    def reset(self, sample: Sample) -> str:
        self.sample = sample
        return sample.prompt

    def step(self, model_turn: str) -> Final:
        start = time.perf_counter()
        reward = self.task.reward(self.sample, model_turn)
        return Final(reward, "answer", {"reward": time.perf_counter() - start})


def environment_for(task: TaskData) -> Environment:
    """A fresh episode of `task`: its own environment if it has one (`new_env()`), else single-turn."""
    factory = getattr(task, "new_env", None)
    return factory() if callable(factory) else SingleTurnEnv(task)


def is_multi_turn(task: TaskData) -> bool:
    """True if the task's episodes may go on after the first turn (tool workloads)."""
    return not isinstance(environment_for(task), SingleTurnEnv)


def first_prompt(task: TaskData, sample: Sample) -> str:
    """The prompt text of an episode on `sample` (what `reset` returns; envs reset deterministically)."""
    return environment_for(task).reset(sample)


def episode_limits(algo) -> EpisodeLimits:
    """A task's episode limits from its AlgoSpec."""
    return EpisodeLimits(max_turns=algo.max_turns, max_total_tokens=algo.max_episode_tokens).validate()
