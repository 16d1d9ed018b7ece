"""Each objective (trainer/objectives.py) against a reference written from its paper's formula, in float64 loops
over sequences and tokens, on fixed tensors: masks (a tool token mid-sequence, padding), per-token and
per-sequence advantages, ratios clipped on both sides and ratios the clip does not bind; CISPO and IcePop by hand;
TIS, KL estimators; and 'grpo' bit for bit against the loss the trainer used before objectives existed."""
import math

import pytest
import torch

from marlaas_hpc.tasks import AlgoSpec, SpecError, TaskSpec
from marlaas_hpc.tasks.spec import OverlongSpec
from marlaas_hpc.tasks.registry import OBJECTIVES as OBJECTIVE_NAMES
from marlaas_hpc.trainer.objectives import OBJECTIVES, Tokens, kl_penalty

# Four sequences of up to 5 tokens. Ratios pi/pi_old hit every case of the clip for eps (0.2, 0.28):
# 1.5 and 0.6 are outside it, 1.1 / 0.9 inside, 1.25 between the symmetric and the clip-higher bound.
RATIOS = torch.tensor([[1.5, 1.1, 0.6, 1.25, 1.0],
                       [0.6, 1.5, 0.9, 1.25, 1.0],
                       [1.3, 0.7, 1.0, 1.0, 1.0],
                       [1.05, 0.95, 1.15, 1.0, 1.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1, 1, 1],
                     [1, 1, 0, 1, 0],  # a tool token (not trained) mid-sequence, then padding
                     [1, 1, 0, 0, 0],
                     [1, 1, 1, 0, 0]], dtype=torch.float64)
ADV_SEQ = torch.tensor([1.0, -1.0, 0.5, 0.0])  # per sequence: positive, negative, and 0 (adds nothing)
ADV_TOKEN = torch.tensor([[1.0, -1.0, -1.0, 0.5, 0.0],
                          [-1.0, 1.0, 2.0, -0.5, 0.0],
                          [-0.5, -2.0, 0.0, 0.0, 0.0],
                          [0.3, 0.3, -0.7, 0.0, 0.0]])
BEHAVIOUR = torch.log(torch.tensor([[0.3, 0.5, 0.2, 0.4, 0.9],
                                    [0.25, 0.1, 0.3, 0.3, 0.8],
                                    [0.6, 0.45, 0.5, 0.5, 0.5],
                                    [0.2, 0.3, 0.4, 0.5, 0.5]], dtype=torch.float64))
LOGP = BEHAVIOUR + torch.log(RATIOS)
BASE = BEHAVIOUR + 0.3 * torch.sin(torch.arange(20, dtype=torch.float64).view(4, 5))


def _tokens(advantages, old=None, base=None, dtype=torch.float32):
    logp = LOGP.to(dtype).clone().requires_grad_()
    cast = (lambda t: None if t is None else t.to(dtype))
    return logp, Tokens.from_rows(logp, BEHAVIOUR.to(dtype), advantages.to(dtype), MASK.to(dtype), cast(old),
                                  cast(base))


def _rows(advantages):
    """(sequence i, token t) over trained tokens, with the advantage of the token."""
    for i in range(MASK.shape[0]):
        for t in range(MASK.shape[1]):
            if MASK[i, t]:
                yield i, t, float(advantages[i] if advantages.dim() == 1 else advantages[i, t])


def _clip_min(ratio, advantage, low, high):
    return torch.minimum(ratio * advantage, torch.clamp(ratio, 1 - low, 1 + high) * advantage)


def _kl3(logp, i, t):
    d = BASE[i, t] - logp[i, t]
    return torch.exp(d) - d - 1


# ---------------------------------------------------------------------------------------------- references
def reference_token_mean(logp, advantages, low, high, beta=0.0, old=None, cap=None):
    """DAPO's objective (token-level: 1 / sum_i |o_i| over sum_i sum_t), with the project's k3 KL term of GRPO
    (DeepSeekMath) and, with `old`, TIS: min(pi_old / pi_behaviour, cap) x the clipped term against
    pi_old (Yao et al. 2025)."""
    total, count = 0.0, 0
    for i, t, adv in _rows(advantages):
        reference = BEHAVIOUR[i, t] if old is None else old[i, t]
        term = _clip_min(torch.exp(logp[i, t] - reference), adv, low, high)
        if old is not None:
            term = term * min(math.exp(float(old[i, t] - BEHAVIOUR[i, t])), cap)
        total = total - term + beta * _kl3(logp, i, t)
        count += 1
    return total / count


