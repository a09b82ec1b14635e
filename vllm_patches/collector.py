"""The record collector: finished vLLM outputs + drained capture payloads -> validated SequenceRecords.

One collector serves `SpecEngine.generate` and the OpenRLHF rollout actor:

    collector = RecordCollector(depth=K, topk=64, vocab_size=V)
    collector.add_output(output, sampling_params)   # every finished RequestOutput, as it arrives (+ order=)
    collector.add_drained(blob)                     # what growmtp_drain_records returned, any number of times
    record = collector.pop(output)                  # or collector.pop_by_tokens(prompt + response ids)

Its own terms (capture/core.py defines the payload, core/records.py the record, the README's glossary the words):

- *caller's request id*: `RequestOutput.request_id`. Workers key cycles by vLLM's internal id, the
  caller's id plus "-<8 random chars>"; the collector strips that suffix (unless vLLM was told not to
  add it, `VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1`).
- *pending cycles*: drained cycle rows (and exact-mode hidden rows) of a request not claimed yet. They are kept
  across drains until claimed (an async rollout drains after a whole batch, so a request's cycles may arrive in
  several payloads, some before its output), or until the caller discards what nobody claimed.
- *dropped cycles* (capture/core.py defines them): verified, but not K samples of q; left out of the record,
  counted in `record.meta["dropped_cycles"]`, and still compared with vLLM's counters in step order.
- *claim*: `pop` / `pop_by_tokens`. The record is built and validated once, here, and the request's
  output and pending cycles are forgotten.

A request's cycles are complete once a payload drained *after* its output finished has been added (vLLM
returns an output only after the worker step that captured its last cycle), so a claim without such a
drain is refused. When vLLM reports per-request spec-decode metrics (`settings.spec_engine_kwargs`
turns them on), the record's accepted counts must also equal vLLM's own, step by step.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass, field

import torch

from openrlhf_growmtp.core.draft_vocab import DRAFT_VOCAB_META
from openrlhf_growmtp.core.records import DEFAULT_TOPK, REQUEST_ID_META, SequenceRecord
from openrlhf_growmtp.core.validation import validate_records

from . import check_vllm_version
from .capture.core import CYCLE_FIELDS
from .settings import check_sampling_params
from .transport import load_blob

check_vllm_version()

RECORD_FIELDS = ("start", "drafts", "topk_ids", "topk_logprobs", "accepted")  # CYCLE_FIELDS minus debug q
DROPPED_META = "dropped_cycles"  # record.meta key: cycles vLLM verified that the record leaves out
# record.meta key: True when the record's accepted counts were compared with vLLM's own per-request ones
CHECKED_META = "checked_against_vllm"
# vLLM appends "-" + 8 random characters to the caller's id unless this is set (vllm/envs.py).
NO_SUFFIX_ENV = "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION"


class RecordCollectionError(RuntimeError):
    """Outputs and captured cycles that cannot be joined into a correct record; the message says why."""


@dataclass
class _Pending:
    """Drained, unclaimed rows of one request, one list entry per payload (in drain order)."""

    cycles: list[dict[str, torch.Tensor]] = field(default_factory=list)  # field -> [c, ...] per payload
    hidden: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (positions [n], rows [n, H])
    hidden_dropped: bool = False  # a payload's hidden rows were dropped (preemption): no hidden at all
    dropped: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (start [d], accepted [d])
    draft_vocabs: set = field(default_factory=set)  # the draft vocabularies' tags of its payloads (None: every id)


@dataclass
class _Finished:
    output: object  # vLLM RequestOutput with exactly one completion
    temperature: float
    drains_before: int  # payloads added before this output; a claim needs a later one


class RecordCollector:
    """Joins finished RequestOutputs with drained capture payloads into validated SequenceRecords.

    depth: drafts per cycle (K, or the depth set while the engine runs: 0 drafts nothing and records no
    cycle; `depth` may change between drains); topk: the capture's top-k width (CaptureConfig.topk);
    vocab_size: when given, every token id and the recorded width min(topk, vocab_size) are checked;
    hidden_dtype: dtype of exact-mode hidden rows;
    capture_hidden: exact mode, a record with cycles must carry the engine's hidden states.
    """

    def __init__(self, depth: int, *, topk: int = DEFAULT_TOPK, vocab_size: int | None = None,
                 hidden_dtype: torch.dtype = torch.bfloat16, capture_hidden: bool = False):
        if depth < 0:
            raise ValueError(f"depth (drafts per cycle) must be >= 0, got {depth}")
        self.depth, self.vocab_size = int(depth), vocab_size
        self.topk = min(int(topk), vocab_size) if vocab_size else int(topk)
        self.hidden_dtype, self.capture_hidden = hidden_dtype, capture_hidden
        self._strip_suffix = os.environ.get(NO_SUFFIX_ENV, "0") in ("", "0")
        self._finished: dict[str, _Finished] = {}
        # committed tokens -> (order, request id) of the outputs with those tokens, in order
        self._by_tokens: dict[tuple[int, ...], list[tuple[int, str]]] = {}
        self._pending: dict[str, _Pending] = {}
        self._num_added = self._num_drains = 0

    # ---- input ----------------------------------------------------------------------------------------
    def add_output(self, output, sampling_params, order: int | None = None) -> None:
        """A finished RequestOutput and the SamplingParams it ran with (n > 1 and greedy are refused).

        `order`: where the request stands among the caller's requests (`pop_by_tokens` claims outputs with
        equal tokens in this order); default, the order outputs are added, which is the order they finish.
        """
        check_sampling_params(sampling_params, capture=True)
        request_id = output.request_id
        if len(output.outputs) != 1:
            raise RecordCollectionError(
                f"request {request_id!r}: {len(output.outputs)} completions in one RequestOutput; records are "
                "joined per request, so n > 1 is refused (repeat the prompt instead)")
        if not output.finished:
            raise RecordCollectionError(f"request {request_id!r} has not finished: add an output once it finished")
        if request_id in self._finished:
            raise RecordCollectionError(f"request {request_id!r} was added twice")
        self._finished[request_id] = _Finished(output, float(sampling_params.temperature), self._num_drains)
        bisect.insort(self._by_tokens.setdefault(_committed(output), []),
                      (self._num_added if order is None else order, request_id))
        self._num_added += 1

    def add_drained(self, drained: bytes | dict, keep_hidden: bool = True) -> None:
        """A capture payload (the bytes growmtp_drain_records returned, or the loaded dict).

        Raises on engine-side errors, with their text. keep_hidden=False drops this payload's hidden rows
        and gives its requests records without hidden states (SpecEngine does so after a preemption).
        """
        payload = load_blob(drained) if isinstance(drained, (bytes, bytearray, memoryview)) else drained
        if not isinstance(payload, dict) or "errors" not in payload:
            raise RecordCollectionError(f"not a capture payload (capture.core.drain's dict): {type(payload).__name__}")
        if payload["errors"]:
            raise RecordCollectionError("speculative verification went wrong in the engine: "
                                        + "; ".join(payload["errors"]))
        counts = payload["counts"].tolist()  # [len(req_ids)]
        split = {name: torch.split(payload[name], counts) for name in CYCLE_FIELDS if name in payload}
        seen: dict[str, str] = {}
        for i, internal_id in enumerate(payload["req_ids"]):
            pending = self._pending.setdefault(self._caller_id(internal_id, seen), _Pending())
            pending.cycles.append({name: parts[i] for name, parts in split.items()})
            pending.draft_vocabs.add(payload.get("draft_vocab"))
        for internal_id, (starts, accepted) in payload.get("dropped", {}).items():
            self._pending.setdefault(self._caller_id(internal_id, seen), _Pending()).dropped.append((starts, accepted))
        for internal_id, (positions, rows) in payload["hidden"].items():
            pending = self._pending.setdefault(self._caller_id(internal_id, seen), _Pending())
            if not keep_hidden:
                pending.hidden_dropped = True
            elif self.capture_hidden:
                pending.hidden.append((positions, rows))
        self._num_drains += 1

    def _caller_id(self, internal_id: str, seen: dict[str, str]) -> str:
        """The caller's id of an internal id; two internal ids of one caller's id in a payload are refused."""
        caller_id = internal_id.rsplit("-", 1)[0] if self._strip_suffix else internal_id
        if seen.setdefault(caller_id, internal_id) != internal_id:
            raise RecordCollectionError(f"engine requests {seen[caller_id]!r} and {internal_id!r} both map to "
                                        f"request {caller_id!r}: request ids must be unique")
        return caller_id

    # ---- output -------------------------------------------------------------------------------------
    def peek_draft_probs(self, output) -> torch.Tensor | None:
        """Debug (capture_q): the q rows [R, K, V] drained so far for this output's request, or None."""
        pending = self._pending.get(output.request_id)
        if pending is None or not pending.cycles or "q" not in pending.cycles[0]:
            return None
        return torch.cat([c["q"] for c in pending.cycles])

    def pop(self, output) -> SequenceRecord:
        """The validated record of an added output; forgets the request."""
        return self._claim([output.request_id])[0]

    def pop_all(self, outputs) -> list[SequenceRecord]:
        """`pop` for each output, in order, validated side by side (`validation.validate_records`)."""
        return self._claim([output.request_id for output in outputs])

    def pop_by_tokens(self, token_ids) -> SequenceRecord:
        """The record of the first output, in `add_output`'s order, whose prompt + response ids equal
        `token_ids`. Equal samples of one prompt are common (short, confident responses); their records differ,
        and which finishes first is a matter of timing, so a reproducible caller passes its own order."""
        queue = self._by_tokens.get(tuple(int(t) for t in token_ids))
        if not queue:
            raise RecordCollectionError(
                f"no finished output has these {len(token_ids)} committed tokens (outputs must be added with "
                "add_output; multi-turn executors and responses edited after generation are not supported)")
        return self._claim([queue[0][1]])[0]

    @property
    def unclaimed_request_ids(self) -> set[str]:
        """Requests with an added output or drained cycles that no pop has claimed yet."""
        return set(self._finished) | set(self._pending)

    def discard_unclaimed(self) -> int:
        """Forget the outputs and cycles no claim took, where none of the caller's requests runs; how many."""
        orphans, self._finished, self._by_tokens, self._pending = len(self.unclaimed_request_ids), {}, {}, {}
        return orphans

    def _claim(self, request_ids: list[str]) -> list[SequenceRecord]:
        if len(set(request_ids)) != len(request_ids):
            raise RecordCollectionError(f"a request is claimed twice in one pop_all: {request_ids}")
        for request_id in request_ids:  # all claimable, before any is forgotten
            finished = self._finished.get(request_id)
            if finished is None:
                raise RecordCollectionError(f"request {request_id!r}: no finished output was added for it "
                                            "(add_output)")
            if self._num_drains <= finished.drains_before:
                raise RecordCollectionError(
                    f"request {request_id!r}: no capture payload was drained after its output finished, so its "
                    "last cycles may still sit in the engine; add_drained(growmtp_drain_records) before popping")
        records = [self._build(request_id, self._forget(request_id), self._pending.pop(request_id, _Pending()))
                   for request_id in request_ids]
        validate_records(records, depth=self.depth, vocab_size=self.vocab_size,
                         topk=self.topk if self.vocab_size else None,
                         names=[f"request {request_id!r}" for request_id in request_ids])
        return records

    def _forget(self, request_id: str) -> _Finished:
        finished = self._finished.pop(request_id)
        key = _committed(finished.output)
        self._by_tokens[key] = [entry for entry in self._by_tokens[key] if entry[1] != request_id]
        if not self._by_tokens[key]:
            del self._by_tokens[key]
        return finished

    def _build(self, request_id: str, finished: _Finished, pending: _Pending) -> SequenceRecord:
        output = finished.output
        token_ids = torch.tensor(_committed(output), dtype=torch.int64)  # [T]
        if len(pending.cycles) == 1:  # views of the payload's rows (packed records hold only their own)
            cycles = {name: pending.cycles[0][name] for name in RECORD_FIELDS}
        elif pending.cycles:
            cycles = {name: torch.cat([c[name] for c in pending.cycles]) for name in RECORD_FIELDS}
        else:  # finished before any cycle (e.g. at prefill)
            cycles = {"start": torch.zeros(0, dtype=torch.int64),
                      "drafts": torch.zeros(0, self.depth, dtype=torch.int32),
                      "topk_ids": torch.zeros(0, self.depth, self.topk, dtype=torch.int32),
                      "topk_logprobs": torch.zeros(0, self.depth, self.topk, dtype=torch.bfloat16),
                      "accepted": torch.zeros(0, dtype=torch.int64)}
        accepted, num_dropped = cycles["accepted"], 0  # of every verify step of the request (kept, dropped)
        if pending.dropped:
            dropped_start = torch.cat([d[0] for d in pending.dropped])
            num_dropped = len(dropped_start)
            order = torch.cat([cycles["start"], dropped_start]).argsort(stable=True)
            accepted = torch.cat([accepted, torch.cat([d[1] for d in pending.dropped])])[order]
        checked = _check_against_vllm(request_id, output, accepted)
        hidden = None
        if pending.hidden and not pending.hidden_dropped:
            hidden = _hidden_rows(pending.hidden, len(token_ids), cycles["start"], self.hidden_dtype)
        elif self.capture_hidden and not pending.hidden_dropped and len(cycles["start"]):
            raise RecordCollectionError(f"request {request_id!r}: exact mode, but the engine captured no hidden "
                                        "states for its cycles")
        meta = {REQUEST_ID_META: request_id, DROPPED_META: num_dropped, CHECKED_META: checked}
        if len(pending.draft_vocabs) > 1:
            raise RecordCollectionError(f"request {request_id!r}: its cycles were drafted over different draft "
                                        f"vocabularies {sorted(map(str, pending.draft_vocabs))}")
        if tag := next(iter(pending.draft_vocabs), None):
            meta[DRAFT_VOCAB_META] = tag
        return SequenceRecord(token_ids=token_ids, prompt_len=len(output.prompt_token_ids), hidden=hidden,
                              temperature=finished.temperature, meta=meta, **cycles)


