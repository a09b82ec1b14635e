"""Record capture: hooks on vLLM 0.29's V1 model runner (shared by the CPU and GPU workers).

Per draft-then-verify cycle of every request this records, in the worker process:
- start s (the cycle's first head slot; at verification the runner has computed s + 1 tokens),
- the K drafts that were verified, the accepted count (valid sampled tokens - 1),
- the target's top-k log-probs at each draft position, from the very logits the rejection sampler
  turns into p (logits processors and temperature applied), normalised over the full vocabulary,
- optionally (debug) the full q rows the rejection sampler received,
- optionally (exact mode) the target's final-norm hidden states of committed positions, as fed to the
  head's first pass.

Hooks (installed once per process, inert until `enable` is called in that process):
- `rejection_sampler.rejection_sample`: sees q and the processed target logits;
- `GPUModelRunner._sample`: maps rows to request ids, reads starts and accepted counts;
- `SpecDecodeBaseProposer.propose` + `GPUModelRunner.propose_draft_token_ids`: hidden states (exact mode).
"""

from __future__ import annotations

import functools
import io
from dataclasses import dataclass, field

import torch

from . import check_vllm_version

check_vllm_version()

import vllm.v1.sample.rejection_sampler as rejection_sampler  # noqa: E402
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer  # noqa: E402
from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # noqa: E402

PLACEHOLDER_TOKEN_ID = -1  # rejected slots in the sampler's output (vLLM's PLACEHOLDER_TOKEN_ID)
_HOOK_MARK = "__growmtp_hook__"


def _host(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host copy that never aliases vLLM's persistent buffers (on CPU, .cpu() and .long() may not copy)."""
    return tensor.detach().to("cpu", dtype=dtype, copy=True)


@dataclass
class _Cycles:
    start: list[int] = field(default_factory=list)
    drafts: list[torch.Tensor] = field(default_factory=list)
    topk_ids: list[torch.Tensor] = field(default_factory=list)
    topk_logprobs: list[torch.Tensor] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    q: list[torch.Tensor] = field(default_factory=list)
    hidden_positions: list[torch.Tensor] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)


@dataclass
class CaptureState:
    """Per-process capture state (one per vLLM worker)."""

    enabled: bool = False
    topk: int = 64
    logprob_dtype: torch.dtype = torch.bfloat16
    capture_q: bool = False
    capture_hidden: bool = False
    requests: dict[str, _Cycles] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    verify: dict | None = None  # what rejection_sample saw in the current step
    proposal: tuple | None = None  # what propose saw in the current step (exact mode)

    def cycles(self, req_id: str) -> _Cycles:
        return self.requests.setdefault(req_id, _Cycles())


STATE = CaptureState()


def enable(topk: int = 64, logprob_dtype: str = "bfloat16", capture_q: bool = False,
           capture_hidden: bool = False) -> None:
    STATE.enabled, STATE.topk = True, int(topk)
    STATE.logprob_dtype = getattr(torch, logprob_dtype)
    STATE.capture_q, STATE.capture_hidden = bool(capture_q), bool(capture_hidden)


def hooks_active(runner) -> bool:
    """Whether the runner actually used in this worker runs through our hooks."""
    return isinstance(runner, GPUModelRunner) and all(
        getattr(getattr(type(runner), name), _HOOK_MARK, False) for name in ("_sample", "propose_draft_token_ids"))


# ---- hooks ----------------------------------------------------------------------------------------
def _rejection_sample_hook(original):
    @functools.wraps(original)
    def rejection_sample(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                         target_logits, *args, **kwargs):
        if STATE.enabled:
            logprobs = torch.log_softmax(target_logits.float(), dim=-1)
            top = logprobs.topk(min(STATE.topk, logprobs.shape[-1]), dim=-1)
            STATE.verify = {
                "topk_ids": _host(top.indices, torch.int32),
                "topk_logprobs": _host(top.values, STATE.logprob_dtype),
                "has_q": draft_probs is not None,
                "q": _host(draft_probs, torch.float32) if STATE.capture_q and draft_probs is not None else None,
            }
        return original(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                        target_logits, *args, **kwargs)

    setattr(rejection_sample, _HOOK_MARK, True)
    return rejection_sample