def reference_dr_grpo(logp, advantages, low, high, max_tokens):
    """Dr. GRPO (Liu et al. 2025, and its code): sum_i sum_t of the clipped term over G x max tokens."""
    total = sum(-_clip_min(torch.exp(logp[i, t] - BEHAVIOUR[i, t]), adv, low, high)
                for i, t, adv in _rows(advantages))
    return total / (MASK.shape[0] * max_tokens)


def reference_gspo(logp, advantages, low, high, old=None, cap=None):
    """GSPO's objective: s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|), J = 1/G sum_i min(s_i A_i, clip(s_i) A_i); with TIS,
    each sequence weighed by min of its length-normalised pi_old / pi_behaviour, and cap."""
    total = 0.0
    for i in range(MASK.shape[0]):
        trained = [t for t in range(MASK.shape[1]) if MASK[i, t]]
        reference = BEHAVIOUR if old is None else old
        log_s = sum(logp[i, t] - reference[i, t] for t in trained) / len(trained)
        term = _clip_min(torch.exp(log_s), float(advantages[i]), low, high)
        if old is not None:
            term = term * min(math.exp(sum(float(old[i, t] - BEHAVIOUR[i, t]) for t in trained) / len(trained)), cap)
        total = total - term
    return total / MASK.shape[0]


def _check(loss, logp, reference_loss, reference_logp):
    """Loss and gradient (w.r.t. every logprob) equal the float64 reference's."""
    loss.backward()
    reference_loss.backward()
    assert float(loss.detach()) == pytest.approx(float(reference_loss.detach()), rel=1e-6, abs=1e-7)
    assert torch.allclose(logp.grad.double(), reference_logp.grad, rtol=1e-5, atol=1e-7)


def _reference_logp():
    return LOGP.clone().requires_grad_()


# ---------------------------------------------------------------------------------------------- the objectives
def test_the_registry_computes_every_objective_a_spec_may_name():
    assert set(OBJECTIVES) == set(OBJECTIVE_NAMES) == {"grpo", "dr_grpo", "dapo", "gspo", "cispo"}


@pytest.mark.parametrize("advantages", [ADV_SEQ, ADV_TOKEN], ids=["per-sequence", "per-token"])
@pytest.mark.parametrize("loss, low, high", [("grpo", 0.2, 0.2), ("dapo", 0.2, 0.28)])
def test_token_level_losses_equal_the_papers(loss, low, high, advantages):
    algo = AlgoSpec(loss=loss)
    assert (algo.clip_low, algo.clip_high) == (low, high)  # DAPO's clip-higher is its default
    logp, tokens = _tokens(advantages)
    value, stats = OBJECTIVES[loss].loss(tokens, algo)
    reference = _reference_logp()
    _check(value, logp, reference_token_mean(reference, advantages, low, high), reference)
    outside = ((RATIOS > 1 + high) | (RATIOS < 1 - low)).double()
    assert stats["clip_frac"] == pytest.approx(float((outside * MASK).sum() / MASK.sum()))
    # where the clip binds (ratio above 1 + eps_h with A > 0, below 1 - eps_l with A < 0) a token gets no
    # gradient; outside the clip with the other sign of A, the min takes the unclipped side: it does
    adv = (advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages).expand(4, 5).double()
    binds = ((RATIOS > 1 + high) & (adv > 0)) | ((RATIOS < 1 - low) & (adv < 0))
    free = MASK.bool() & ~binds & (adv != 0)
    assert (MASK.bool() & binds).any() and (free & ((RATIOS > 1 + high) | (RATIOS < 1 - low))).any()
    assert (logp.grad[MASK.bool() & binds] == 0).all() and (logp.grad[free] != 0).all()


def test_clip_higher_lets_a_rare_token_rise_further():
    """Ratio 1.25 with A > 0 is clipped at eps 0.2 (no gradient), not at DAPO's eps_high 0.28."""
    logp, tokens = _tokens(ADV_SEQ)
    OBJECTIVES["grpo"].loss(tokens, AlgoSpec(loss="grpo"))[0].backward()
    assert logp.grad[0, 3] == 0
    logp, tokens = _tokens(ADV_SEQ)
    OBJECTIVES["dapo"].loss(tokens, AlgoSpec(loss="dapo"))[0].backward()
    assert logp.grad[0, 3] != 0


