"""What is counted about drafting (reporting lives with the trainer and the engine).

Conventions (vLLM's): the mean acceptance length tau counts the recovered/bonus token, so
tau = 1 + accepted / cycles, and 1 <= tau <= K + 1. The per-position acceptance alpha_k is
unconditional: the fraction of cycles whose first k drafts were all accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AcceptanceSummary:
    cycles: int
    accepted_tokens: int
    tau: float  # 1 + accepted_tokens / cycles (1.0 when no cycle ran)
    alpha: list[float]  # alpha_k, k = 1..K

    def as_dict(self, prefix: str = "") -> dict[str, float]:
        out = {f"{prefix}tau": self.tau, f"{prefix}cycles": float(self.cycles)}
        out.update({f"{prefix}alpha_{k + 1}": a for k, a in enumerate(self.alpha)})
        return out


def acceptance_summary(accepted: torch.Tensor, k: int) -> AcceptanceSummary:
    """accepted [R] (0..K) over any set of cycles -> tau and alpha_1..alpha_K."""
    accepted = accepted.reshape(-1).long()
    cycles = int(accepted.numel())
    if cycles == 0:
        return AcceptanceSummary(cycles=0, accepted_tokens=0, tau=1.0, alpha=[0.0] * k)
    total = int(accepted.sum())
    alpha = [float((accepted >= position).float().mean()) for position in range(1, k + 1)]
    return AcceptanceSummary(cycles=cycles, accepted_tokens=total, tau=1.0 + total / cycles, alpha=alpha)
