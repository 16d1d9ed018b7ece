"""From a scored prompt group to what the trainer learns from: the training rewards (the verifier's, plus DAPO's
overlong punishment when the task asks for it, `algo.overlong`), the group-relative advantages, and whether the
group carries a learning signal at all (dynamic sampling drops it when not: scheduler/sampling.py).

The env rank (runtime/env_rank.py) and the single-process driver call `score_group` once per group. Records keep
the verifier's reward (`Trajectory.reward`); only the advantage sees the shaping.
"""
from __future__ import annotations

from marlaas_hpc.tasks.spec import AlgoSpec
from marlaas_hpc.trajectory import Trajectory, group_advantages


def training_rewards(trajectories: list[Trajectory], algo: AlgoSpec, multi_turn: bool) -> list[float]:
    """The rewards the advantages come from: the verifier's, minus the overlong penalty (OverlongSpec) of a
    completion near its limit: `max_new_tokens` over the completion of a single-turn task, `max_episode_tokens`
    over the whole episode (prompt, model and tool tokens) of a multi-turn one, as the env truncates them."""
    if algo.overlong is None:
        return [traj.reward for traj in trajectories]
    limit = algo.max_episode_tokens if multi_turn else algo.max_new_tokens
    return [traj.reward + algo.overlong.penalty_at(_length(traj, multi_turn), limit) for traj in trajectories]


def _length(traj: Trajectory, multi_turn: bool) -> int:
    return len(traj.prompt_ids) + len(traj.completion_ids) if multi_turn else len(traj.completion_ids)


def score_group(trajectories: list[Trajectory], algo: AlgoSpec, multi_turn: bool = False) -> bool:
    """Sets the advantages of ONE prompt group's trajectories (a group of one gets 0) from its training rewards;
    returns whether the group is informative: its training rewards are not all equal. (Equal rewards centre to
    exactly 0 only up to rounding, ~1e-17: the test is on the rewards, not on the advantages.)"""
    rewards = training_rewards(trajectories, algo, multi_turn)
    advantages = group_advantages(rewards, algo.std_normalized) if len(rewards) > 1 else [0.0] * len(rewards)
    for traj, advantage in zip(trajectories, advantages):
        traj.advantage = advantage
    return len(set(rewards)) > 1
