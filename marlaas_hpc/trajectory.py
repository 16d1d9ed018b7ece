"""The data-plane record: one sampled completion, scored, on its way to the trainer, and GRPO's group-relative
advantages over such records (plain Python: the env rank, which computes them, needs no torch)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


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
    routes: Any = None
    """Routing replay (`algo.routing_replay`, mixture-of-experts models): the experts the rollout engine chose for
    each position it fed, an int16 array [positions, MoE layers, top k] (numpy: this module imports no torch).
    Positions are the prompt's and the completion's, the last completion token's optional (the engine samples it
    but feeds it to no forward): len(prompt_ids) + len(completion_ids) - 1 or + 0 rows. None: not recorded
    (every task without replay, which pays nothing for it)."""

    def mask(self) -> list[int]:
        return self.loss_mask if self.loss_mask is not None else [1] * len(self.completion_ids)

    def check(self) -> None:
        n = len(self.completion_ids)
        if len(self.behaviour_logprobs) != n or len(self.mask()) != n:
            raise ValueError(f"trajectory of {self.task_id}: {n} completion tokens but "
                             f"{len(self.behaviour_logprobs)} logprobs and {len(self.mask())} mask entries")
        if self.routes is not None:
            fed = len(self.prompt_ids) + n
            if len(getattr(self.routes, "shape", ())) != 3 or not fed - 1 <= self.routes.shape[0] <= fed:
                raise ValueError(f"trajectory of {self.task_id}: routes of shape {getattr(self.routes, 'shape', None)}"
                                 f" for {fed} positions (want [{fed - 1} or {fed}, MoE layers, top k])")


def group_advantages(rewards: list[float], normalize_std: bool = False, eps: float = 1e-6) -> list[float]:
    """One group's rewards -> each minus the group's mean; with normalize_std, divided by the group's sample
    standard deviation (n - 1) + eps. Sums are exact (fsum): the result does not depend on summation order."""
    mean = math.fsum(rewards) / len(rewards)
    centred = [reward - mean for reward in rewards]
    if normalize_std:
        std = math.sqrt(math.fsum(c * c for c in centred) / (len(rewards) - 1)) if len(rewards) > 1 else math.nan
        centred = [c / (std + eps) for c in centred]
    return centred


def assign_advantages(trajectories: list[Trajectory], normalize_std: bool = False) -> None:
    """Sets each trajectory's advantage from the rewards of its group (groups may arrive interleaved); a group
    of one gets 0."""
    groups: dict[str, list[Trajectory]] = {}
    for traj in trajectories:
        groups.setdefault(traj.group_id, []).append(traj)
    for members in groups.values():
        advantages = group_advantages([t.reward for t in members], normalize_std) if len(members) > 1 else [0.0]
        for traj, value in zip(members, advantages):
            traj.advantage = value
