"""Each task's objective (`algo.loss`): a small pure function over one task's trained tokens of a micro-batch, in a
registry (`OBJECTIVES`), as `dataset.kind` has one. tasks/registry.py names them and gives the values their unset
fields take; this module computes them (docs/architecture.md §10; the table: docs/configuration.md). Pure tensor
functions: no model, no process groups.

With r = pi_theta / pi_old per token, A the group-relative advantage of the token's sequence (env/shaping.py),
eps_l, eps_h the ratio's clip (`algo.clip_low`, `algo.clip_high`) and w the mismatch weight (TIS or IcePop,
below; 1 when both are off):

    grpo     -w min(r A, clip(r, 1 - eps_l, 1 + eps_h) A) [+ beta KL] per token, averaged over the task's trained
             tokens (this project's GRPO since its start: the token mean of TRL's 'dapo' / verl's 'token-mean';
             DeepSeekMath averages each sequence first)                                            unit: token
    dapo     the same token-level loss (DAPO §3.3); the rest of DAPO is its defaults: clip-higher (eps_h 0.28),
             dynamic sampling (scheduler/sampling.py); overlong shaping (env/shaping.py) is opt-in   unit: token
    dr_grpo  the same per-token term, summed and divided by a constant, sequences x max_new_tokens (Dr. GRPO
             and its code; its other fix, advantages without the std, is its default)               unit: sequence
    gspo     per sequence: s = exp(mean_t log r_t), -w_s min(s A, clip(s, 1 - eps_l, 1 + eps_h) A)
             [+ beta mean_t KL], averaged over sequences (GSPO's objective)                     unit: sequence
    cispo    -w sg(clip(r, 1 - eps_l, 1 + eps_h)) A log pi_theta [+ beta KL] per token, averaged over the task's
             trained tokens (MiniMax-M1's CISPO; sg: no gradient through the clipped ratio, so no token loses
             its gradient to the clip; default eps_l 1.0: no lower clip)                        unit: token

Each returns its loss normalised over the micro-batch's own units (its trained tokens, or its sequences with
trained tokens) and its statistics. The trainer weights each micro-batch's loss by its share of the task's units
in the whole step, so a task's loss is its objective over its whole batch, whatever the micro-batching, the DP
split or the other tasks fused into the step.

pi_old is the rollout engine's behaviour logprob (`Tokens.behaviour`) when TIS and IcePop are off. With either it
is the trainer's own logprob at the token's behaviour version (`Tokens.old`), and w weighs the rollout engine's
mismatch at the same version, k = exp(old - behaviour), without gradient (gspo: k of the geometric mean over the
sequence's tokens, as its ratio); the ratio then measures policy lag in the trainer's numerics only:

    TIS      `algo.tis_cap` C: w = min(k, C)
    IcePop   `algo.icepop_band` [a, b]: w = k where a <= k <= b, else 0: a token the two engines disagree on
             gets no gradient, its KL term's included; it still counts in the normaliser, as in IcePop's
             objective (and so the trainer's units, counted before the forward, stay right)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from marlaas_hpc.tasks.registry import OBJECTIVES as OBJECTIVE_NAMES
from marlaas_hpc.tasks.spec import AlgoSpec


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T)[label] per position; T <= 0 is treated as 1 (greedy has no density)."""
    scale = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits.float() / scale, dim=-1)
    return logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)