@pytest.mark.parametrize("advantages", [ADV_SEQ, ADV_TOKEN], ids=["per-sequence", "per-token"])
def test_dr_grpo_equals_the_paper(advantages):
    algo = AlgoSpec(loss="dr_grpo", max_new_tokens=6)
    logp, tokens = _tokens(advantages)
    value, _ = OBJECTIVES["dr_grpo"].loss(tokens, algo)
    reference = _reference_logp()
    _check(value, logp, reference_dr_grpo(reference, advantages, 0.2, 0.2, 6), reference)


def test_dr_grpo_weighs_every_token_alike_whatever_its_sequence_length():
    """The point of Dr. GRPO: a token's gradient does not grow as its sequence gets shorter."""
    logp, tokens = _tokens(torch.ones(4))
    OBJECTIVES["dr_grpo"].loss(tokens, AlgoSpec(loss="dr_grpo", clip_eps=0.9))[0].backward()
    scale = logp.grad / torch.exp(LOGP - BEHAVIOUR).float()  # d(-r A)/d log pi = -r A: divide the ratio out
    assert torch.allclose(scale[MASK.bool()], scale[0, 0].expand(int(MASK.sum())))


@pytest.mark.parametrize("eps", [(3e-4, 4e-4), (0.2, 0.28)], ids=["paper", "wide"])
def test_gspo_equals_the_paper(eps):
    low, high = eps
    algo = AlgoSpec(loss="gspo", clip_eps=low, clip_eps_high=high)
    # ratios per sequence: exp(mean log r) = 1.063, 0.98, 0.916, 1.063: the paper's tiny eps clips all but the
    # zero-advantage one; the wide eps clips none
    logp, tokens = _tokens(ADV_SEQ)
    value, stats = OBJECTIVES["gspo"].loss(tokens, algo)
    reference = _reference_logp()
    _check(value, logp, reference_gspo(reference, ADV_SEQ, low, high), reference)
    assert OBJECTIVES["gspo"].unit == "sequence" and stats["clip_frac"] == (1.0 if low < 0.01 else 0.0)


def test_gspo_defaults_are_the_papers():
    algo = AlgoSpec(loss="gspo")
    assert (algo.clip_low, algo.clip_high, algo.std_normalized, algo.filters_groups) == (3e-4, 4e-4, True, False)
    assert AlgoSpec(loss="dr_grpo").std_normalized is False
    assert AlgoSpec(loss="gspo", clip_eps=0.1).clip_high == 0.1  # the paper's pair applies only as a pair


def _one_row(ratios, behaviour, advantages, mask=None, old_minus_behaviour=None, base=None):
    """Tokens of one sequence, float64: log pi_theta = log pi_old + log r, where pi_old is the behaviour
    probability, or with `old_minus_behaviour` (log k per token) the trainer's: behaviour + log k."""
    behaviour = torch.log(torch.tensor([behaviour], dtype=torch.float64))
    old = None if old_minus_behaviour is None else behaviour + torch.tensor([old_minus_behaviour], dtype=torch.float64)
    logp = ((behaviour if old is None else old) + torch.log(torch.tensor([ratios], dtype=torch.float64)))
    logp = logp.clone().requires_grad_()
    mask = torch.ones_like(behaviour) if mask is None else torch.tensor([mask], dtype=torch.float64)
    return logp, Tokens.from_rows(logp, behaviour, torch.tensor([advantages], dtype=torch.float64), mask, old, base)


