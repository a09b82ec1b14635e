"""The head loss from reconstructed draft states, without full-vocabulary logits for the whole chunk.

`chunk_loss_backward` scores a chunk's slots (a cycle's draft positions) in groups of whole cycles: per
group, one lm_head forward over its slots gives log q at the recorded top-k ids (`score_slots`), the
group's loss (`objectives.head_loss_per_cycle_at`) and the loss's gradient with respect to the slots'
states; then the head's own graph is backpropagated once per chunk. Under ZeRO-3 every call of a
partitioned module gathers its weights, a collective, so every rank scores as many groups: the number
follows from the most slots any rank has in this chunk (agreed by the caller's all-reduce).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from .head import MTPHead
from .objectives import chain_lengths, head_loss_per_cycle_at

# Full-vocabulary logits per scored group: 128 MiB in bf16, i.e. 441 rows at Qwen's 151,936 tokens (a
# group ends at a cycle's end, so it may hold up to K - 1 rows more). A group holds its logits in the
# head's dtype (they become the gradient in place) and one fp32 block of them at a time
# (`SOFTMAX_BLOCK`). Fewer rows per group cost time: each group reads the lm_head's weight once, and
# under ZeRO-3 gathers it (at H=2560 on a 2-core CPU, the lm_head's forward and backward take 1.4x the
# time per row at 44 rows that they take at 440).
GROUP_LOGITS = 2**26

# At most this many logits per fp32 block of the softmax's elementwise passes: on a CPU a block that stays
# in cache (4 MiB) halves their time against passes over the whole group; a GPU streams larger blocks.
SOFTMAX_BLOCK = {"cpu": 2**20, "cuda": 2**24}


@dataclass
class DraftStates:
    """The head's states at the (cycle, position) slots that were reconstructed, one row per slot."""

    normed: torch.Tensor  # [M, H] norm(o), what the lm_head reads
    cycle: torch.Tensor  # [M] the slot's cycle (index into the chunk's cycles)
    position: torch.Tensor  # [M] its draft position, 0-based
    temperature: torch.Tensor  # [N] per cycle


@dataclass
class HeadLossStats:
    """What one head update measured: its loss, and the head's α per draft position."""

    loss: float  # batch loss (mean over cycles, or over teacher-forced chains)
    num_cycles: int
    num_chunks: int
    # per draft position: the sum and count of the head's alpha over the cycles that reach it (all of
    # them without VGM; under VGM those whose earlier drafts were all accepted, where the loss reads it)
    alpha_sum: list[float] = field(default_factory=list)
    alpha_count: list[float] = field(default_factory=list)
    finite: bool = True

    @property
    def alpha_mean(self) -> list[float]:
        return [s / max(n, 1.0) for s, n in zip(self.alpha_sum, self.alpha_count)]


def score_groups(max_rows: int, vocab_size: int) -> int:
    """How many groups `chunk_loss_backward` scores a chunk in when the busiest rank has max_rows slots."""
    return max(1, math.ceil(max_rows * vocab_size / GROUP_LOGITS))