@dataclass
class Tokens:
    """One task's trained tokens of one micro-batch: 1-D float tensors over tokens (`sequence`: long)."""

    logp: torch.Tensor
    """log pi_theta at the train version: the tensor the gradient flows through."""
    behaviour: torch.Tensor
    """The rollout engine's logprobs, at each token's behaviour version."""
    advantages: torch.Tensor
    """The advantage of each token's sequence."""
    mask: torch.Tensor
    """1 for a trained token, 0 for one that is not (tool output)."""
    sequence: torch.Tensor
    """Index (0 .. n_sequences - 1) of each token's sequence."""
    n_sequences: int
    old: torch.Tensor | None = None
    """TIS or IcePop only: the trainer's logprobs at each token's behaviour version (no gradient)."""
    base: torch.Tensor | None = None
    """KL only: the base model's logprobs."""

    @classmethod
    def from_rows(cls, logp, behaviour, advantages, mask, old=None, base=None) -> "Tokens":
        """From [sequences, positions] tensors, one sequence per row; `advantages` per row or per position."""
        rows, width = logp.shape
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(-1).expand(rows, width)
        sequence = torch.arange(rows).unsqueeze(-1).expand(rows, width)

        def flat(tensor):
            return None if tensor is None else tensor.reshape(-1)

        return cls(flat(logp), flat(behaviour), flat(advantages).to(logp.dtype), flat(mask).to(logp.dtype),
                   flat(sequence), rows, flat(old), flat(base))


# ---------------------------------------------------------------------------------------------- the pieces
def kl_penalty(logp: torch.Tensor, base: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_base) from d = log pi_base - log pi_theta on tokens sampled from
    pi_theta: k1 = -d (unbiased, any sign), k2 = d^2 / 2, k3 = e^d - d - 1 (unbiased, >= 0)."""
    delta = base - logp
    if estimator == "k3":
        return torch.exp(delta) - delta - 1.0
    if estimator == "k2":
        return 0.5 * delta * delta
    return -delta


def tis_weight(old: torch.Tensor, behaviour: torch.Tensor, cap: float) -> torch.Tensor:
    """min(pi_trainer / pi_rollout, cap) from log-probabilities (or mean log-ratios of sequences)."""
    return torch.clamp(torch.exp(old - behaviour), max=cap)


def icepop_weight(old: torch.Tensor, behaviour: torch.Tensor, band: tuple[float, float]) -> torch.Tensor:
    """k = pi_trainer / pi_rollout where low <= k <= high, else 0 (IcePop's M(k)), from log-probabilities (or mean
    log-ratios of sequences)."""
    ratio = torch.exp(old - behaviour)
    inside = (ratio >= band[0]) & (ratio <= band[1])
    return torch.where(inside, ratio, torch.zeros_like(ratio))


def mismatch_weight(old: torch.Tensor, behaviour: torch.Tensor, algo: AlgoSpec) -> torch.Tensor:
    """The weight of each token (or sequence) for the rollout engine / trainer mismatch: TIS's or IcePop's."""
    if algo.icepop_band is not None:
        return icepop_weight(old, behaviour, algo.icepop_band)
    return tis_weight(old, behaviour, algo.tis_cap)


def _clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, algo: AlgoSpec) -> torch.Tensor:
    return torch.minimum(ratio * advantages, torch.clamp(ratio, 1 - algo.clip_low, 1 + algo.clip_high) * advantages)


def _ppo_clip_term(ratio: torch.Tensor, logp: torch.Tensor, advantages: torch.Tensor, algo: AlgoSpec) -> torch.Tensor:
    """grpo, dapo, dr_grpo: -min(r A, clip(r) A); a token whose clip binds gets no gradient."""
    return -_clipped_surrogate(ratio, advantages, algo)


def _cispo_term(ratio: torch.Tensor, logp: torch.Tensor, advantages: torch.Tensor, algo: AlgoSpec) -> torch.Tensor:
    """CISPO: -sg(clip(r)) A log pi_theta. The clipped ratio is a coefficient without gradient, so a token whose
    ratio is clipped still has the gradient -clip(r) A of its log-probability (PPO-clip would give it none)."""
    weight = torch.clamp(ratio, 1 - algo.clip_low, 1 + algo.clip_high).detach()
    return -weight * advantages * logp


def _outside_clip(ratio: torch.Tensor, algo: AlgoSpec) -> torch.Tensor:
    return (ratio - 1 > algo.clip_high) | (1 - ratio > algo.clip_low)


def _token_terms(tokens: Tokens, algo: AlgoSpec, mask: torch.Tensor, n_tokens: torch.Tensor,
                 stats: dict[str, float], term=_ppo_clip_term) -> tuple[torch.Tensor, torch.Tensor]:
    """(each token's loss term, each token's ratio) of the token-level objectives; `term` is the objective's
    term of one token from its ratio, logprob and advantage."""
    ratio = torch.exp(tokens.logp - (tokens.behaviour if tokens.old is None else tokens.old))
    per_token = term(ratio, tokens.logp, tokens.advantages.to(tokens.logp.dtype), algo)
    weight = None
    if tokens.old is not None:
        weight = mismatch_weight(tokens.old, tokens.behaviour, algo)
        per_token = per_token * weight
        _tis_stats(tokens, algo, weight, mask, n_tokens, stats)
    if algo.kl_beta > 0:
        kl = _icepop_masked(kl_penalty(tokens.logp, _base(tokens), algo.kl_estimator), weight, algo)
        per_token = per_token + algo.kl_beta * kl
        stats["kl"] = float((kl * mask).sum().detach() / n_tokens)
    return per_token, ratio


def _tis_stats(tokens: Tokens, algo: AlgoSpec, weight: torch.Tensor, units: torch.Tensor, n_units: torch.Tensor,
               stats: dict[str, float]) -> None:
    """What TIS or IcePop corrects, per trained token: |log pi_trainer - log pi_rollout| at the behaviour version;
    the mean weight it gave over the objective's units (`units`: 1 for a unit that counts, a trained token or, for
    gspo, a sequence with trained tokens); IcePop: the share of those units it masked out (weight 0)."""
    with torch.no_grad():
        mask = tokens.mask.to(tokens.old.dtype)
        stats["tis_mismatch"] = float(((tokens.old - tokens.behaviour).abs() * mask).sum() / mask.sum().clamp(min=1.0))
        stats["tis_weight"] = float((weight * units).sum() / n_units)
        if algo.icepop_band is not None:
            stats["icepop_masked"] = float(((weight == 0).to(units.dtype) * units).sum() / n_units)


def _icepop_masked(kl: torch.Tensor, weight: torch.Tensor | None, algo: AlgoSpec) -> torch.Tensor:
    """The KL terms, 0 where IcePop masked the token (gspo: the sequence) out of the loss."""
    if weight is None or algo.icepop_band is None:
        return kl
    return kl * (weight > 0).to(kl.dtype)


def _base(tokens: Tokens) -> torch.Tensor:
    if tokens.base is None:
        raise ValueError("kl_beta > 0 needs the base model's logprobs")
    return tokens.base


def _token_stats(loss, ratio, mask, n_tokens, algo: AlgoSpec, stats: dict[str, float]) -> dict[str, float]:
    with torch.no_grad():
        clipped = _outside_clip(ratio, algo).to(mask.dtype)
        stats.update(loss=float(loss), clip_frac=float((clipped * mask).sum() / n_tokens),
                     ratio_mean=float((ratio * mask).sum() / n_tokens), tokens=float(n_tokens))
    return stats


# ---------------------------------------------------------------------------------------------- objectives
def grpo_loss(tokens: Tokens, algo: AlgoSpec) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level PPO-clip averaged over every trained token (grpo, dapo)."""
    return _token_mean(tokens, algo, _ppo_clip_term)


