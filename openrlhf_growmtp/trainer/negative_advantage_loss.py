"""`--growmtp_neg_adv_weight`: upstream's policy loss with negative advantages down-weighted (upstream: models/loss)."""

from __future__ import annotations

import torch


class NegativeAdvantageWeightedLoss(torch.nn.Module):
    """Upstream's policy loss with the terms of negative-advantage tokens weighted by `weight`.

    Every branch of the PPO loss (clipped, dual-clipped, IS-corrected) is positively homogeneous in the
    advantage: scaling A by w > 0 scales that token's loss by w and changes no min/max/clip decision.
    So weighting the negative branch is exactly scaling negative advantages before upstream's loss.
    """

    def __init__(self, loss_fn: torch.nn.Module, weight: float):
        super().__init__()
        if not weight > 0:
            raise ValueError(f"the negative-advantage weight must be > 0, got {weight}")
        self.loss_fn, self.weight = loss_fn, weight

    def forward(self, log_probs, old_log_probs, advantages, *args, **kwargs):
        weighted = torch.where(advantages < 0, advantages * self.weight, advantages)
        return self.loss_fn(log_probs, old_log_probs, weighted, *args, **kwargs)