def group_bounds(cycle: torch.Tensor, num_cycles: int, num_groups: int) -> list[int]:
    """Cycle bounds [b_0 = 0, ..., b_G = num_cycles] of `num_groups` groups of whole cycles with about
    equally many slots each (cycle: every slot's cycle); trailing groups may be empty."""
    ends = torch.cumsum(torch.bincount(cycle, minlength=num_cycles), 0)  # slots up to each cycle
    shares = torch.tensor([cycle.numel() * g // num_groups for g in range(1, num_groups)], device=cycle.device)
    return [0, *torch.searchsorted(ends, shares, right=True).tolist(), num_cycles]


def chunk_loss_backward(head: MTPHead, states: DraftStates, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor,
                        accepted: torch.Tensor | None, kind: str, weight: float,
                        backward: Callable[[torch.Tensor], None], agree: Callable[[bool], bool],
                        agree_max: Callable[[int], int]):
    """Score one chunk's reconstructed slots and backpropagate weight x (sum of the per-cycle losses).

    The cycles are scored in groups of whole cycles with about equally many slots, as many groups as the
    busiest rank needs: `agree_max(this rank's slots) -> the most over ranks` (`score_groups`; a caller
    on one rank passes the identity). For each group the lm_head runs once over the group's slots: log q
    at the recorded ids, the group's loss, and its gradient with respect to the slots' states; then the
    group's [rows, V] logits are freed. So no [N, K, V] logits
    exist, and each slot costs one lm_head forward and one backward to its input. Once every group is
    scored and the chunk's loss is finite on every rank (`agree`), the head's own graph is
    backpropagated once, through `backward`, from the surrogate sum(normed * dL/dnormed), whose
    gradients are the loss's. A group without cycles scores one passenger slot with weight 0: under
    ZeRO-3 every lm_head call gathers its weight, a collective, so ranks must make the same calls.
    Only positions up to the chain length (`chain_lengths`) carry loss (`read`); the others hold a
    passenger's log q or the target's own log p, both finite. Returns (loss, alpha [N, K], read [N, K]);
    loss is None if it was not finite on some rank, and then nothing was backpropagated.
    """
    num_cycles, depth = topk_ids.shape[:2]
    device = states.normed.device
    lengths = chain_lengths(accepted, num_cycles, depth, device=device)
    read = torch.arange(depth, device=device)[None, :] < lengths[:, None]
    order = torch.argsort(states.cycle * depth + states.position)  # the slots of a cycle side by side
    num_groups = score_groups(agree_max(int(states.cycle.numel())), head.config.vocab_size)
    bounds = group_bounds(states.cycle, num_cycles, num_groups)  # group g: cycles [b_g, b_g+1)
    row_bounds = torch.searchsorted(states.cycle[order], torch.tensor(bounds, device=device)).tolist()
    grad_normed = torch.zeros_like(states.normed)
    alpha = torch.zeros(num_cycles, depth, device=device)
    loss_sum = torch.zeros((), device=device)
    for g in range(num_groups):
        lo, hi = bounds[g], bounds[g + 1]
        rows = order[row_bounds[g]:row_bounds[g + 1]]
        passenger = rows.numel() == 0
        rows = order[:1] if passenger else rows
        cycle, position = states.cycle[rows], states.position[rows]

        def group_loss(logq_rows: torch.Tensor) -> torch.Tensor:
            if passenger:
                return logq_rows.sum() * 0.0
            target = topk_logprobs[lo:hi].float()
            logq = target.index_put((cycle - lo, position), logq_rows)
            per_cycle, alpha[lo:hi] = head_loss_per_cycle_at(logq, target, None if accepted is None
                                                             else accepted[lo:hi], kind)
            return per_cycle.sum() * weight

        loss, grad = score_slots(head, states.normed[rows], topk_ids[cycle, position], states.temperature[cycle],
                                 group_loss)
        # added, not assigned: a passenger's row is some group's real slot, and its gradient here is 0
        grad_normed.index_add_(0, rows, grad)
        loss_sum = loss_sum + loss
    # A non-finite loss is never backpropagated: it would poison every gradient it touches.
    if not agree(bool(torch.isfinite(loss_sum))):
        return None, alpha, read
    backward((states.normed * grad_normed).sum())
    return loss_sum.item(), alpha, read


def score_slots(head: MTPHead, normed: torch.Tensor, ids: torch.Tensor, temperature: torch.Tensor,
                loss_of: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, d loss / d normed [M, H]) for loss = loss_of(log q at ids [M, k]), where q is the
    full-vocabulary softmax of lm_head(normed) / temperature [M].

    One lm_head forward and one backward to its input (never to the lm_head). The logits' own buffer
    becomes the gradient dL/dz = (scatter(g at the ids) - (sum g) q) / T, where g = dL/dlog q comes from
    the small graph of `loss_of`: block by block of rows (`SOFTMAX_BLOCK`), the logits are scaled in
    fp32, once for log-sum-exp and once for the gradient; no [M, V] copy is made.
    """
    normed = normed.detach().requires_grad_()
    with torch.enable_grad():
        logits = head.logits(normed)  # [M, V] in the head's dtype; its graph reaches `normed` only
    values = logits.detach()  # its storage: the logits, then the gradient (no saved tensor reads it)
    temperature, ids = temperature.float()[:, None], ids.long()
    rows = max(1, SOFTMAX_BLOCK.get(values.device.type, SOFTMAX_BLOCK["cpu"]) // values.shape[-1])
    blocks = [slice(lo, lo + rows) for lo in range(0, values.shape[0], rows)]
    lse = torch.cat([torch.logsumexp(values[b].float() / temperature[b], -1, keepdim=True) for b in blocks])
    logq = (values.gather(-1, ids).float() / temperature - lse).requires_grad_()  # log softmax at the ids
    with torch.enable_grad():
        loss = loss_of(logq)
        (grad_logq,) = torch.autograd.grad(loss, logq)
    scale = -grad_logq.sum(-1, keepdim=True) / temperature
    for b in blocks:
        grad = (values[b].float() / temperature[b]).sub_(lse[b]).exp_().mul_(scale[b])
        values[b] = grad.scatter_add_(-1, ids[b], grad_logq[b] / temperature[b])
    (grad_normed,) = torch.autograd.grad(logits, normed, values)
    return loss.detach(), grad_normed
