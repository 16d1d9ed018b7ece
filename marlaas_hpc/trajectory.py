"""The data-plane record: one sampled completion, scored, on its way to the trainer."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Trajectory:
    task_id: str
    group_id: str
    """Completions of the same prompt share a group id (GRPO advantages are relative to the group)."""
    prompt_ids: list[int]
    completion_ids: list[int]
    """Everything after the prompt: model tokens and, in multi-turn episodes, tool observations."""
    behaviour_logprobs: list[float]
    """Sampling logprob per completion token (0.0 where loss_mask is 0)."""
    behaviour_version: int
    """Policy version of the adapter that sampled every model token of this trajectory."""
    reward: float = 0.0
    advantage: float = 0.0
    loss_mask: list[int] | None = None
    """1 for model tokens that are trained, 0 for tool output; None = all ones."""

    def mask(self) -> list[int]:
        return self.loss_mask if self.loss_mask is not None else [1] * len(self.completion_ids)

    def check(self) -> None:
        n = len(self.completion_ids)
        if len(self.behaviour_logprobs) != n or len(self.mask()) != n:
            raise ValueError(f"trajectory of {self.task_id}: {n} completion tokens but "
                             f"{len(self.behaviour_logprobs)} logprobs and {len(self.mask())} mask entries")
