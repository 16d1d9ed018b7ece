"""GRPO: the token-level PPO-clip loss (docs/architecture.md §10); the group-relative advantages are in trajectory.py.

Pure tensor functions: no model, no process groups. The clipped ratio is what keeps asynchronous
(off-policy by up to k versions) training stable.
"""
from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T)[label] per position; T <= 0 is treated as 1 (greedy has no density)."""
    scale = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits.float() / scale, dim=-1)
    return logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)


def grpo_loss(logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              clip_eps: float, kl_beta: float = 0.0, base_logp: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level PPO-clip loss averaged over every trained token of the batch.

    logp, behaviour_logp, mask, base_logp: one shape ([batch, seq], or [tokens] as the trainer's packed batches
    give them); advantages: one per token (that shape) or one per sequence ([batch] for [batch, seq]).
    """
    mask = mask.to(logp.dtype)
    n_tokens = mask.sum().clamp(min=1.0)
    ratio = torch.exp(logp - behaviour_logp)
    adv = advantages.to(logp.dtype)
    if adv.dim() == logp.dim() - 1:
        adv = adv.unsqueeze(-1)
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
