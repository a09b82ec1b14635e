"""Record capture: hooks on vLLM 0.29's V1 model runner (shared by the CPU and GPU workers).

Terms, defined once (the record's own terms -- cycle, draft path, accepted -- are in core/records.py):

- *internal request id*: the id a worker sees, `"<caller's id>-<8 random chars>"` (vLLM's
  `InputProcessor.assign_request_id`). Everything here is keyed by it; the driver's collector maps it
  back to the caller's id.
- *verification step*: one `GPUModelRunner._sample` call with spec-decode metadata: a single target
  forward that verified the drafts of every request in the batch. N = requests with drafts in the step.
- *cycle row*: one request's share of one verification step (one cycle of its record): start s (the
  runner had computed s + 1 tokens), its K drafts, the target's top-k log-probs at each draft position
  (from the very logits the rejection sampler turns into p: logits processors and temperature applied,
  normalised over the full vocabulary), and `accepted` (valid sampled tokens - 1).
- *q rows* (debug, `capture_q`): the full draft distribution the rejection sampler received.
- *committed hidden rows* (exact mode, `capture_hidden`): per propose call and request, the target's
  final-norm hidden states of the positions committed so far, exactly as the head's first pass consumed them.
- *payload*: what `drain` returns (as a `transport.dump_blob`, or the dict itself in-process), with
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
      dropped        {internal id: (start [d] int64, accepted [d] int64)}, cycles verified but not recorded
  A request's rows keep their step order.
- *dropped cycle*: a verified cycle that cannot be a record's: its drafts were not K samples of the head's
  q. vLLM 0.29 makes those near `max_model_len`: when a batch's next input would not fit the drafter it
  drafts K zeros with no q for the whole batch (`GPUModelRunner.propose_draft_token_ids`, verified against a
  one-hot q, which still yields target samples), and the scheduler trims a request's drafts to what fits
  (`Scheduler.schedule`). Its start and accepted count are kept, so that the collector can
  still compare every verify step with vLLM's own counters.

Hooks (installed once per process by the plugin, inert until `configure` enables them):
- `rejection_sampler.rejection_sample`: sees q and the processed target logits;
- `GPUModelRunner._sample`: maps rows to request ids, reads starts and accepted counts;
- `SpecDecodeBaseProposer.propose` + `GPUModelRunner.propose_draft_token_ids`: hidden states (exact mode).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from . import check_vllm_version
from .settings import CaptureConfig
from .transport import dump_blob

check_vllm_version()

import vllm.v1.sample.rejection_sampler as rejection_sampler  # noqa: E402
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer  # noqa: E402
from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # noqa: E402

PLACEHOLDER_TOKEN_ID = -1  # rejected slots in the sampler's output (vLLM's PLACEHOLDER_TOKEN_ID)
_HOOK_MARK = "__growmtp_hook__"
# the per-cycle tensors of a payload (q only with capture_q), in the order the collector reads them
CYCLE_FIELDS = ("start", "drafts", "topk_ids", "topk_logprobs", "accepted", "q")
NUMPY_SELECT_DTYPES = (torch.float32, torch.float64)  # what top_k_rows hands to numpy (the hook's log-probs are fp32)


def _private_copy(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host copy that never aliases vLLM's persistent buffers (on CPU, .cpu() and .long() may not copy)."""
    return tensor.detach().to("cpu", dtype=dtype, copy=True)


@dataclass
class CaptureState:
    """Per-process capture state (one per vLLM worker; in-process engines share it)."""

    config: CaptureConfig = field(default_factory=lambda: CaptureConfig(enabled=False))
    # one entry per verification step, as record_verification kept it (per batch row: req_ids, computed,
    # counts, sampled; per draft position: drafts, topk_ids, topk_logprobs, q); drain makes cycle rows
    steps: list[dict] = field(default_factory=list)
    # exact mode: internal id -> [(positions [n], hidden [n, H]), ...] per propose call
    hidden: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    verify: dict | None = None  # what rejection_sample saw in the current step
    proposal: tuple | None = None  # what propose saw in the current step (exact mode)

    def clear(self) -> None:
        self.steps.clear()
        self.hidden.clear()
        self.errors.clear()


STATE = CaptureState()


def configure(config: CaptureConfig) -> None:
    """Switch capture on or off for this process and drop anything captured before (a previous engine's)."""
    if not isinstance(config, CaptureConfig):
        raise TypeError(f"configure takes a CaptureConfig, got {type(config).__name__}")
    STATE.clear()
    STATE.config = config


def hooks_active(runner) -> bool:
    """Whether the runner actually used in this worker runs through our hooks."""
    return isinstance(runner, GPUModelRunner) and all(
        getattr(getattr(type(runner), name), _HOOK_MARK, False) for name in ("_sample", "propose_draft_token_ids"))