def cispo_loss(tokens: Tokens, algo: AlgoSpec) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1): -sg(clip(r)) A log pi_theta averaged over every trained token."""
    return _token_mean(tokens, algo, _cispo_term)


def _token_mean(tokens: Tokens, algo: AlgoSpec, term) -> tuple[torch.Tensor, dict[str, float]]:
    mask = tokens.mask.to(tokens.logp.dtype)
    n_tokens = mask.sum().clamp(min=1.0)
    stats: dict[str, float] = {}
    per_token, ratio = _token_terms(tokens, algo, mask, n_tokens, stats, term)
    loss = (per_token * mask).sum() / n_tokens
    return loss, _token_stats(loss, ratio, mask, n_tokens, algo, stats)


def dr_grpo_loss(tokens: Tokens, algo: AlgoSpec) -> tuple[torch.Tensor, dict[str, float]]:
    """Dr. GRPO: the token-level PPO-clip terms summed and divided by a constant, (sequences x max_new_tokens):
    no sequence's tokens weigh more for being in a short sequence, and none less for a long one."""
    mask = tokens.mask.to(tokens.logp.dtype)
    n_tokens = mask.sum().clamp(min=1.0)
    stats: dict[str, float] = {}
    per_token, ratio = _token_terms(tokens, algo, mask, n_tokens, stats)
    sequences = (_per_sequence(tokens, mask) > 0).sum().clamp(min=1)
    loss = (per_token * mask).sum() / (sequences * algo.max_new_tokens)
    return loss, _token_stats(loss, ratio, mask, n_tokens, algo, stats)


