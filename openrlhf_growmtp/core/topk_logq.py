"""log q at the recorded top-k ids, without holding [cycles, K, V] logits.

q is the head's full-vocabulary softmax, lm_head(norm(o)) / T (with a draft vocabulary of N ids, its softmax
over those ids, from the lm_head's N rows alone); the loss reads it only at the target's recorded top-k ids.
`TopKLogQ` runs the lm_head once over a group of slots, keeps log q at the ids as a small leaf for the loss's
own graph, and turns the loss's gradient there into the gradient with respect to the slots' states in the
logits' own buffer: no [rows, V] copy is made, and nothing reaches the lm_head. A chunk's slots are scored in
groups of whole cycles (`group_bounds`), as many as the busiest rank needs (`score_groups`): under ZeRO-3 every
lm_head call gathers its weight, a collective (the draft vocabulary's rows are gathered once per update).
"""

from __future__ import annotations

import math

import torch

from .head import MTPHead

# Full-vocabulary logits per scored group, by device. On a CPU 128 MiB in bf16, i.e. 441 rows at Qwen's
# 151,936 tokens (a group ends at a cycle's end, so it may hold up to K - 1 rows more); on a GPU 512 MiB, so
# that a chunk of 1,024 cycles is two groups: each group is a fixed run of launches (the lm_head, the
# softmax's blocks, the objective and its gradient), and the update is launch-bound
# (`benchmarks/bench_launches.py`). A group holds its logits in the head's dtype (they become the gradient
# in place) and one fp32 block of them at a time (`SOFTMAX_BLOCK`). Fewer rows per group cost time: each
# group reads the lm_head's weight once, and under ZeRO-3 gathers it.
GROUP_LOGITS = {"cpu": 2**26, "cuda": 2**28}

# At most this many logits per fp32 block of the softmax's elementwise passes: on a CPU a block that stays
# in cache (4 MiB) is faster than passes over the whole group; on a GPU a block is the whole group (each
# block is a fixed run of about twenty launches), for up to 3 GiB of fp32 temporaries while it is scored
# (the block, its shifted copy and their exponentials, 1 GiB each). What each measured:
# docs/measurements.md#behind-the-codes-defaults.
SOFTMAX_BLOCK = {"cpu": 2**20, "cuda": GROUP_LOGITS["cuda"]}


def score_groups(slots: int, vocab_size: int, device_type: str = "cpu") -> int:
    """How many lm_head groups score a chunk of `slots` slots with logits over `vocab_size` ids on a
    `device_type` device (the busiest rank's count decides)."""
    return max(1, math.ceil(slots * vocab_size / GROUP_LOGITS.get(device_type, GROUP_LOGITS["cuda"])))


def group_bounds(cycle: torch.Tensor, num_cycles: int, num_groups: int) -> list[int]:
    """Cycle bounds [b_0 = 0, ..., b_G = num_cycles] of `num_groups` groups of whole cycles with about
    equally many slots each (cycle: every slot's cycle); trailing groups may be empty."""
    ends = torch.cumsum(torch.bincount(cycle, minlength=num_cycles), 0)  # slots up to each cycle
    shares = torch.tensor([cycle.numel() * g // num_groups for g in range(1, num_groups)], device=cycle.device)
    return [0, *torch.searchsorted(ends, shares, right=True).tolist(), num_cycles]


class TopKLogQ:
    """log q [M, k] (fp32) at `ids` [M, k] for the slots' states `normed` [M, H], with q the softmax of
    lm_head(normed) / temperature [M] over the full vocabulary, or over the draft vocabulary alone while the
    head holds its rows (`head.draft_rows`, `draft_vocab.py`): logits [M, N] from its N rows, and an id
    outside it reads log q = -inf and passes no gradient, as the masked [M, V] logits give.

    `logq` is a leaf: build the loss on it, take d loss / d logq, and `input_grad` gives d loss / d normed
    [M, H]. The logits' buffer then becomes dL/dz = (scatter(g at the ids) - (sum g) q) / T, written block
    by block of rows (`SOFTMAX_BLOCK`), scaled in fp32 once for the log-sum-exp and once for the gradient.
    """

    def __init__(self, head: MTPHead, normed: torch.Tensor, ids: torch.Tensor, temperature: torch.Tensor):
        assert normed.ndim == 2 and ids.ndim == 2 and ids.shape[0] == normed.shape[0] == temperature.shape[0]
        self._rows, ids = head.draft_rows, ids.long()
        self._inside = None  # [M, k] bool where the ids are the draft vocabulary's; None: every id is
        if self._rows is None:
            self._normed = normed.detach().requires_grad_()
            with torch.enable_grad():
                self._logits = head.logits(self._normed)  # [M, V] in the head's dtype; its graph reaches normed only
        else:
            self._normed = normed.detach()
            with torch.no_grad():
                self._logits = self._rows.logits(self._normed)  # [M, N]; its gradient is input_grad's own
            ids = self._rows.vocab.positions(ids.device)[ids]  # the ids' columns, -1 outside
            self._inside = ids >= 0
            ids = ids.clamp(min=0)
        values = self._logits.detach()  # the logits, then the gradient: no saved tensor reads this storage
        self._temperature, self._ids = temperature.float()[:, None], ids
        rows = max(1, SOFTMAX_BLOCK.get(values.device.type, SOFTMAX_BLOCK["cpu"]) // values.shape[-1])
        self._blocks = [slice(lo, lo + rows) for lo in range(0, values.shape[0], rows)]
        self._lse = torch.cat([torch.logsumexp(values[b].float() / self._temperature[b], -1, keepdim=True)
                               for b in self._blocks])
        logq = values.gather(-1, self._ids).float() / self._temperature - self._lse
        self.logq = (logq if self._inside is None else logq.masked_fill(~self._inside, float("-inf"))).requires_grad_()

    def input_grad(self, grad_logq: torch.Tensor) -> torch.Tensor:
        """d loss / d normed [M, H] from d loss / d logq [M, k]; consumes the logits (call once)."""
        values, temperature = self._logits.detach(), self._temperature
        if self._inside is not None:  # log q = -inf outside the vocabulary whatever the logits: no gradient
            grad_logq = grad_logq.masked_fill(~self._inside, 0.0)
        scale = -grad_logq.sum(-1, keepdim=True) / temperature
        for b in self._blocks:
            grad = (values[b].float() / temperature[b]).sub_(self._lse[b]).exp_().mul_(scale[b])
            values[b] = grad.scatter_add_(-1, self._ids[b], grad_logq[b] / temperature[b])
        if self._rows is None:
            (grad_normed,) = torch.autograd.grad(self._logits, self._normed, values)
        else:  # the rows' linear map, transposed (a copy of the lm_head's: nothing reaches the lm_head)
            grad_normed = (values @ self._rows.weight).to(self._normed.dtype)
        self._logits = None
        return grad_normed
