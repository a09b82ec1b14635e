"""The paper's GRPO loss: negative-advantage weight and dual clip, against hand-computed values.

Six tokens with ratio r = exp(log_probs - old_log_probs), clip 0.2 (r clipped to [0.8, 1.2]), dual clip
c = 3 (for A < 0 the per-token objective is max(min(rA, clip(r)A), cA)); the per-token loss is its
negative, and token-level averaging divides the masked sum by the number of tokens.

    token   A     r     min(rA, clip(r)A)   dual: max(., 3A)   loss   loss with weight 0.5 (A -> A/2)
    1      +1    1.5    1.2                  -                 -1.2   -1.2
    2      +1    0.5    0.5                  -                 -0.5   -0.5
    3      -1    1.5   -1.5                 -1.5                1.5    0.75
    4      -1    4.0   -4.0                 -3.0 (dual bound)   3.0    1.5
    5      -1    0.5   -0.8                 -0.8                0.8    0.4
    6       0    2.0    0                    0                  0      0
"""

from __future__ import annotations

import math

import pytest
import torch

from helpers.trainer import cpu_support  # noqa: F401  (the CPU layer before openrlhf.models is imported)

from openrlhf.models.loss import PolicyLoss  # noqa: E402

from openrlhf_growmtp.trainer.negative_advantage_loss import NegativeAdvantageWeightedLoss  # noqa: E402

RATIOS = [1.5, 0.5, 1.5, 4.0, 0.5, 2.0]
ADVANTAGES = [1.0, 1.0, -1.0, -1.0, -1.0, 0.0]


def batch():
    old = torch.zeros(1, 6)
    new = torch.tensor([RATIOS]).log()
    return new, old, torch.tensor([ADVANTAGES]), torch.ones(1, 6)


def loss_of(loss_fn, mask=None) -> float:
    new, old, adv, ones = batch()
    loss, *_ = loss_fn(new, old, adv, action_mask=ones if mask is None else mask)
    return float(loss)


@pytest.mark.parametrize("dual_clip, weight, per_token", [
    (None, 1.0, [-1.2, -0.5, 1.5, 4.0, 0.8, 0.0]),
    (3.0, 1.0, [-1.2, -0.5, 1.5, 3.0, 0.8, 0.0]),
    (None, 0.5, [-1.2, -0.5, 0.75, 2.0, 0.4, 0.0]),
    (3.0, 0.5, [-1.2, -0.5, 0.75, 1.5, 0.4, 0.0]),
])
def test_token_mean_loss_matches_hand_computed(dual_clip, weight, per_token):
    upstream = PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.2, dual_clip=dual_clip, token_level_loss=True)
    loss_fn = upstream if weight == 1.0 else NegativeAdvantageWeightedLoss(upstream, weight)
    assert math.isclose(loss_of(loss_fn), sum(per_token) / 6, rel_tol=1e-6)
    # token-level averaging: masking tokens 1 and 4 leaves the mean over the four others
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0, 1.0]])
    kept = [per_token[i] for i in (1, 2, 4, 5)]
    assert math.isclose(loss_of(loss_fn, mask), sum(kept) / 4, rel_tol=1e-6)


def test_weight_leaves_positive_advantage_gradients_alone_and_scales_negative_ones():
    upstream = PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.2, dual_clip=3.0, token_level_loss=True)
    grads = []
    for loss_fn in (upstream, NegativeAdvantageWeightedLoss(upstream, 0.5)):
        new, old, adv, ones = batch()
        new.requires_grad_(True)
        loss, *_ = loss_fn(new, old, adv, action_mask=ones)
        loss.backward()
        grads.append(new.grad[0])
    plain, weighted = grads
    positive, negative = torch.tensor(ADVANTAGES) > 0, torch.tensor(ADVANTAGES) < 0
    torch.testing.assert_close(weighted[positive], plain[positive])
    torch.testing.assert_close(weighted[negative], 0.5 * plain[negative])
    assert plain[3] == 0.0  # token 4 sits on the dual-clip bound: constant in r, no gradient


def test_weight_must_be_positive():
    with pytest.raises(ValueError, match="must be > 0"):
        NegativeAdvantageWeightedLoss(PolicyLoss(), 0.0)
