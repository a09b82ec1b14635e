"""The head update of one rank's records inside the policy's training step, and what it reports.

`update_head` runs the core's head update (`core.head_loss.head_loss_backward`) on this rank's records with
the ranks in lockstep, and scales its backward so that the head's gradient is the summed loss over the
update's cycles on every rank, divided by `cycles_per_step` (by default those cycles' count: the mean
loss). DeepSpeed averages gradients over the data-parallel ranks and divides each backward by the
gradient-accumulation steps; each rank's core loss is the mean over its own cycles, so the backward is
scaled by ranks x accumulation steps x this rank's cycles / `cycles_per_step`. A trainer that calls once
per micro-batch passes the mean number of cycles per optimizer step, so that each optimizer step's
gradient is its cycles' summed loss over that mean.

No openrlhf or DeepSpeed import here: the caller's `Lockstep` carries DeepSpeed's engine backward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

from ...core.head import MTPHead
from ...core.head_loss import HeadLossConfig, HeadLossStats, alpha_means, head_loss_backward, measure_head_loss
from ...core.lockstep import Lockstep
from ...core.objectives import chain_lengths
from ...core.records import SequenceRecord


@dataclass(frozen=True)
class HeadUpdateConfig:
    loss_config: HeadLossConfig = HeadLossConfig()
    joint: bool = False  # the head loss also reaches the backbone (through the hidden states): one chunk
    hidden_batch_size: int = 8  # sequences per backbone forward when recomputing hidden states


@dataclass
class HeadUpdateTotals:
    """Sums over every rank of one or more `update_head` calls; `metrics()` gives the logged values.

    Calls add up so that an RL step made of several calls (one per micro-batch) reports one loss and one
    α_k: means over all of its cycles, not means of per-call means. Loss, α and cycles are measured on
    each record's first visit (a later epoch's calls add their time and finiteness only).
    """

    k: int = 0
    teacher_forcing: bool = False
    cycles: float = 0.0
    loss_sum: float = 0.0  # sum over cycles of the per-cycle loss (NaN once a call was not finite)
    mass_sum: float = 0.0  # sum over the (cycle, draft position) pairs the loss reads of the top-k's mass
    mass_count: float = 0.0  # how many pairs that is
    # [K] per draft position k, over the cycles that reached k (`core.head_loss.HeadLossStats`)
    alpha_sum: list[float] = field(default_factory=list)
    alpha_count: list[float] = field(default_factory=list)
    accepted_count: list[float] = field(default_factory=list)
    finite: bool = True
    seconds: float = 0.0
    # the committed chains of cycles drafted below K (`core.committed`), where they ran: how many, their loss
    # summed over them, and per draft position their α sums and counts (positions past the drafted depth)
    committed_chains: float = 0.0
    committed_loss_sum: float = 0.0
    committed_alpha_sum: list[float] = field(default_factory=list)
    committed_alpha_count: list[float] = field(default_factory=list)

    def add(self, other: HeadUpdateTotals, first_visit: bool = True) -> None:
        self.finite = self.finite and other.finite
        self.seconds += other.seconds
        if not first_visit:
            return
        if other.k:
            self.k = other.k
            for name in ("alpha_sum", "alpha_count", "accepted_count"):
                mine, theirs = getattr(self, name) or [0.0] * other.k, getattr(other, name) or [0.0] * other.k
                setattr(self, name, [a + b for a, b in zip(mine, theirs)])
        for name in ("committed_alpha_sum", "committed_alpha_count"):
            mine, theirs = getattr(self, name), getattr(other, name)
            setattr(self, name, [a + b for a, b in zip(mine, theirs)] if mine and theirs else mine or theirs)
        self.teacher_forcing = self.teacher_forcing or other.teacher_forcing
        for name in ("cycles", "loss_sum", "mass_sum", "mass_count", "committed_chains", "committed_loss_sum"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def metrics(self) -> dict[str, float]:
        cycles = max(self.cycles, 1.0)
        metrics = {"head_cycles": self.cycles, "head_finite": 1.0 if self.finite else 0.0,
                   "head_loss": self.loss_sum / cycles if self.finite else float("nan"),
                   "head_update_s": self.seconds}
        if self.k:
            # The recorded top-k's share of the target's mass where the loss reads it: the sparse alpha
            # estimate can exceed the true alpha by at most 1 minus it (objectives.py).
            metrics["head_topk_mass"] = self.mass_sum / max(self.mass_count, 1.0)
            if not self.teacher_forcing:
                metrics.update(alphas("head_alpha", self.alpha_sum, self.alpha_count))
                # like for like: the head's α and the engine's acceptance over the same cycles (those that
                # reached k), from the same records
                engine = alpha_means(self.accepted_count, self.alpha_count)
                metrics.update({f"alpha_gap_{k}": metrics[f"head_alpha_{k}"] - accepted
                                for k, accepted in enumerate(engine, start=1)})
        if self.committed_alpha_sum:
            # per drafted cycle, as head_loss; α at the positions the chains trained (past the drafted depth)
            metrics["head_committed_loss"] = self.committed_loss_sum / cycles if self.finite else float("nan")
            metrics["head_committed_chains"] = self.committed_chains
            means = alpha_means(self.committed_alpha_sum, self.committed_alpha_count)
            metrics.update({f"committed_alpha_{k}": mean for k, (mean, count) in
                            enumerate(zip(means, self.committed_alpha_count), start=1) if count})
        return metrics


def update_head(head: MTPHead, records: Sequence[SequenceRecord], hiddens: Sequence[torch.Tensor],
                cfg: HeadUpdateConfig, lockstep: Lockstep, gradient_accumulation: int = 1,
                cycles_per_step: float | None = None) -> HeadUpdateTotals:
    """Accumulate the head gradients of these records on every rank; returns the call's totals (identical
    on all ranks). `lockstep.backward` is DeepSpeed's engine backward (which divides by
    `gradient_accumulation`); `cycles_per_step` divides the summed loss (module docstring)."""
    began = time.perf_counter()
    local_cycles = sum(rec.num_cycles for rec in records)
    cycles, mass, mass_count = lockstep.total([local_cycles, *read_topk_mass(records, cfg.loss_config.vgm)])
    scale = lockstep.size * gradient_accumulation * local_cycles / (cycles_per_step or cycles) if local_cycles else 0.0
    scaled = replace(lockstep, backward=lambda loss: lockstep.backward(loss * scale))
    dtype = next(head.parameters()).dtype
    stats = head_loss_backward(head, records, [h.to(dtype) for h in hiddens], cfg.loss_config, scaled)
    totals = HeadUpdateTotals(teacher_forcing=cfg.loss_config.teacher_forcing, cycles=cycles, mass_sum=mass,
                              mass_count=mass_count, finite=stats.finite)
    if stats.alpha_sum:
        k = len(stats.alpha_sum)
        sums = lockstep.total([stats.loss * local_cycles if stats.finite else 0.0, *stats.alpha_sum,
                               *stats.alpha_count, *stats.accepted_count])
        totals.k, totals.loss_sum = k, sums[0] if stats.finite else float("nan")
        totals.alpha_sum, totals.alpha_count, totals.accepted_count = (sums[1 + i * k:1 + (i + 1) * k]
                                                                       for i in range(3))
    committed = stats.committed  # on every rank or none (the depth it depends on is agreed)
    if committed is not None and committed.alpha_sum:
        k = len(committed.alpha_sum)
        sums = lockstep.total([committed.loss * local_cycles if stats.finite else 0.0, committed.num_cycles,
                               *committed.alpha_sum, *committed.alpha_count])
        totals.committed_loss_sum, totals.committed_chains = sums[0] if stats.finite else float("nan"), sums[1]
        totals.committed_alpha_sum, totals.committed_alpha_count = sums[2:2 + k], sums[2 + k:]
    totals.seconds = time.perf_counter() - began
    return totals


def read_topk_mass(records: Sequence[SequenceRecord], vgm: bool) -> tuple[float, float]:
    """The recorded top-k's target mass summed over the (cycle, draft position) pairs the loss reads (under
    VGM positions 1..min(a_r + 1, K), else all K), and how many pairs that is."""
    total, count = 0.0, 0.0
    for rec in records:
        mass = torch.logsumexp(rec.topk_logprobs.float(), dim=-1).exp()  # [cycles, K]
        lengths = chain_lengths(rec.accepted if vgm else None, rec.num_cycles, rec.depth)
        read = torch.arange(rec.depth)[None, :] < lengths[:, None]
        total, count = total + float((mass * read).sum()), count + float(read.sum())
    return total, count


def head_alpha_on(head: MTPHead, records: Sequence[SequenceRecord], hiddens: Sequence[torch.Tensor],
                  cfg: HeadUpdateConfig, lockstep: Lockstep, prefix: str = "lag_alpha") -> dict[str, float]:
    """The head's α_k on these records, as `update_head` measures it, without a gradient step.

    With the head after its optimizer step and the hidden states read before the policy's, this is the
    α of the updated head on the records of the policy it was trained for; the next step's `head_alpha_k`
    is the same head's α on the next policy's records, and the difference is the one-step lag.
    Every rank runs the same chunks (padded), like `update_head`.
    """
    if cfg.loss_config.teacher_forcing:
        raise ValueError("the lag probe reads the draft paths; teacher forcing has none")
    dtype = next(head.parameters()).dtype
    drafted_only = replace(cfg.loss_config, max_depth=None)  # the probe reads the draft paths' α alone
    stats: HeadLossStats = measure_head_loss(head, records, [h.detach().to(dtype) for h in hiddens], drafted_only,
                                             lockstep)
    if not stats.alpha_sum:
        return {}
    k = len(stats.alpha_sum)
    sums = lockstep.total([*stats.alpha_sum, *stats.alpha_count])
    return alphas(prefix, sums[:k], sums[k:])


def alphas(prefix: str, alpha_sum: Sequence[float], alpha_count: Sequence[float]) -> dict[str, float]:
    """`{prefix}_k` for k = 1..K: α per draft position from its sums and counts."""
    return {f"{prefix}_{k}": mean for k, mean in enumerate(alpha_means(alpha_sum, alpha_count), start=1)}
