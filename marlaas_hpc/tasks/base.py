"""What a task's data looks like to the rest of the system: prompts in, a verifier's reward out."""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Sample:
    """One prompt of a task with what the verifier needs to score a completion."""

    index: int
    prompt: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict, compare=False)


class RewardError(RuntimeError):
    """A reward function raised or returned something outside [0, 1]; the task fails, others go on."""


class TaskData(ABC):
    """A task's seeded train stream, fixed eval split and verifier."""

    kind: str = ""

    @abstractmethod
    def train_sample(self, cursor: int) -> Sample:
        """The cursor-th training sample (deterministic; the stream cycles or never ends)."""

    @abstractmethod
    def eval_samples(self) -> list[Sample]:
        """The held-out split used for eval accuracy."""

    @abstractmethod
    def score(self, sample: Sample, completion: str) -> float:
        """Raw reward of a completion (the text the model produced, without special tokens)."""

    def completion_tokens(self, sample: Sample, samples: int) -> list[int] | None:
        """The lengths a kind sets for the `samples` completions of this prompt (tasks/synthetic.py `long_tail`:
        the engine then samples exactly that many tokens each, capped by `algo.max_new_tokens`, stop tokens
        included); None (every other kind): up to `algo.max_new_tokens`, ending at a stop token."""
        return None

    def reward(self, sample: Sample, completion: str) -> float:
        """Checked reward in [0, 1]; anything else raises RewardError naming the task kind."""
        try:
            value = float(self.score(sample, completion))
        except RewardError:  # a sandboxed tenant function's own account of what went wrong
            raise
        except Exception as exc:  # a user reward function may raise anything
            raise RewardError(f"reward function of {self.kind!r} task raised {type(exc).__name__}: {exc}") from exc
        if math.isnan(value) or not 0.0 <= value <= 1.0:
            raise RewardError(f"reward function of {self.kind!r} task returned {value!r}, outside [0, 1]")
        return value