def gspo_loss(tokens: Tokens, algo: AlgoSpec) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO: one ratio per sequence, s = (prod_t pi_theta / pi_old)^(1/|y|), clipped per sequence; the mean
    over the sequences with trained tokens."""
    mask = tokens.mask.to(tokens.logp.dtype)
    counts = _per_sequence(tokens, mask)
    valid = (counts > 0).to(mask.dtype)
    n_sequences = valid.sum().clamp(min=1.0)
    length = counts.clamp(min=1.0)
    reference = tokens.behaviour if tokens.old is None else tokens.old
    ratio = torch.exp(_per_sequence(tokens, (tokens.logp - reference) * mask) / length)
    advantages = torch.zeros(tokens.n_sequences, dtype=mask.dtype, device=mask.device).scatter_reduce(
        0, tokens.sequence, tokens.advantages.to(mask.dtype), reduce="amax", include_self=False)
    per_sequence = -_clipped_surrogate(ratio, advantages, algo)
    weight = None
    stats: dict[str, float] = {}
    if tokens.old is not None:
        mean_log_weight = _per_sequence(tokens, (tokens.old - tokens.behaviour) * mask) / length
        weight = mismatch_weight(mean_log_weight, torch.zeros_like(mean_log_weight), algo)
        per_sequence = per_sequence * weight
        _tis_stats(tokens, algo, weight, valid, n_sequences, stats)
    if algo.kl_beta > 0:
        kl = _per_sequence(tokens, kl_penalty(tokens.logp, _base(tokens), algo.kl_estimator) * mask) / length
        kl = _icepop_masked(kl, weight, algo)
        per_sequence = per_sequence + algo.kl_beta * kl
        stats["kl"] = float((kl * valid).sum().detach() / n_sequences)
    loss = (per_sequence * valid).sum() / n_sequences
    return loss, _token_stats(loss, ratio, valid, n_sequences, algo, stats) | {"tokens": float(mask.sum())}


def _per_sequence(tokens: Tokens, values: torch.Tensor) -> torch.Tensor:
    """Sums of `values` (one per token) over each sequence's tokens."""
    out = torch.zeros(tokens.n_sequences, dtype=values.dtype, device=values.device)
    return out.index_add(0, tokens.sequence, values)


@dataclass(frozen=True)
class Objective:
    loss: Callable[[Tokens, AlgoSpec], tuple[torch.Tensor, dict[str, float]]]
    unit: str
    """What the loss averages over: 'token' (trained tokens) or 'sequence' (sequences with trained tokens); a
    micro-batch's loss weighs its share of the task's units in the step."""

    def units(self, trained_tokens: int) -> int:
        """The units of one sequence with `trained_tokens` trained tokens."""
        return trained_tokens if self.unit == "token" else int(trained_tokens > 0)


OBJECTIVES: dict[str, Objective] = {
    "grpo": Objective(grpo_loss, "token"),
    "dr_grpo": Objective(dr_grpo_loss, "sequence"),
    "dapo": Objective(grpo_loss, "token"),
    "gspo": Objective(gspo_loss, "sequence"),
    "cispo": Objective(cispo_loss, "token"),
}
if set(OBJECTIVES) != set(OBJECTIVE_NAMES):  # the names a spec may give are the ones computed here
    raise ImportError(f"objectives {sorted(OBJECTIVES)} differ from tasks/registry.py's {sorted(OBJECTIVE_NAMES)}")
