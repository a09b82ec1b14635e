"""Record capture without a model runner: verification steps in plain terms in, one payload per drain out.

A runner adapter (`v1.py` for vLLM 0.29's V1 runner) reads each verification step at its hook points
and hands it here; the worker extension drains. Nothing here knows a runner's names, so a step can be
built by hand (`tests/vllm/test_capture_core.py` does). The record's words (cycle, draft position,
top-k, record) are the README's glossary; the words of capture:

- *internal request id*: the id a worker sees, `"<caller's id>-<8 random chars>"` (vLLM's
  `InputProcessor.assign_request_id`). Everything here is keyed by it; the driver's collector maps it
  back to the caller's id.
- *verification step*: one target forward that verified the drafts of every request in its batch; its
  N rows are the batch's requests, its verified draft positions those rows' drafts, row after row.
- *cycle row*: one request's share of one verification step, one cycle of its record: start s (the
  runner had computed s + 1 tokens), its K drafts, the target's top-k log-probs at each draft position
  (from the logits the rejection sampler turned into p: logits processors and temperature applied,
  normalised over the full vocabulary), and the accepted count.
- *dropped cycle*: a verified cycle that cannot be a record's, because its drafts were not K samples of
  the head's q on the request's path (fewer than K drafts, a step verified without q, or a stale request's).
  Its start and accepted count are kept, so the collector can still compare every verification step with
  vLLM's own counters.
- *stale request*: one that was in the batch of a step that skipped the drafter (vLLM does, near
  `max_model_len`). The draft model's cache got no entries for the positions that step committed, so every
  later draft of the request comes from a cache with holes, not the q the trainer reconstructs: every cycle
  verified after the skip is dropped.
- *committed hidden rows* (exact mode, `capture_hidden`): the target's final-norm hidden states of a
  request's committed positions, as the head's first pass consumed them.
- *payload*: what `drain` returns (a `transport.dump_blob`, or the dict itself in-process), with
  C = total cycle rows and k = the recorded top-k width (`min(topk, V)`):
      errors         list[str]      engine-side failures; the driver raises on any
      req_ids        list[str]      internal ids that own cycle rows, first-seen order
      counts         [len(req_ids)] int64, cycle rows per request; req_ids[i] owns the next counts[i] rows
      start          [C] int64
      drafts         [C, K] int32
      topk_ids       [C, K, k] int32
      topk_logprobs  [C, K, k] the configured log-prob dtype
      accepted       [C] int64 in 0..K
      q              [C, K, V] float32 (capture_q only)
      hidden         {internal id: (positions [n] int64, rows [n, H] float32)} (capture_hidden only)
      dropped        {internal id: (start [d] int64, accepted [d] int64)}
      draft_vocab    str | None, the tag of the draft vocabulary the cycles were drafted over (with cycles)
  A request's rows keep their step order.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ..settings import CaptureConfig
from ..transport import dump_blob

# the per-cycle tensors of a payload (q only with capture_q), in the order the collector reads them
CYCLE_FIELDS = ("start", "drafts", "topk_ids", "topk_logprobs", "accepted", "q")
NUMPY_SELECT_DTYPES = (torch.float32, torch.float64)  # what top_k_rows hands to numpy (target log-probs are fp32)


@dataclass
class VerifyStep:
    """One verification step, as the runner decided it. Its tensors alias no runner buffer and stay on the
    runner's device until `drain` moves every step's to the host at once: no host copy, so no sync, per step.

    N = rows (the batch's requests); D = sum(num_drafts), the step's verified draft positions, row after row.
    """

    req_ids: list[str]  # [N] internal request ids
    start: torch.Tensor  # [N] int64, each row's cycle start s
    num_drafts: list[int]  # [N] drafts verified per row: 0 is no cycle, fewer than depth a dropped cycle
    accepted: torch.Tensor  # [N] int64, drafts accepted per row
    drafts: torch.Tensor  # [D] int32
    topk_ids: torch.Tensor  # [D, k] int32, the target's top-k at each draft position (`read_verification`)
    topk_logprobs: torch.Tensor  # [D, k] the configured log-prob dtype
    has_q: bool  # the drafts were sampled from q; False: the runner drafted without q (every cycle dropped)
    q: torch.Tensor | None  # [D, V] float32, the q rows the rejection sampler received (capture_q only)
    depth: int  # drafts per cycle this step's drafts were drafted at (K, or less where set while running)
    draft_vocab: str | None = None  # the tag of the draft vocabulary the head drafted over (None: every id)
    stale: list[bool] = field(default_factory=list)  # [N] the row's request is stale (`record_step` sets it)


@dataclass
class CaptureState:
    """Per-process capture state (one per vLLM worker; in-process engines share it)."""

    config: CaptureConfig = field(default_factory=lambda: CaptureConfig(enabled=False))
    steps: list[VerifyStep] = field(default_factory=list)  # since the last drain, in step order
    # exact mode: internal id -> [(positions [n], hidden [n, H]), ...] per drafting call
    hidden: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    # internal ids of stale requests; kept across drains (a request can outlive one), emptied by `configure`
    stale: set[str] = field(default_factory=set)

    def clear(self) -> None:
        """Forget what was captured since the last drain (the stale requests stay stale)."""
        self.steps.clear()
        self.hidden.clear()
        self.errors.clear()


STATE = CaptureState()


def configure(config: CaptureConfig) -> None:
    """Switch capture on or off for this process and drop anything captured before (a previous engine's)."""
    if not isinstance(config, CaptureConfig):
        raise TypeError(f"configure takes a CaptureConfig, got {type(config).__name__}")
    STATE.clear()
    STATE.stale.clear()
    STATE.config = config


def host_copy(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host copy that never aliases the runner's persistent buffers (on CPU, .cpu() and .long() may not copy)."""
    return tensor.detach().to("cpu", dtype=dtype, copy=True)


def device_copy(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A copy on the tensor's own device that never aliases the runner's buffers (no host sync)."""
    return tensor.detach().to(dtype=dtype, copy=True)


def read_verification(target_logits: torch.Tensor, draft_probs: torch.Tensor | None) -> dict:
    """What a step's rejection sampler saw, as the records keep it: the `VerifyStep` fields topk_ids,
    topk_logprobs, has_q and q. target_logits [D, V]: the logits the sampler turns into p (logits
    processors and temperature applied); draft_probs [D, V] or None (the runner drafted without q)."""
    config = STATE.config
    logprobs = torch.log_softmax(target_logits.float(), dim=-1)  # [D, V]
    values, ids = top_k_rows(logprobs, min(config.topk, logprobs.shape[-1]))  # [D, k]
    return {"topk_ids": device_copy(ids, torch.int32),
            "topk_logprobs": device_copy(values, getattr(torch, config.logprob_dtype)),
            "has_q": draft_probs is not None,
            "q": device_copy(draft_probs, torch.float32) if config.capture_q and draft_probs is not None else None}


def top_k_rows(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries of each row of [N, n] `rows` and their indices, in no order (a record's row is
    a set): torch.topk, except on CPU where torch would run std::nth_element per row (ATen's TopKImpl.h:
    k * 64 > n) and numpy's vectorised argpartition is faster (`benchmarks/bench_topk.py`)."""
    n = rows.shape[-1]
    if rows.device.type != "cpu" or k * 64 <= n or rows.dtype not in NUMPY_SELECT_DTYPES:
        top = rows.topk(k, dim=-1, sorted=False)
        return top.values, top.indices
    # everything from the (n - k)-th on is >= it; the values by torch's gather (faster than numpy's take)
    ids = torch.from_numpy(np.argpartition(rows.numpy(), n - k, axis=-1)[:, n - k:])
    return rows.gather(-1, ids), ids


def record_step(step: VerifyStep) -> None:
    """Keep one verification step for `drain`, which turns every kept step into cycle rows at once (a step
    keeps what it was given, and which of its rows are stale requests' now). A step whose verified positions do
    not match its rows' drafts is an engine-side error, reported by the next drain."""
    if sum(step.num_drafts) != step.topk_ids.shape[0]:
        report_error(f"a verification step verified {step.topk_ids.shape[0]} draft positions, but its requests "
                     f"drafted {sum(step.num_drafts)}")
        return
    if STATE.stale:
        step = replace(step, stale=[req_id in STATE.stale for req_id in step.req_ids])
    STATE.steps.append(step)


def mark_drafter_skipped(req_ids: list[str]) -> None:
    """A step skipped the drafter for its whole batch, `req_ids`: those requests are stale from now on, and
    `record_step` marks their rows in every later step."""
    STATE.stale.update(req_ids)


def record_hidden(req_ids: list[str], query_start: torch.Tensor, sampled_index: torch.Tensor,
                  positions: torch.Tensor, hidden: torch.Tensor) -> None:
    """Exact mode: one drafting call's committed hidden rows. Per request i: its tokens are rows
    query_start[i]..query_start[i+1]-1 of positions [num_tokens] / hidden [num_tokens, H], and those up to
    sampled_index[i] (the row it samples from) are committed; later rows held drafts rejected just now."""
    for row, req_id in enumerate(req_ids[: len(query_start) - 1]):
        committed = slice(int(query_start[row]), int(sampled_index[row]) + 1)
        STATE.hidden.setdefault(req_id, []).append((positions[committed], hidden[committed]))


def report_error(message: str) -> None:
    """An engine-side failure; the driver raises with its text at the next collection."""
    STATE.errors.append(message)


def drain(as_blob: bool = True) -> bytes | dict:
    """Everything captured since the last drain, as one payload (see the module docstring): a blob for
    RPCs that serialise what they return, or the dict itself where the caller shares this process."""
    payload: dict = {"errors": list(STATE.errors), "req_ids": [], "counts": torch.zeros(0, dtype=torch.int64)}
    dropped: dict[str, list[tuple[int, int]]] = {}
    if STATE.steps:
        req_ids, counts, rows, dropped = cycle_rows(STATE.steps)
        payload.update(req_ids=req_ids, counts=counts, **rows)
        tags = {step.draft_vocab for step in STATE.steps}
        if len(tags) > 1:
            payload["errors"].append(f"draft vocabularies {sorted(map(str, tags))} in one drain: it changes only "
                                     "between generates")
        payload["draft_vocab"] = next(iter(tags))
    payload["hidden"] = {req_id: (torch.cat([p for p, _ in chunks]), torch.cat([h for _, h in chunks]))
                         for req_id, chunks in STATE.hidden.items()}
    payload["dropped"] = {req_id: tuple(torch.tensor(column, dtype=torch.int64) for column in zip(*cycles))
                          for req_id, cycles in dropped.items()}
    STATE.clear()
    return dump_blob(payload) if as_blob else payload


def cycle_rows(steps: list[VerifyStep]) -> tuple[list[str], torch.Tensor, dict[str, torch.Tensor],
                                                 dict[str, list[tuple[int, int]]]]:
    """The steps' cycle rows grouped by request, each request's in step order: (request ids in first-seen
    order, rows per request [len(req_ids)], field -> [C, ...], dropped cycles per request)."""
    depth = steps[0].depth
    if any(step.depth != depth for step in steps):
        raise ValueError(f"verification steps drafted at depths {sorted({step.depth for step in steps})} in one "
                         "drain: a record keeps one depth, so the depth changes only between generates")
    owners_all = [req_id for step in steps for req_id in step.req_ids]  # every step's rows, side by side
    num_drafts = torch.tensor([n for step in steps for n in step.num_drafts], dtype=torch.int64)
    has_q = torch.tensor([step.has_q for step in steps]).repeat_interleave(
        torch.tensor([len(step.num_drafts) for step in steps]))
    start = torch.cat([step.start for step in steps])
    accepted = torch.cat([step.accepted for step in steps]).cpu()  # every step's, to the host at once
    stale = torch.tensor([s for step in steps for s in (step.stale or [False] * len(step.num_drafts))],
                         dtype=torch.bool)
    keep = (num_drafts == depth) & has_q & ~stale
    dropped: dict[str, list[tuple[int, int]]] = {}
    for i in ((num_drafts > 0) & ~keep).nonzero().flatten().tolist():
        dropped.setdefault(owners_all[i], []).append((int(start[i]), int(accepted[i])))
    kept = keep.nonzero().flatten()
    owners = [owners_all[i] for i in kept.tolist()]
    req_ids = list(dict.fromkeys(owners))
    index = {req_id: i for i, req_id in enumerate(req_ids)}
    owner = torch.tensor([index[r] for r in owners], dtype=torch.int64)
    kept = kept[torch.sort(owner, stable=True).indices]  # grouped by request, each request's in step order
    # the steps' draft positions side by side: a row's drafts follow the earlier rows' (of every step)
    flat = (torch.cumsum(num_drafts, 0) - num_drafts)[kept][:, None] + torch.arange(depth)  # [C, K]
    rows = {"start": start[kept], "accepted": accepted[kept]}
    for name in ("drafts", "topk_ids", "topk_logprobs"):
        rows[name] = _rows_on_host([getattr(step, name) for step in steps], flat)
    if any(step.q is not None for step in steps):  # capture_q: a step without q has only dropped rows
        some = next(step.q for step in steps if step.q is not None)
        rows["q"] = _rows_on_host([step.q if step.q is not None else some.new_zeros(sum(step.num_drafts),
                                                                                   some.shape[-1])
                                   for step in steps], flat)
    return req_ids, torch.bincount(owner, minlength=len(req_ids)), rows, dropped


def _rows_on_host(per_step: list[torch.Tensor], flat: torch.Tensor) -> torch.Tensor:
    """The steps' draft positions side by side, the rows `flat` picks ([C, K] host indices), on the host."""
    joined = torch.cat(per_step)
    return joined[flat.to(joined.device)].cpu()