def _sample_hook(original):
    @functools.wraps(original)
    def _sample(self, logits, spec_decode_metadata):
        if not STATE.enabled or spec_decode_metadata is None:
            return original(self, logits, spec_decode_metadata)
        req_ids = list(self.input_batch.req_ids)
        computed = self.input_batch.num_computed_tokens_cpu[: len(req_ids)].tolist()
        STATE.verify = None
        output = original(self, logits, spec_decode_metadata)
        verify, STATE.verify = STATE.verify, None
        if verify is None:
            STATE.errors.append("a verification step bypassed rejection_sample (hook not reached)")
            return output
        _record_verification(req_ids, computed, spec_decode_metadata, _host(output.sampled_token_ids), verify)
        return output

    setattr(_sample, _HOOK_MARK, True)
    return _sample


def _record_verification(req_ids, computed, metadata, sampled: torch.Tensor, verify: dict) -> None:
    drafts = _host(metadata.draft_token_ids, torch.int32)
    offset = 0
    for row, (req_id, num_drafts) in enumerate(zip(req_ids, metadata.num_draft_tokens)):
        if num_drafts == 0:
            continue
        rows = slice(offset, offset + num_drafts)
        offset += num_drafts
        if not verify["has_q"]:
            STATE.errors.append(f"request {req_id}: drafts verified without draft probabilities (vLLM fell back "
                                "to one-hot q), so its outputs are not samples of the target")
            continue
        cycles = STATE.cycles(req_id)
        valid = int((sampled[row] != PLACEHOLDER_TOKEN_ID).sum())
        cycles.start.append(int(computed[row]) - 1)
        cycles.drafts.append(drafts[rows])
        cycles.topk_ids.append(verify["topk_ids"][rows])
        cycles.topk_logprobs.append(verify["topk_logprobs"][rows])
        cycles.accepted.append(valid - 1)
        if verify["q"] is not None:
            cycles.q.append(verify["q"][rows])


def _propose_hook(original):
    @functools.wraps(original)
    def propose(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                next_token_ids, token_indices_to_sample, common_attn_metadata, *args, **kwargs):
        if STATE.enabled and STATE.capture_hidden:
            starts = _host(common_attn_metadata.query_start_loc_cpu, torch.int64)
            last = token_indices_to_sample
            if last is None:
                last = common_attn_metadata.query_start_loc[1:] - 1
            positions = target_positions if target_positions.dim() == 1 else target_positions[0]
            total = int(starts[-1])
            STATE.proposal = (starts, _host(last, torch.int64), _host(positions[:total], torch.int64),
                              _host(target_hidden_states[:total], torch.float32))
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
                cycles = STATE.cycles(req_id)
                cycles.hidden_positions.append(positions[committed])
                cycles.hidden.append(hidden[committed])
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


# ---- transport --------------------------------------------------------------------------------------
def drain() -> bytes:
    """Everything captured since the last drain, as one blob (tensors do not survive vLLM's RPC otherwise)."""
    payload = {"errors": list(STATE.errors), "requests": {}}
    for req_id, c in STATE.requests.items():
        entry = {}
        if c.start:
            entry.update(start=torch.tensor(c.start, dtype=torch.int64), drafts=torch.stack(c.drafts),
                         topk_ids=torch.stack(c.topk_ids), topk_logprobs=torch.stack(c.topk_logprobs),
                         accepted=torch.tensor(c.accepted, dtype=torch.int64))
            if c.q:
                entry["q"] = torch.stack(c.q)
        if c.hidden:
            entry.update(hidden_positions=torch.cat(c.hidden_positions), hidden=torch.cat(c.hidden))
        payload["requests"][req_id] = entry
    STATE.requests.clear()
    STATE.errors.clear()
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getvalue()


def load_blob(blob: bytes) -> dict:
    return torch.load(io.BytesIO(blob), weights_only=True)


def dump_blob(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()