def test_cispo_by_hand():
    """CISPO's defaults: eps_l 1.0 (the clip's lower side at 0: none), eps_h 0.28. Ratios 2, 1, 0.5 and a tool
    token; pi_old 0.5, so log pi_theta = log(0.5 r) = 0, log 0.5, log 0.25. Clipped weights c = 1.28, 1, 0.5.
        loss = -(1/3) sum_t c_t A_t log pi_t = -(1/3) (1.28 * 1 * 0 + 1 * (-1) * log 0.5 + 0.5 * 2 * log 0.25)
             = -(1/3) (ln 2 - 2 ln 2) = ln 2 / 3
        d loss / d log pi_t = -c_t A_t / 3 = -1.28/3, 1/3, -1/3, and 0 for the tool token.
    Token 0 is clipped with A > 0: PPO-clip gives it no gradient, CISPO its clipped weight's. Differentiating
    the coefficient as well would give token 1 -(A r (log pi + 1)) / 3 = (1 - ln 2) / 3 instead of 1/3."""
    algo = AlgoSpec(loss="cispo")
    assert (algo.clip_low, algo.clip_high, algo.std_normalized, algo.filters_groups) == (1.0, 0.28, True, False)
    assert OBJECTIVES["cispo"].unit == "token"
    logp, tokens = _one_row([2.0, 1.0, 0.5, 1.5], [0.5] * 4, [1.0, -1.0, 2.0, 1.0], mask=[1, 1, 1, 0])
    loss, stats = OBJECTIVES["cispo"].loss(tokens, algo)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(math.log(2) / 3, rel=1e-12)
    assert logp.grad[0].tolist() == pytest.approx([-1.28 / 3, 1 / 3, -1 / 3, 0.0], rel=1e-12, abs=1e-15)
    assert stats["clip_frac"] == pytest.approx(1 / 3) and stats["tokens"] == 3.0
    logp, tokens = _one_row([2.0, 1.0, 0.5, 1.5], [0.5] * 4, [1.0, -1.0, 2.0, 1.0], mask=[1, 1, 1, 0])
    OBJECTIVES["dapo"].loss(tokens, AlgoSpec(loss="dapo"))[0].backward()
    assert logp.grad[0, 0] == 0  # the same token under PPO-clip (eps_h 0.28): clipped, no gradient


def test_cispo_equals_the_paper_on_the_shared_tensors():
    """Against MiniMax-M1's objective written out over (sequence, token), with a lower clip set (0.8 .. 1.2): every
    trained token with A != 0 has a gradient, clipped or not."""
    algo = AlgoSpec(loss="cispo", clip_eps=0.2)
    logp, tokens = _tokens(ADV_TOKEN)
    value, _ = OBJECTIVES["cispo"].loss(tokens, algo)
    reference = _reference_logp()
    terms = [-torch.clamp(torch.exp(reference[i, t] - BEHAVIOUR[i, t]), 0.8, 1.2).detach() * adv * reference[i, t]
             for i, t, adv in _rows(ADV_TOKEN)]
    _check(value, logp, sum(terms) / len(terms), reference)
    moving = MASK.bool() & (ADV_TOKEN != 0)
    assert ((RATIOS > 1.2) | (RATIOS < 0.8))[moving].any() and (logp.grad[moving] != 0).all()


def test_icepop_masks_exactly_the_tokens_outside_its_band_by_hand():
    """k = pi_trainer / pi_rollout = 0.25, 0.5, 1, 2, 4 against the band [0.4, 3]: the first and the last are
    masked, the others weighted by k. pi_theta = pi_trainer (r = 1, inside the clip), A = 1:
        loss = -(1/5) sum_t w_t r_t A = -(0 + 0.5 + 1 + 2 + 0) / 5 = -0.7
        d loss / d log pi_t = -w_t r_t A / 5 = 0, -0.1, -0.2, -0.4, 0
    The masked tokens still count in the normaliser (1/5, not 1/3), as in IcePop's objective."""
    algo = AlgoSpec(loss="grpo", icepop_band=(0.4, 3.0))
    assert algo.mismatch_correction == "IcePop"
    log_k = [math.log(k) for k in (0.25, 0.5, 1.0, 2.0, 4.0)]
    logp, tokens = _one_row([1.0] * 5, [0.2] * 5, [1.0] * 5, old_minus_behaviour=log_k)
    loss, stats = OBJECTIVES["grpo"].loss(tokens, algo)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-0.7, rel=1e-12)
    assert logp.grad[0].tolist() == pytest.approx([0.0, -0.1, -0.2, -0.4, 0.0], rel=1e-12)
    assert logp.grad[0, 0] == 0 and logp.grad[0, 4] == 0
    assert stats["icepop_masked"] == pytest.approx(0.4) and stats["tis_weight"] == pytest.approx(0.7)
    # CISPO the same: its weight c = 1 at r = 1, so the gradient is the same; with a KL term a masked token
    # still gets none (it is out of the loss)
    base = torch.log(torch.full((1, 5), 0.3, dtype=torch.float64))
    logp, tokens = _one_row([1.0] * 5, [0.2] * 5, [1.0] * 5, old_minus_behaviour=log_k, base=base)
    OBJECTIVES["cispo"].loss(tokens, AlgoSpec(loss="cispo", icepop_band=(0.4, 3.0), kl_beta=0.1))[0].backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 4] == 0 and (logp.grad[0, 1:4] != 0).all()


