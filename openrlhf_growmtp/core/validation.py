"""Validation of verification records (`core/records.py` defines them and their terms).

`validate_record` checks everything that makes a record true to its rollout, `validate_records` does so
for many records side by side, `check_fits` checks only what a head needs to reconstruct a record
without indexing out of range, and `decode_record` is the trainer's: a packed record decoded and checked
before any loss. Each raises a RecordError naming the field (and the request, where known).
"""

from __future__ import annotations

import contextlib
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
# vLLM raises a sampling temperature below this to it (SamplingParams.__post_init__, `_MAX_TEMP` in
# vllm/sampling_params.py), so no engine's record holds less; 1e-30 would scale the head's logits to infinity.
MIN_TEMPERATURE = 1e-2


def mass_tolerance(dtype: torch.dtype, width: int) -> float:
    """How far above 0 the log of a row's stored top-`width` probability mass may be from rounding alone.

    A stored log-prob is l(1 + e) with l = log p <= 0 and |e| <= u (the dtype's unit roundoff), so its
    exp is at most p^(1 - u). Over `width` entries of a distribution normalised over the full vocabulary
    (sum p <= 1), sum p^(1 - u) <= width^u (Hölder), i.e. log mass <= u ln(width). bf16 at width 64:
    0.0163, larger than half a bf16 ulp of log-probs in [-8, -4] (0.0156); fp32: 1e-5.
    """
    return UNIT_ROUNDOFF[dtype] * math.log(max(width, 1)) + FP32_SLACK


def _require(condition: bool, field_name: str, message: str) -> None:
    if not condition:
        _fail(field_name, message)


def _fail(field_name: str, message: str) -> None:
    raise RecordError(f"{field_name}: {message}")


def _check_int(tensor, field_name: str, ndim: int) -> None:
    # per record, like _check_layout: the messages are formatted only on failure
    if not isinstance(tensor, torch.Tensor):
        _fail(field_name, f"expected a tensor, got {type(tensor).__name__}")
    if tensor.ndim != ndim:
        _fail(field_name, f"expected {ndim} dims, got shape {tuple(tensor.shape)}")
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        _fail(field_name, f"expected an integer dtype, got {tensor.dtype}")


def check_fits(rec: SequenceRecord, depth: int | None = None, vocab_size: int | None = None,
               hidden_size: int | None = None, topk: int | None = None) -> None:
    """The shapes, dtypes and index ranges model work relies on (RecordError naming the field).

    The trainer runs only this on records the engine boundary already validated: it is what a head of
    this depth, vocabulary and width needs to reconstruct them without indexing out of range.
    """
    _check_layout(rec, depth=depth, hidden_size=hidden_size, topk=topk)
    _check_ranges(_Cycles.of([rec]), vocab_size)


