"""The checks on a record's values, run over one record or many side by side (`Cycles`): token ids in range,
cycles inside their sequence, finite and normalised top-k log-probs with distinct ids, monotone starts, and
committed tokens equal to the accepted drafts. `validation.py` decides what to check and when; each check raises a
RecordError naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .records import RecordError, SequenceRecord

# Unit roundoff (round to nearest) of the dtypes a record's log-probs may be stored in.
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
# The engine's fp32 log-softmax before the cast: a few fp32 ulps of |log p| (< 100 for any kept entry).
FP32_SLACK = 1e-5


def mass_tolerance(dtype: torch.dtype, width: int) -> float:
    """How far above 0 the log of a row's stored top-`width` probability mass may be from rounding alone.

    A stored log-prob is l(1 + e) with l = log p <= 0 and |e| <= u (the dtype's unit roundoff), so its
    exp is at most p^(1 - u). Over `width` entries of a distribution normalised over the full vocabulary
    (sum p <= 1), sum p^(1 - u) <= width^u (Hölder), i.e. log mass <= u ln(width). bf16 at width 64:
    0.0163, larger than half a bf16 ulp of log-probs in [-8, -4] (0.0156); fp32: 1e-5.
    """
    return UNIT_ROUNDOFF[dtype] * math.log(max(width, 1)) + FP32_SLACK


def require(condition: bool, field_name: str, message: str) -> None:
    if not condition:
        fail(field_name, message)


def fail(field_name: str, message: str) -> None:
    raise RecordError(f"{field_name}: {message}")


@dataclass
class Cycles:
    """One or more records side by side (one record: its own fields): token_ids and the cycle fields
    concatenated, token positions shifted into the concatenated token_ids, and per cycle where its
    record's prompt ends and its tokens end there, and whether it is its record's first or last cycle."""

    tokens: torch.Tensor  # [sum of T]
    start: torch.Tensor  # [C], shifted by its record's offset in `tokens`
    accepted: torch.Tensor  # [C]
    drafts: torch.Tensor  # [C, K]
    topk_ids: torch.Tensor  # [C, K, k]
    topk_logprobs: torch.Tensor  # [C, K, k]
    prompt_end: torch.Tensor  # [C] its record's last prompt position in `tokens`
    end: torch.Tensor  # [C] its record's end in `tokens`
    first: torch.Tensor  # [C] bool
    last: torch.Tensor  # [C] bool

    @classmethod
    def of(cls, records: Sequence[SequenceRecord]) -> "Cycles":
        counts = torch.tensor([rec.num_cycles for rec in records])
        lengths = [int(rec.token_ids.shape[0]) for rec in records]
        ends = torch.cumsum(torch.tensor(lengths), 0)
        offsets = ends - torch.tensor(lengths)
        first, last = (torch.zeros(int(counts.sum()), dtype=torch.bool) for _ in range(2))
        bounds = torch.cumsum(counts, 0)[counts > 0]
        first[bounds - counts[counts > 0]] = True
        last[bounds - 1] = True
        if len(records) == 1:
            rec = records[0]
            fields = {name: getattr(rec, name) for name in ("start", "accepted", "drafts", "topk_ids", "topk_logprobs",
                                                             "token_ids")}
        else:
            fields = {name: torch.cat([getattr(rec, name) for rec in records])
                      for name in ("start", "accepted", "drafts", "topk_ids", "topk_logprobs", "token_ids")}
            fields["start"] = fields["start"] + torch.repeat_interleave(offsets, counts)
        prompt_ends = offsets + torch.tensor([rec.prompt_len - 1 for rec in records])
        return cls(fields["token_ids"], fields["start"], fields["accepted"], fields["drafts"], fields["topk_ids"],
                   fields["topk_logprobs"], torch.repeat_interleave(prompt_ends, counts),
                   torch.repeat_interleave(ends, counts), first, last)


def check_values(c: Cycles, vocab_size: int | None) -> None:
    check_ranges(c, vocab_size)
    if c.start.numel():
        check_cycles(c)


def check_ranges(c: Cycles, vocab_size: int | None) -> None:
    """The index ranges of `check_fits`: token ids in the vocabulary, accepted in 0..K, cycles that start
    after the prompt's last position and leave their next token inside the sequence."""
    if vocab_size is not None:
        for name, ids in (("token_ids", c.tokens), ("drafts", c.drafts), ("topk_ids", c.topk_ids)):
            if ids.numel():
                low, high = int(ids.min()), int(ids.max())
                require(low >= 0 and high < vocab_size, name,
                         f"token ids must lie in [0, {vocab_size}), got [{low}, {high}]")
    if not c.start.numel():
        return
    depth = int(c.drafts.shape[1])
    low, high = int(c.accepted.min()), int(c.accepted.max())
    require(low >= 0 and high <= depth, "accepted", f"must lie in 0..K={depth}, got [{low}, {high}]")
    early = (c.first & (c.start < c.prompt_end)).nonzero()
    if early.numel():
        r = int(early[0, 0])
        raise RecordError(f"start: first cycle starts at {int(c.start[r])}, before the last prompt position "
                          f"{int(c.prompt_end[r])}")
    late = (c.last & (c.start + 1 >= c.end)).nonzero()
    if late.numel():
        r = int(late[0, 0])
        raise RecordError(f"start: last cycle starts at {int(c.start[r])}: its next token x_(s+1) is past the "
                          f"sequence (len(token_ids) = {int(c.end[r])})")


def check_cycles(c: Cycles) -> None:
    """Normalised, finite, distinct top-k rows; monotone starts; committed tokens equal accepted drafts."""
    lp = c.topk_logprobs
    tolerance = check_logprob_range(lp)
    # the largest row mass (fp32 sums of at most k terms <= e^tolerance: no overflow, error ~k * 6e-8)
    mass = float(lp.to(torch.float32, copy=True).exp_().sum(dim=-1).max())  # a copy: never exp_ the record
    if mass > math.exp(tolerance):
        raise RecordError(f"topk_logprobs: top-k probabilities sum to {mass:.6g}, more than {lp.dtype} rounding of "
                          f"a normalised distribution allows (log mass <= {tolerance:.4g}): not normalised over the "
                          "full vocabulary")
    if c.topk_ids.shape[2] > 1:
        # numpy's sort is vectorised (AVX-512 / AVX2); torch sorts row by row on CPU
        ids_sorted = np.sort(c.topk_ids.cpu().numpy(), axis=-1)
        require(bool((ids_sorted[..., 1:] != ids_sorted[..., :-1]).all()), "topk_ids", "repeated ids within a row")
    # A cycle commits accepted + 1 tokens, so the next one (of the same record) starts at least that far on.
    earliest_next = c.start[:-1] + c.accepted[:-1] + 1
    bad = ((c.start[1:] < earliest_next) & ~c.first[1:]).nonzero()
    if bad.numel():
        r = int(bad[0, 0])
        raise RecordError(f"start: starts are not monotone: cycle {r + 1} starts at {int(c.start[r + 1])}, "
                          f"before {int(earliest_next[r])} = previous start + accepted + 1")
    _check_committed_prefix(c)


def check_logprob_range(lp: torch.Tensor) -> float:
    """Finite log-probs, none above 0 by more than rounding (`mass_tolerance`, which it returns)."""
    low, high = (float(v) for v in torch.aminmax(lp))  # one pass; NaN propagates to both
    require(math.isfinite(low) and math.isfinite(high), "topk_logprobs", "non-finite log-probs")
    tolerance = mass_tolerance(lp.dtype, lp.shape[-1])
    if high > tolerance:
        raise RecordError(f"topk_logprobs: positive log-probs (max {high:.4g}); they must be full-vocab log p <= 0")
    return tolerance


def _check_committed_prefix(c: Cycles) -> None:
    """token_ids[s+2 .. s+1+a] must equal the accepted drafts d_1..d_a (where the sequence reaches)."""
    offsets = torch.arange(c.drafts.shape[1])
    positions = c.start[:, None] + 2 + offsets[None, :]  # [C, K] position of draft k
    in_accepted = offsets[None, :] < c.accepted[:, None]
    # EOS or max_tokens may cut a cycle short: accepted drafts past the end were never committed.
    checked = in_accepted & (positions < c.end[:, None])
    committed = c.tokens[torch.minimum(positions, c.end[:, None] - 1)]
    bad = (checked & (committed != c.drafts)).nonzero()
    if bad.numel():
        r, j = int(bad[0, 0]), int(bad[0, 1])
        raise RecordError(
            f"drafts: cycle {r} accepted {int(c.accepted[r])} drafts but draft {j + 1} "
            f"({int(c.drafts[r, j])}) differs from the committed token_ids[{int(positions[r, j])}] "
            f"= {int(committed[r, j])}")