def _committed(output) -> tuple[int, ...]:
    """Prompt + response token ids of a RequestOutput with one completion."""
    return tuple(output.prompt_token_ids) + tuple(output.outputs[0].token_ids)


def _check_against_vllm(request_id: str, output, accepted: torch.Tensor) -> bool:
    """The captured accepted counts [R] must equal vLLM's own per-step ones, when vLLM reports them (then
    True: compared; False: vLLM reported none)."""
    metrics = output.outputs[0].spec_decode_metrics
    if metrics is None:
        return False
    if metrics.per_step_accepted:  # "detailed": the ordered sequence
        expected, found = list(metrics.per_step_accepted), accepted.tolist()
    else:  # "summary", or no verify step at all: the histogram over 0..K
        expected = list(metrics.histogram)
        found = torch.bincount(accepted, minlength=len(expected)).tolist()
    if found != expected:
        raise RecordCollectionError(
            f"request {request_id!r}: captured cycles {found} differ from vLLM's own per-request counts "
            f"{expected} (accepted drafts per verify step): cycles are missing or belong to another request")
    return True


def _hidden_rows(chunks: list[tuple[torch.Tensor, torch.Tensor]], length: int, starts: torch.Tensor,
                 dtype: torch.dtype) -> torch.Tensor:
    """[T, H] from captured (positions [n], rows [n, H]) chunks; rows after the last cycle start were never
    consumed by the head and stay zero."""
    positions = torch.cat([p for p, _ in chunks])
    rows = torch.cat([h for _, h in chunks])
    hidden = torch.zeros(length, rows.shape[-1], dtype=rows.dtype)
    keep = positions < length
    hidden[positions[keep]] = rows[keep]
    seen = torch.zeros(length, dtype=torch.bool)
    seen[positions[keep]] = True
    needed = int(starts.max()) + 1 if starts.numel() else 0
    if not bool(seen[:needed].all()):
        missing = (~seen[:needed]).nonzero().flatten()[:8].tolist()
        raise RecordCollectionError(f"hidden states of committed positions {missing} were never computed by the "
                                    "engine (prefix-cache hit?); exact mode needs enable_prefix_caching=False")
    return hidden.to(dtype)