def _check_layout(rec: SequenceRecord, depth: int | None = None, hidden_size: int | None = None,
                  topk: int | None = None) -> None:
    """`check_fits` without a tensor operation: types, dtypes, shapes."""
    _check_int(rec.token_ids, "token_ids", 1)
    _check_int(rec.start, "start", 1)
    _check_int(rec.drafts, "drafts", 2)
    _check_int(rec.topk_ids, "topk_ids", 3)
    _check_int(rec.accepted, "accepted", 1)
    length = int(rec.token_ids.shape[0])
    num_cycles, found_depth = int(rec.drafts.shape[0]), int(rec.drafts.shape[1])
    if not (isinstance(rec.prompt_len, int) and 1 <= rec.prompt_len <= length):
        _fail("prompt_len", f"must be an int in 1..{length} (len(token_ids)), got {rec.prompt_len!r}")
    if found_depth < 1 and num_cycles:  # depth 0 (a rollout that drafted nothing) records no cycle
        _fail("drafts", "K (second dim) must be at least 1 in a record with cycles")
    if depth is not None and found_depth != depth:
        _fail("drafts", f"K = {found_depth} drafts per cycle, expected K = {depth}")
    if rec.start.shape[0] != num_cycles:
        _fail("start", f"{rec.start.shape[0]} cycles, drafts has {num_cycles}")
    if rec.accepted.shape[0] != num_cycles:
        _fail("accepted", f"{rec.accepted.shape[0]} cycles, drafts has {num_cycles}")
    if rec.topk_ids.shape[:2] != (num_cycles, found_depth):
        _fail("topk_ids", f"shape {tuple(rec.topk_ids.shape)} does not start with [R={num_cycles}, K={found_depth}]")
    width = int(rec.topk_ids.shape[2])
    if width < 1:
        _fail("topk_ids", "top-k width must be at least 1")
    if topk is not None and width != topk:
        _fail("topk_ids", f"top-k width {width}, expected {topk}")
    lp = rec.topk_logprobs
    if not (isinstance(lp, torch.Tensor) and lp.dtype in UNIT_ROUNDOFF):
        _fail("topk_logprobs", f"expected a {', '.join(map(str, UNIT_ROUNDOFF))} tensor, got "
                               f"{getattr(lp, 'dtype', type(lp).__name__)}")
    if lp.shape != rec.topk_ids.shape:
        _fail("topk_logprobs", f"shape {tuple(lp.shape)} differs from topk_ids {tuple(rec.topk_ids.shape)}")
    h = rec.hidden
    if h is not None:
        if not (isinstance(h, torch.Tensor) and h.is_floating_point() and h.ndim == 2):
            _fail("hidden", f"expected a floating [T, H] tensor, got {getattr(h, 'dtype', type(h).__name__)} "
                            f"{tuple(getattr(h, 'shape', ()))}")
        if h.shape[0] != length:
            _fail("hidden", f"{h.shape[0]} rows, token_ids has T = {length}")
        if hidden_size is not None and h.shape[1] != hidden_size:
            _fail("hidden", f"width {h.shape[1]}, expected H = {hidden_size}")


def validate_record(rec: SequenceRecord, depth: int | None = None, vocab_size: int | None = None,
                    hidden_size: int | None = None, topk: int | None = None) -> None:
    """Reject every malformed record with a RecordError naming the field. Cheap: no model work.

    `check_fits`, plus what makes a record true to its rollout: finite, normalised log-probs, distinct
    top-k ids, monotone starts, committed tokens that equal the accepted drafts, finite hidden states.
    """
    _check_layout(rec, depth=depth, hidden_size=hidden_size, topk=topk)
    _check_rest(rec)
    _check_values(_Cycles.of([rec]), vocab_size)


def validate_records(records: Sequence[SequenceRecord], depth: int | None = None, vocab_size: int | None = None,
                     hidden_size: int | None = None, topk: int | None = None,
                     names: Sequence[str] | None = None) -> None:
    """`validate_record` for each record, with the checks on tensor values run once over all the records
    side by side: a generate's records cost a few tensor operations in all, not a few per record. A bad
    record's RecordError is the one `validate_record` raises for it, after its name (names[i], default
    "record i")."""
    named = names or [f"record {i}" for i in range(len(records))]
    for name, rec in zip(named, records):
        with _named(name):
            _check_layout(rec, depth=depth, hidden_size=hidden_size, topk=topk)
            _check_rest(rec)
    layouts = {(rec.topk_logprobs.dtype, tuple(rec.topk_logprobs.shape[1:])) for rec in records}
    if len(layouts) == 1:  # side by side (else: one at a time, or none)
        try:
            return _check_values(_Cycles.of(records), vocab_size)
        except RecordError:
            pass  # which record, and what validate_record says of it:
    for name, rec in zip(named, records):
        with _named(name):
            _check_values(_Cycles.of([rec]), vocab_size)


@contextlib.contextmanager
def _named(name: str):
    try:
        yield
    except RecordError as err:
        raise RecordError(f"{name}: {err}") from err


def _check_rest(rec: SequenceRecord) -> None:
    """Finite hidden states, a finite temperature no lower than vLLM's (NaN fails both comparisons)."""
    if rec.hidden is not None:
        _require(bool(torch.isfinite(rec.hidden).all()), "hidden", "non-finite hidden states")
    t = rec.temperature
    _require(isinstance(t, (int, float)) and not isinstance(t, bool) and MIN_TEMPERATURE <= t < math.inf,
             "temperature", f"must be a finite number >= {MIN_TEMPERATURE} (vLLM's lowest; greedy drafting has no q "
                            f"to learn from), got {t!r}")


