"""GRPO: group-relative advantages and the token-level PPO-clip loss (DESIGN.md §4).

Pure tensor functions: no model, no process groups. The clipped ratio is what keeps asynchronous
(off-policy by up to k versions) training stable.
"""
from __future__ import annotations

import torch

from marlaas_hpc.trajectory import Trajectory


def group_advantages(rewards: torch.Tensor, normalize_std: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """rewards [groups, G] -> reward minus its group's mean (optionally divided by the group's std)."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if normalize_std:
        centred = centred / (rewards.std(dim=1, keepdim=True) + eps)
    return centred


def assign_advantages(trajectories: list[Trajectory], normalize_std: bool = False) -> None:
    """Sets each trajectory's advantage from the rewards of its group (groups may arrive interleaved)."""
    groups: dict[str, list[Trajectory]] = {}
    for traj in trajectories:
        groups.setdefault(traj.group_id, []).append(traj)
    for members in groups.values():
        rewards = torch.tensor([[t.reward for t in members]], dtype=torch.float64)
        adv = group_advantages(rewards, normalize_std)[0] if len(members) > 1 else torch.zeros(1)
        for traj, value in zip(members, adv.tolist()):
            traj.advantage = value


def scored_group(task_id: str, group_id: str, prompt_ids: list[int], completions: list[list[int]],
                 logprobs: list[list[float]], version: int | None, rewards: list[float],
                 normalize_std: bool = False) -> list[Trajectory]:
    """The G trajectories of one prompt with their rewards and group-relative advantages.
    version None (base model, no adapter) is recorded as 0: the fresh adapter equals the base."""
    trajectories = [Trajectory(task_id, group_id, prompt_ids, completion, lps,
                               version if version is not None else 0, reward=reward)
                    for completion, lps, reward in zip(completions, logprobs, rewards)]
    assign_advantages(trajectories, normalize_std)
    return trajectories


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T)[label] per position; T <= 0 is treated as 1 (greedy has no density)."""
    scale = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits.float() / scale, dim=-1)
    return logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)


def grpo_loss(logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              clip_eps: float, kl_beta: float = 0.0, base_logp: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level PPO-clip loss averaged over every trained token of the batch.

    logp, behaviour_logp, mask, base_logp: [batch, seq]; advantages: [batch].
    """
    mask = mask.to(logp.dtype)
    n_tokens = mask.sum().clamp(min=1.0)
    ratio = torch.exp(logp - behaviour_logp)
    adv = advantages.to(logp.dtype).unsqueeze(-1)
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
    per_token = -surrogate
    stats = {}
    if kl_beta > 0:
        if base_logp is None:
            raise ValueError("kl_beta > 0 needs the base model's logprobs")
        delta = base_logp - logp
        kl = torch.exp(delta) - delta - 1.0  # k3 estimator of KL(pi_theta || pi_base), >= 0
        per_token = per_token + kl_beta * kl
        stats["kl"] = float((kl * mask).sum().detach() / n_tokens)
    loss = (per_token * mask).sum() / n_tokens
    with torch.no_grad():
        clipped = ((ratio - 1).abs() > clip_eps).to(logp.dtype)
        stats.update(loss=float(loss), clip_frac=float((clipped * mask).sum() / n_tokens),
                     ratio_mean=float((ratio * mask).sum() / n_tokens), tokens=float(n_tokens))
    return loss, stats