def test_icepop_masks_gspo_by_the_sequences_k():
    """gspo weighs a sequence, by k of its geometric mean (as its ratio): k = (0.25, 4) gives 1, kept; (4, 4) gives
    4, masked. r = 1, A = 1: loss = -(1 + 0) / 2 = -0.5; d loss / d log pi_t = -(1/2) s A / |y| = -0.25 for the
    first sequence's tokens, 0 for the second's."""
    algo = AlgoSpec(loss="gspo", icepop_band=(0.5, 2.0))
    behaviour = torch.log(torch.full((2, 2), 0.2, dtype=torch.float64))
    old = behaviour + torch.log(torch.tensor([[0.25, 4.0], [4.0, 4.0]], dtype=torch.float64))
    logp = old.clone().requires_grad_()
    tokens = Tokens.from_rows(logp, behaviour, torch.ones(2, dtype=torch.float64), torch.ones(2, 2), old)
    loss, stats = OBJECTIVES["gspo"].loss(tokens, algo)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-0.5, rel=1e-12)
    assert logp.grad.reshape(-1).tolist() == pytest.approx([-0.25, -0.25, 0.0, 0.0], rel=1e-12)
    assert stats["icepop_masked"] == 0.5


# ---------------------------------------------------------------------------------------------- TIS and KL
def test_tis_weights_and_ratios_against_the_trainers_logprobs():
    old = BEHAVIOUR + torch.tensor([0.4, -0.3, 0.1, 2.0, 0.0]).expand(4, 5).double()  # weight 2.0 capped at 1.6
    algo = AlgoSpec(loss="dapo", tis_cap=1.6)
    logp, tokens = _tokens(ADV_SEQ, old=old)
    value, _ = OBJECTIVES["dapo"].loss(tokens, algo)
    reference = _reference_logp()
    _check(value, logp, reference_token_mean(reference, ADV_SEQ, 0.2, 0.28, old=old, cap=1.6), reference)
    logp, tokens = _tokens(ADV_SEQ, old=old)
    value, _ = OBJECTIVES["gspo"].loss(tokens, AlgoSpec(loss="gspo", tis_cap=1.6))
    reference = _reference_logp()
    _check(value, logp, reference_gspo(reference, ADV_SEQ, 3e-4, 4e-4, old=old, cap=1.6), reference)


@pytest.mark.parametrize("correction", [{"tis_cap": 2.0}, {"icepop_band": (0.5, 2.0)}], ids=["tis", "icepop"])
@pytest.mark.parametrize("loss", sorted(OBJECTIVE_NAMES))
def test_tis_leaves_the_update_unchanged_when_the_two_logprobs_are_equal(loss, correction):
    """pi_trainer = pi_rollout at the behaviour version: weight 1 (IcePop: k = 1 is in its band), the same ratio,
    bit for bit."""
    plain_logp, plain = _tokens(ADV_TOKEN if loss != "gspo" else ADV_SEQ)
    value, _ = OBJECTIVES[loss].loss(plain, AlgoSpec(loss=loss))
    value.backward()
    tis_logp, tis = _tokens(ADV_TOKEN if loss != "gspo" else ADV_SEQ, old=BEHAVIOUR)
    tis_value, _ = OBJECTIVES[loss].loss(tis, AlgoSpec(loss=loss, **correction))
    tis_value.backward()
    assert torch.equal(value, tis_value) and torch.equal(plain_logp.grad, tis_logp.grad)


@pytest.mark.parametrize("estimator, formula", [("k1", lambda d: -d), ("k2", lambda d: d * d / 2),
                                                ("k3", lambda d: math.exp(d) - d - 1)])
def test_kl_estimators_are_schulmans(estimator, formula):
    logp, base = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -1.0, -0.5])
    values = kl_penalty(logp, base, estimator)
    assert values.tolist() == pytest.approx([formula(float(b - a)) for a, b in zip(logp, base)], rel=1e-6, abs=1e-7)