# ---- hooks ----------------------------------------------------------------------------------------
def _rejection_sample_hook(original):
    @functools.wraps(original)
    def rejection_sample(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                         target_logits, *args, **kwargs):
        # draft_token_ids: [num_tokens]; draft_probs: [num_tokens, V] or None; target_logits: [num_tokens, V]
        config = STATE.config
        if config.enabled:
            logprobs = torch.log_softmax(target_logits.float(), dim=-1)  # [num_tokens, V]
            values, ids = top_k_rows(logprobs, min(config.topk, logprobs.shape[-1]))  # [num_tokens, k]
            STATE.verify = {
                "topk_ids": _private_copy(ids, torch.int32),
                "topk_logprobs": _private_copy(values, getattr(torch, config.logprob_dtype)),
                "has_q": draft_probs is not None,
                "q": (_private_copy(draft_probs, torch.float32) if config.capture_q and draft_probs is not None
                      else None),
            }
        return original(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                        target_logits, *args, **kwargs)

    setattr(rejection_sample, _HOOK_MARK, True)
    return rejection_sample


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


def _sample_hook(original):
    @functools.wraps(original)
    def _sample(self, logits, spec_decode_metadata):
        if not STATE.config.enabled or spec_decode_metadata is None:
            return original(self, logits, spec_decode_metadata)
        req_ids = list(self.input_batch.req_ids)
        computed = self.input_batch.num_computed_tokens_cpu[: len(req_ids)].tolist()  # per batch row
        STATE.verify = None
        output = original(self, logits, spec_decode_metadata)
        verify, STATE.verify = STATE.verify, None
        if verify is None:
            STATE.errors.append("a verification step bypassed rejection_sample (hook not reached)")
            return output
        # sampled_token_ids: [batch, max_spec_len + 1], PLACEHOLDER_TOKEN_ID after the first rejection
        record_verification(req_ids, computed, spec_decode_metadata, _private_copy(output.sampled_token_ids), verify,
                            depth=self.speculative_config.num_speculative_tokens)
        return output

    setattr(_sample, _HOOK_MARK, True)
    return _sample


def record_verification(req_ids: list[str], computed: list[int], metadata, sampled: torch.Tensor,
                        verify: dict, depth: int) -> None:
    """Keep one verification step for `drain`, which turns all kept steps into cycle rows at once: one
    cycle row per request whose K = `depth` drafts were sampled from q and verified; a request with fewer
    drafts, or a step without q, drops its cycle. The step itself only copies what it must.

    req_ids, computed: per batch row; metadata: vLLM's SpecDecodeMetadata (num_draft_tokens per row,
    draft_token_ids [num_tokens]); sampled: [batch, max_spec_len + 1]; verify: what the
    rejection_sample hook saw (topk_ids / topk_logprobs [num_tokens, k], q [num_tokens, V] or None).
    """
    assert sampled.ndim == 2, sampled.shape
    counts = list(metadata.num_draft_tokens)
    if sum(counts) != verify["topk_ids"].shape[0]:
        STATE.errors.append(f"a verification step verified {verify['topk_ids'].shape[0]} draft positions, but its "
                            f"requests drafted {sum(counts)}")
        return
    rows = len(counts)  # the batch rows
    STATE.steps.append({
        "req_ids": list(req_ids[:rows]), "computed": list(computed[:rows]), "counts": counts, "depth": depth,
        "sampled": sampled[:rows], "drafts": _private_copy(metadata.draft_token_ids, torch.int32), **verify})


def _cycle_rows(steps: list[dict]) -> tuple[list[str], torch.Tensor, dict[str, torch.Tensor],
                                            dict[str, list[tuple[int, int]]]]:
    """The kept steps' cycle rows grouped by request, each request's in step order: (request ids in
    first-seen order, rows per request, field -> [C, ...], dropped cycles)."""
    depth = steps[0]["depth"]
    owners_all = [req_id for step in steps for req_id in step["req_ids"]]  # batch rows
    counts = torch.tensor([c for step in steps for c in step["counts"]], dtype=torch.int64)
    has_q = torch.tensor([step["has_q"] for step in steps]).repeat_interleave(
        torch.tensor([len(step["counts"]) for step in steps]))
    start = torch.tensor([c for step in steps for c in step["computed"]], dtype=torch.int64) - 1
    width = max(step["sampled"].shape[1] for step in steps)  # max_spec_len + 1 (a trimmed step's is less)
    sampled = torch.cat([step["sampled"] if step["sampled"].shape[1] == width else
                         F.pad(step["sampled"], (0, width - step["sampled"].shape[1]), value=PLACEHOLDER_TOKEN_ID)
                         for step in steps])
    accepted = (sampled != PLACEHOLDER_TOKEN_ID).sum(dim=1) - 1  # valid sampled tokens - 1, per batch row
    keep = (counts == depth) & has_q
    dropped: dict[str, list[tuple[int, int]]] = {}
    for i in ((counts > 0) & ~keep).nonzero().flatten().tolist():
        dropped.setdefault(owners_all[i], []).append((int(start[i]), int(accepted[i])))
    kept = keep.nonzero().flatten()
    owners = [owners_all[i] for i in kept.tolist()]
    req_ids = list(dict.fromkeys(owners))
    index = {req_id: i for i, req_id in enumerate(req_ids)}
    owner = torch.tensor([index[r] for r in owners], dtype=torch.int64)
    kept = kept[torch.sort(owner, stable=True).indices]  # grouped by request, each request's in step order
    # the steps' draft positions side by side: a row's drafts follow the earlier rows' (of every step)
    flat = (torch.cumsum(counts, 0) - counts)[kept][:, None] + torch.arange(depth)  # [C, K]
    rows = {"start": start[kept], "accepted": accepted[kept]}
    for name in ("drafts", "topk_ids", "topk_logprobs"):
        rows[name] = torch.cat([step[name] for step in steps])[flat]
    if any(step["q"] is not None for step in steps):  # capture_q: a step without q has only dropped rows
        width = next(step["q"] for step in steps if step["q"] is not None).shape[-1]
        rows["q"] = torch.cat([step["q"] if step["q"] is not None else torch.zeros(sum(step["counts"]), width)
                               for step in steps])[flat]
    return req_ids, torch.bincount(owner, minlength=len(req_ids)), rows, dropped


