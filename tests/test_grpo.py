"""GRPO advantages and the clipped token-level loss (objective 'grpo'), checked against hand-computed values."""
import math

import pytest
import torch

from marlaas_hpc.tasks import AlgoSpec
from marlaas_hpc.trainer.objectives import Tokens, grpo_loss as objective_grpo, token_logprobs
from marlaas_hpc.trajectory import Trajectory, assign_advantages, group_advantages


def test_group_advantages_centre_and_scale():
    assert group_advantages([1.0, 0.0, 0.0, 1.0]) == [0.5, -0.5, -0.5, 0.5]
    assert group_advantages([1.0, 1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0, 0.0]
    scaled = group_advantages([1.0, 0.0, 0.0, 1.0], normalize_std=True)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64).std().item()  # sample std, as torch computes it
    assert scaled == pytest.approx([x / (std + 1e-6) for x in (0.5, -0.5, -0.5, 0.5)], rel=1e-12)
    assert group_advantages([1.0, 1.0, 1.0], normalize_std=True) == [0.0, 0.0, 0.0]


def test_assign_advantages_by_group_even_when_interleaved():
    trajs = [Trajectory("t", f"g{i % 2}", [1], [2], [0.0], 0, reward=float(i < 2)) for i in range(4)]
    assign_advantages(trajs)
    # g0 = rewards (1, 0) -> (+.5, -.5); g1 = (1, 0) -> (+.5, -.5)
    assert [t.advantage for t in trajs] == [0.5, 0.5, -0.5, -0.5]


def grpo_loss(logp, behaviour, advantages, mask, clip_eps, kl_beta=0.0, base_logp=None):
    """The objective 'grpo' on [sequences, positions] tensors."""
    algo = AlgoSpec(clip_eps=clip_eps, kl_beta=kl_beta)
    return objective_grpo(Tokens.from_rows(logp, behaviour, advantages, mask, base=base_logp), algo)


def test_loss_equals_hand_computed_clip():
    logp = torch.log(torch.tensor([[0.5, 0.9], [0.2, 0.3]]))
    behaviour = torch.log(torch.tensor([[0.25, 0.9], [0.4, 0.3]]))  # ratios 2.0, 1.0 | 0.5, 1.0
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, stats = grpo_loss(logp, behaviour, adv, mask, clip_eps=0.2)
    # row0: min(2*1, 1.2*1)=1.2, min(1,1)=1 ; row1: min(0.5*-1, 0.8*-1) = -0.8 ; masked out last
    expected = -(1.2 + 1.0 - 0.8) / 3
    assert math.isclose(loss.item(), expected, rel_tol=1e-6)
    assert math.isclose(stats["clip_frac"], 2 / 3, rel_tol=1e-6)


def test_gradient_is_zero_where_clipped_and_kl_pulls_to_base():
    logp = torch.log(torch.tensor([[0.5]])).requires_grad_()
    behaviour = torch.log(torch.tensor([[0.25]]))
    loss, _ = grpo_loss(logp, behaviour, torch.tensor([1.0]), torch.ones(1, 1), clip_eps=0.2)
    loss.backward()
    assert logp.grad.abs().item() == 0.0  # ratio 2 > 1.2 with positive advantage: no push further
    logp2 = torch.log(torch.tensor([[0.5]])).requires_grad_()
    base = torch.log(torch.tensor([[0.25]]))
    loss2, stats = grpo_loss(logp2, logp2.detach(), torch.tensor([0.0]), torch.ones(1, 1), 0.2,
                             kl_beta=1.0, base_logp=base)
    loss2.backward()
    assert stats["kl"] > 0 and logp2.grad.item() > 0  # descending moves logp towards the base's lower value


def test_token_logprobs_temperature():
    logits = torch.tensor([[[2.0, 0.0, -1.0]]])
    labels = torch.tensor([[0]])
    for temp in (1.0, 0.5):
        expected = torch.log_softmax(logits / temp, -1)[0, 0, 0]
        assert torch.allclose(token_logprobs(logits, labels, temp)[0, 0], expected)