def test_grpo_with_kl_equals_deepseekmath_token_mean():
    logp, tokens = _tokens(ADV_SEQ, base=BASE)
    value, stats = OBJECTIVES["grpo"].loss(tokens, AlgoSpec(kl_beta=0.1))
    reference = _reference_logp()
    _check(value, logp, reference_token_mean(reference, ADV_SEQ, 0.2, 0.2, beta=0.1), reference)
    assert stats["kl"] > 0


# ---------------------------------------------------------------------------------------------- grpo as before
def todays_grpo_loss(logp, behaviour_logp, advantages, mask, clip_eps, kl_beta=0.0, base_logp=None):
    """trainer/grpo.py `grpo_loss` as it was before objectives existed (commit 7898092), kept verbatim as the
    reference the default objective must reproduce bit for bit."""
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
        delta = base_logp - logp
        kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + kl_beta * kl
        stats["kl"] = float((kl * mask).sum().detach() / n_tokens)
    loss = (per_token * mask).sum() / n_tokens
    with torch.no_grad():
        clipped = ((ratio - 1).abs() > clip_eps).to(logp.dtype)
        stats.update(loss=float(loss), clip_frac=float((clipped * mask).sum() / n_tokens),
                     ratio_mean=float((ratio * mask).sum() / n_tokens), tokens=float(n_tokens))
    return loss, stats


@pytest.mark.parametrize("kl_beta", [0.0, 0.05])
@pytest.mark.parametrize("advantages", [ADV_SEQ, ADV_TOKEN], ids=["per-sequence", "per-token"])
def test_grpo_is_todays_loss_bit_for_bit(kl_beta, advantages):
    """As the trainer calls it: float32 tokens of packed rows, one advantage per token."""
    logp, tokens = _tokens(advantages, base=BASE)
    value, stats = OBJECTIVES["grpo"].loss(tokens, AlgoSpec(loss="grpo", kl_beta=kl_beta))
    value.backward()
    flat = LOGP.float().reshape(-1).clone().requires_grad_()
    old_value, old_stats = todays_grpo_loss(flat, tokens.behaviour, tokens.advantages, tokens.mask, 0.2,
                                            kl_beta, tokens.base)
    old_value.backward()
    assert torch.equal(value, old_value) and torch.equal(logp.grad.reshape(-1), flat.grad)
    assert stats == old_stats


# ---------------------------------------------------------------------------------------------- the specs
@pytest.mark.parametrize("algo, field", [
    ({"loss": "ppo"}, "algo.loss"),
    ({"kl_estimator": "k4"}, "algo.kl_estimator"),
    ({"tis_cap": 0.5}, "algo.tis_cap"),
    ({"tis_cap": float("nan")}, "algo.tis_cap"),
    ({"clip_eps_high": 1.5}, "algo.clip_eps_high"),
    ({"clip_eps": 0.3, "clip_eps_high": 0.2}, "algo.clip_eps_high"),
    ({"loss": "dapo", "clip_eps": 0.3, "clip_eps_high": 0.28}, "algo.clip_eps_high"),
    ({"dynamic_sampling": "yes"}, "algo.dynamic_sampling"),
    ({"dynamic_sampling_patience": 0}, "algo.dynamic_sampling_patience"),
    ({"overlong": {"buffer_tokens": 0}}, "algo.overlong.buffer_tokens"),
    ({"overlong": {"penalty": 1.0}}, "algo.overlong.buffer_tokens"),
    ({"overlong": {"buffer_tokens": 4, "penalty": -1}}, "algo.overlong.penalty"),
    ({"max_new_tokens": 8, "overlong": {"buffer_tokens": 9}}, "algo.overlong.buffer_tokens"),
    ({"loss": "cispo", "clip_eps_high": 1.5}, "algo.clip_eps_high"),
    ({"icepop_band": [1.5, 2.0]}, "algo.icepop_band"),  # the band must hold k = 1 (the engines agree)
    ({"icepop_band": [0.5, 1.0]}, "algo.icepop_band"),
    ({"icepop_band": [0.0, 2.0]}, "algo.icepop_band"),
    ({"icepop_band": [2.0, 0.5]}, "algo.icepop_band"),
    ({"icepop_band": [0.5, float("inf")]}, "algo.icepop_band"),
    ({"icepop_band": [0.5]}, "algo.icepop_band"),
    ({"icepop_band": 2.0}, "algo.icepop_band"),
    ({"icepop_band": [0.5, 2.0], "tis_cap": 2.0}, "algo.icepop_band"),  # both weigh the token: one of them
])
def test_bad_objective_fields_are_refused_naming_the_field(algo, field):
    with pytest.raises(SpecError) as error:
        TaskSpec.from_dict({"task_id": "t", "dataset": {"kind": "addition"}, "algo": algo})
    assert error.value.field == field