def _propose_hook(original):
    @functools.wraps(original)
    def propose(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                next_token_ids, token_indices_to_sample, common_attn_metadata, *args, **kwargs):
        # target_positions: [num_tokens] (or [3, num_tokens] with M-RoPE); target_hidden_states: [num_tokens, H]
        config = STATE.config
        if config.enabled and config.capture_hidden:
            starts = _private_copy(common_attn_metadata.query_start_loc_cpu, torch.int64)  # [batch + 1]
            last = token_indices_to_sample  # [batch], the slot each request samples from
            if last is None:
                last = common_attn_metadata.query_start_loc[1:] - 1
            positions = target_positions if target_positions.dim() == 1 else target_positions[0]
            total = int(starts[-1])
            STATE.proposal = (starts, _private_copy(last, torch.int64), _private_copy(positions[:total], torch.int64),
                              _private_copy(target_hidden_states[:total], torch.float32))
        return original(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                        next_token_ids, token_indices_to_sample, common_attn_metadata, *args, **kwargs)

    setattr(propose, _HOOK_MARK, True)
    return propose


def _propose_draft_token_ids_hook(original):
    @functools.wraps(original)
    def propose_draft_token_ids(self, *args, **kwargs):
        STATE.proposal = None
        result = original(self, *args, **kwargs)
        proposal, STATE.proposal = STATE.proposal, None
        if proposal is not None:
            starts, last, positions, hidden = proposal
            for row, req_id in enumerate(self.input_batch.req_ids[: len(starts) - 1]):
                # slots up to the sampled index are committed; later ones held drafts rejected just now
                committed = slice(int(starts[row]), int(last[row]) + 1)
                STATE.hidden.setdefault(req_id, []).append((positions[committed], hidden[committed]))
        return result

    setattr(propose_draft_token_ids, _HOOK_MARK, True)
    return propose_draft_token_ids


_INSTALLED = False


def install_hooks() -> None:
    """Wrap the runner's methods once per process (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    rejection_sampler.rejection_sample = _rejection_sample_hook(rejection_sampler.rejection_sample)
    GPUModelRunner._sample = _sample_hook(GPUModelRunner._sample)
    GPUModelRunner.propose_draft_token_ids = _propose_draft_token_ids_hook(GPUModelRunner.propose_draft_token_ids)
    SpecDecodeBaseProposer.propose = _propose_hook(SpecDecodeBaseProposer.propose)
    _INSTALLED = True


def drain(as_blob: bool = True) -> bytes | dict:
    """Everything captured since the last drain, as one payload (see the module docstring): a blob for
    RPCs that serialise what they return, or the dict itself where the caller shares this process."""
    payload: dict = {"errors": list(STATE.errors), "req_ids": [], "counts": torch.zeros(0, dtype=torch.int64)}
    dropped: dict[str, list[tuple[int, int]]] = {}
    if STATE.steps:
        req_ids, counts, rows, dropped = _cycle_rows(STATE.steps)
        payload.update(req_ids=req_ids, counts=counts, **rows)
    payload["hidden"] = {req_id: (torch.cat([p for p, _ in chunks]), torch.cat([h for _, h in chunks]))
                         for req_id, chunks in STATE.hidden.items()}
    payload["dropped"] = {req_id: tuple(torch.tensor(column, dtype=torch.int64) for column in zip(*cycles))
                          for req_id, cycles in dropped.items()}
    STATE.clear()
    return dump_blob(payload) if as_blob else payload