def check_received(rec: SequenceRecord) -> None:
    """What the trainer checks of a record it decoded, before any loss: every array's length against the cycle
    count (`_check_layout`), the temperature, finite hidden states, and finite log-probs <= 0: the boundary's
    checks that cost at most one pass over the record (the rest ran where the record was made)."""
    _check_layout(rec)
    _check_rest(rec)
    if rec.topk_logprobs.numel():
        _check_logprob_range(rec.topk_logprobs)


def decode_record(blob: bytes, name: str) -> SequenceRecord:
    """A packed record, decoded and `check_received`; a RecordError names `name` (its request) and the field."""
    rec = SequenceRecord.unpack(blob, name)
    with _named(name):
        check_received(rec)
    return rec


@dataclass
class _Cycles:
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
    def of(cls, records: Sequence[SequenceRecord]) -> "_Cycles":
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


def _check_values(c: _Cycles, vocab_size: int | None) -> None:
    _check_ranges(c, vocab_size)
    if c.start.numel():
        _check_cycles(c)


def _check_ranges(c: _Cycles, vocab_size: int | None) -> None:
    """The index ranges of `check_fits`: token ids in the vocabulary, accepted in 0..K, cycles that start
    after the prompt's last position and leave their next token inside the sequence."""
    if vocab_size is not None:
        for name, ids in (("token_ids", c.tokens), ("drafts", c.drafts), ("topk_ids", c.topk_ids)):
            if ids.numel():
                low, high = int(ids.min()), int(ids.max())
                _require(low >= 0 and high < vocab_size, name,
                         f"token ids must lie in [0, {vocab_size}), got [{low}, {high}]")
    if not c.start.numel():
        return
    depth = int(c.drafts.shape[1])
    low, high = int(c.accepted.min()), int(c.accepted.max())
    _require(low >= 0 and high <= depth, "accepted", f"must lie in 0..K={depth}, got [{low}, {high}]")
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


def _check_cycles(c: _Cycles) -> None:
    """Normalised, finite, distinct top-k rows; monotone starts; committed tokens equal accepted drafts."""
    lp = c.topk_logprobs
    tolerance = _check_logprob_range(lp)
    # the largest row mass (fp32 sums of at most k terms <= e^tolerance: no overflow, error ~k * 6e-8)
    mass = float(lp.to(torch.float32, copy=True).exp_().sum(dim=-1).max())  # a copy: never exp_ the record
    if mass > math.exp(tolerance):
        raise RecordError(f"topk_logprobs: top-k probabilities sum to {mass:.6g}, more than {lp.dtype} rounding of "
                          f"a normalised distribution allows (log mass <= {tolerance:.4g}): not normalised over the "
                          "full vocabulary")
    if c.topk_ids.shape[2] > 1:
        # numpy's sort is vectorised (AVX-512 / AVX2); torch sorts row by row on CPU
        ids_sorted = np.sort(c.topk_ids.cpu().numpy(), axis=-1)
        _require(bool((ids_sorted[..., 1:] != ids_sorted[..., :-1]).all()), "topk_ids", "repeated ids within a row")
    # A cycle commits accepted + 1 tokens, so the next one (of the same record) starts at least that far on.
    earliest_next = c.start[:-1] + c.accepted[:-1] + 1
    bad = ((c.start[1:] < earliest_next) & ~c.first[1:]).nonzero()
    if bad.numel():
        r = int(bad[0, 0])
        raise RecordError(f"start: starts are not monotone: cycle {r + 1} starts at {int(c.start[r + 1])}, "
                          f"before {int(earliest_next[r])} = previous start + accepted + 1")
    _check_committed_prefix(c)


def _check_logprob_range(lp: torch.Tensor) -> float:
    """Finite log-probs, none above 0 by more than rounding (`mass_tolerance`, which it returns)."""
    low, high = (float(v) for v in torch.aminmax(lp))  # one pass; NaN propagates to both
    _require(math.isfinite(low) and math.isfinite(high), "topk_logprobs", "non-finite log-probs")
    tolerance = mass_tolerance(lp.dtype, lp.shape[-1])
    if high > tolerance:
        raise RecordError(f"topk_logprobs: positive log-probs (max {high:.4g}); they must be full-vocab log p <= 0")
    return tolerance


def _check_committed_prefix(c: _Cycles) -> None:
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