def test_objective_fields_load_from_yaml_data():
    spec = TaskSpec.from_dict({"task_id": "t", "dataset": {"kind": "lookup"}, "algo": {
        "loss": "dapo", "tis_cap": 2, "kl_estimator": "k2", "overlong": {"buffer_tokens": 64, "penalty": 0.5}}})
    algo = spec.algo
    assert (algo.loss, algo.tis_cap, algo.kl_estimator, algo.filters_groups) == ("dapo", 2.0, "k2", True)
    assert algo.overlong.penalty_at(256 - 64, 256) == 0.0 and algo.overlong.penalty_at(256 - 32, 256) == -0.25
    assert algo.overlong.penalty_at(256, 256) == -0.5  # multi-turn: the episode budget is the limit
    algo = TaskSpec.from_dict({"task_id": "t", "algo": {"loss": "cispo", "icepop_band": [0.5, 5]}}).algo
    assert (algo.loss, algo.icepop_band, algo.mismatch_correction) == ("cispo", (0.5, 5.0), "IcePop")
    # cispo's lower clip may stay wider than its upper one (its paper leaves it open); the PPO-clip ones' not
    assert TaskSpec.from_dict({"task_id": "t", "algo": {"loss": "cispo", "clip_eps": 0.5}}).algo.clip_high == 0.5
    spec = TaskSpec.from_dict({"task_id": "t", "algo": {"loss": "cispo", "clip_eps": 0.5, "clip_eps_high": 0.2}})
    assert (spec.algo.clip_low, spec.algo.clip_high) == (0.5, 0.2)


# ---------------------------------------------------------------------------------------------- rewards
def _group(lengths, rewards, prompt=3):
    from marlaas_hpc.trajectory import Trajectory

    return [Trajectory("t", "t/g0", [1] * prompt, [2] * n, [0.0] * n, 0, reward=r) for n, r in zip(lengths, rewards)]


def test_overlong_shaping_is_dapos_soft_punishment_and_advantages_see_it():
    """DAPO's soft overlong punishment with L_max = 8, L_cache = 4: lengths 4 -> 0, 6 -> -0.5, 8 -> -1 (x penalty 1); the verifier's
    reward stays on the trajectory, the advantage comes from the shaped one."""
    from marlaas_hpc.env.shaping import score_group, training_rewards

    spec = TaskSpec.from_dict({"task_id": "t", "dataset": {"kind": "addition"}, "algo": {
        "max_new_tokens": 8, "normalize_adv_std": False, "overlong": {"buffer_tokens": 4}}})
    group = _group([4, 6, 8, 8], [1.0, 1.0, 1.0, 0.0])
    assert training_rewards(group, spec.algo, multi_turn=False) == [1.0, 0.5, 0.0, -1.0]
    assert score_group(group, spec.algo) is True
    assert [t.advantage for t in group] == [0.875, 0.375, -0.125, -1.125] and [t.reward for t in group] == [1, 1, 1, 0]
    # multi-turn: the episode's prompt + completion against max_episode_tokens (256): length 255 of 256
    multi = TaskSpec.from_dict({"task_id": "t", "dataset": {"kind": "lookup"}, "algo": {
        "overlong": {"buffer_tokens": 4, "penalty": 2.0}}}).algo
    assert training_rewards(_group([250, 252], [1.0, 1.0], prompt=3), multi, multi_turn=True) == [0.5, -0.5]


def test_a_group_is_informative_unless_its_training_rewards_are_all_equal():
    from marlaas_hpc.env.shaping import score_group

    algo = AlgoSpec(max_new_tokens=8)
    assert score_group(_group([3, 5], [0.1, 0.1]), algo) is False  # centred: ~1e-17, not 0: rewards decide
    assert score_group(_group([3, 5], [1.0, 0.0]), algo) is True
    shaped = AlgoSpec(max_new_tokens=8, overlong=OverlongSpec(buffer_tokens=4))
    assert score_group(_group([3, 8], [1.0, 1.0]), shaped) is True  # the length penalty tells them apart
