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

import torch

from .record_values import UNIT_ROUNDOFF, Cycles, check_logprob_range, check_ranges, check_values, fail, require
from .records import RecordError, SequenceRecord

# vLLM raises a sampling temperature below this to it (SamplingParams.__post_init__, `_MAX_TEMP` in
# vllm/sampling_params.py), so no engine's record holds less; 1e-30 would scale the head's logits to infinity.
MIN_TEMPERATURE = 1e-2


def _check_int(tensor, field_name: str, ndim: int) -> None:
    # per record, like _check_layout: the messages are formatted only on failure
    if not isinstance(tensor, torch.Tensor):
        fail(field_name, f"expected a tensor, got {type(tensor).__name__}")
    if tensor.ndim != ndim:
        fail(field_name, f"expected {ndim} dims, got shape {tuple(tensor.shape)}")
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        fail(field_name, f"expected an integer dtype, got {tensor.dtype}")


def check_fits(rec: SequenceRecord, depth: int | None = None, vocab_size: int | None = None,
               hidden_size: int | None = None, topk: int | None = None) -> None:
    """The shapes, dtypes and index ranges model work relies on (RecordError naming the field).

    The trainer runs only this on records the engine boundary already validated: it is what a head of
    this depth, vocabulary and width needs to reconstruct them without indexing out of range.
    """
    _check_layout(rec, depth=depth, hidden_size=hidden_size, topk=topk)
    check_ranges(Cycles.of([rec]), vocab_size)


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
        fail("prompt_len", f"must be an int in 1..{length} (len(token_ids)), got {rec.prompt_len!r}")
    if found_depth < 1 and num_cycles:  # depth 0 (a rollout that drafted nothing) records no cycle
        fail("drafts", "K (second dim) must be at least 1 in a record with cycles")
    if depth is not None and found_depth != depth:
        fail("drafts", f"K = {found_depth} drafts per cycle, expected K = {depth}")
    if rec.start.shape[0] != num_cycles:
        fail("start", f"{rec.start.shape[0]} cycles, drafts has {num_cycles}")
    if rec.accepted.shape[0] != num_cycles:
        fail("accepted", f"{rec.accepted.shape[0]} cycles, drafts has {num_cycles}")
    if rec.topk_ids.shape[:2] != (num_cycles, found_depth):
        fail("topk_ids", f"shape {tuple(rec.topk_ids.shape)} does not start with [R={num_cycles}, K={found_depth}]")
    width = int(rec.topk_ids.shape[2])
    if width < 1:
        fail("topk_ids", "top-k width must be at least 1")
    if topk is not None and width != topk:
        fail("topk_ids", f"top-k width {width}, expected {topk}")
    lp = rec.topk_logprobs
    if not (isinstance(lp, torch.Tensor) and lp.dtype in UNIT_ROUNDOFF):
        fail("topk_logprobs", f"expected a {', '.join(map(str, UNIT_ROUNDOFF))} tensor, got "
                               f"{getattr(lp, 'dtype', type(lp).__name__)}")
    if lp.shape != rec.topk_ids.shape:
        fail("topk_logprobs", f"shape {tuple(lp.shape)} differs from topk_ids {tuple(rec.topk_ids.shape)}")
    h = rec.hidden
    if h is not None:
        if not (isinstance(h, torch.Tensor) and h.is_floating_point() and h.ndim == 2):
            fail("hidden", f"expected a floating [T, H] tensor, got {getattr(h, 'dtype', type(h).__name__)} "
                            f"{tuple(getattr(h, 'shape', ()))}")
        if h.shape[0] != length:
            fail("hidden", f"{h.shape[0]} rows, token_ids has T = {length}")
        if hidden_size is not None and h.shape[1] != hidden_size:
            fail("hidden", f"width {h.shape[1]}, expected H = {hidden_size}")


def validate_record(rec: SequenceRecord, depth: int | None = None, vocab_size: int | None = None,
                    hidden_size: int | None = None, topk: int | None = None) -> None:
    """Reject every malformed record with a RecordError naming the field. Cheap: no model work.

    `check_fits`, plus what makes a record true to its rollout: finite, normalised log-probs, distinct
    top-k ids, monotone starts, committed tokens that equal the accepted drafts, finite hidden states.
    """
    _check_layout(rec, depth=depth, hidden_size=hidden_size, topk=topk)
    _check_rest(rec)
    check_values(Cycles.of([rec]), vocab_size)


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
            return check_values(Cycles.of(records), vocab_size)
        except RecordError:
            pass  # which record, and what validate_record says of it:
    for name, rec in zip(named, records):
        with _named(name):
            check_values(Cycles.of([rec]), vocab_size)


@contextlib.contextmanager
def _named(name: str):
    try:
        yield
    except RecordError as err:
        raise RecordError(f"{name}: {err}") from err


def _check_rest(rec: SequenceRecord) -> None:
    """Finite hidden states, a finite temperature no lower than vLLM's (NaN fails both comparisons)."""
    if rec.hidden is not None:
        require(bool(torch.isfinite(rec.hidden).all()), "hidden", "non-finite hidden states")
    t = rec.temperature
    require(isinstance(t, (int, float)) and not isinstance(t, bool) and MIN_TEMPERATURE <= t < math.inf,
             "temperature", f"must be a finite number >= {MIN_TEMPERATURE} (vLLM's lowest; greedy drafting has no q "
                            f"to learn from), got {t!r}")


def check_received(rec: SequenceRecord) -> None:
    """What the trainer checks of a record it decoded, before any loss: every array's length against the cycle
    count (`_check_layout`), the temperature, finite hidden states, and finite log-probs <= 0: the boundary's
    checks that cost at most one pass over the record (the rest ran where the record was made)."""
    _check_layout(rec)
    _check_rest(rec)
    if rec.topk_logprobs.numel():
        check_logprob_range(rec.topk_logprobs)


def decode_record(blob: bytes, name: str) -> SequenceRecord:
    """A packed record, decoded and `check_received`; a RecordError names `name` (its request) and the field."""
    rec = SequenceRecord.unpack(blob, name)
    with _named(name):
        check_received(rec)
    return rec
