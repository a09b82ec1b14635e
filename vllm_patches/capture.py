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


CYCLE_FIELDS = ("start", "drafts", "topk_ids", "topk_logprobs", "accepted", "q")


@dataclass
class CaptureState:
    """Per-process capture state (one per vLLM worker)."""

    enabled: bool = False
    topk: int = 64
    logprob_dtype: torch.dtype = torch.bfloat16
    capture_q: bool = False
    capture_hidden: bool = False
    # one entry per verification step: {"req_ids": [...], field: tensor with one row per request}
    steps: list[dict] = field(default_factory=list)
    # exact mode: request id -> [(positions [n], hidden [n, H]), ...]
    hidden: dict[str, list] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    verify: dict | None = None  # what rejection_sample saw in the current step
    proposal: tuple | None = None  # what propose saw in the current step (exact mode)

    def clear(self) -> None:
        self.steps.clear()
        self.hidden.clear()
        self.errors.clear()


STATE = CaptureState()


def configure(enabled: bool, topk: int = 64, logprob_dtype: str = "bfloat16", capture_q: bool = False,
              capture_hidden: bool = False) -> None:
    """Switch capture on or off for this process and drop anything captured before (a previous engine's)."""
    STATE.clear()
    STATE.enabled, STATE.topk = bool(enabled), int(topk)
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
    """Store one verification step, vectorised: one row per request that had drafts verified."""
    counts = torch.tensor(metadata.num_draft_tokens)
    rows = counts.nonzero().flatten()
    if rows.numel() == 0:
        return
    names = [req_ids[i] for i in rows.tolist()]
    if not verify["has_q"]:
        STATE.errors.append(f"requests {names}: drafts verified without draft probabilities (vLLM fell back to "
                            "one-hot q), so their outputs are not samples of the target")
        return
    depth = int(counts[rows[0]])
    if not bool((counts[rows] == depth).all()):
        STATE.errors.append(f"requests {names}: different numbers of drafts verified in one step "
                            f"({counts[rows].tolist()}); records need K per cycle")
        return
    n = rows.numel()
    step = {
        "req_ids": names,
        "start": torch.as_tensor(computed, dtype=torch.int64)[rows] - 1,
        "drafts": _host(metadata.draft_token_ids, torch.int32).view(n, depth),
        "topk_ids": verify["topk_ids"].view(n, depth, -1),
        "topk_logprobs": verify["topk_logprobs"].view(n, depth, -1),
        "accepted": (sampled[rows] != PLACEHOLDER_TOKEN_ID).sum(dim=1) - 1,
    }
    if verify["q"] is not None:
        step["q"] = verify["q"].view(n, depth, -1)
    STATE.steps.append(step)


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


# ---- transport --------------------------------------------------------------------------------------
def drain() -> bytes:
    """Everything captured since the last drain, as one blob (tensors do not survive vLLM's RPC otherwise).

    Cycles are grouped by request: `req_ids[i]` owns the next `counts[i]` rows of every cycle field.
    """
    payload: dict = {"errors": list(STATE.errors), "req_ids": [], "counts": torch.zeros(0, dtype=torch.int64)}
    if STATE.steps:
        owners = [req_id for step in STATE.steps for req_id in step["req_ids"]]
        req_ids = list(dict.fromkeys(owners))
        index = {req_id: i for i, req_id in enumerate(req_ids)}
        owner = torch.tensor([index[r] for r in owners])
        order = torch.sort(owner, stable=True).indices  # cycles of a request stay in step order
        payload.update(req_ids=req_ids, counts=torch.bincount(owner, minlength=len(req_ids)))
        for name in CYCLE_FIELDS:
            if name in STATE.steps[0]:
                payload[name] = torch.cat([step[name] for step in STATE.steps])[order]
    payload["hidden"] = {req_id: (torch.cat([p for p, _ in chunks]), torch.cat([h for _, h in chunks]))
                         for req_id, chunks in STATE.hidden.items()}
    STATE.clear()
    return dump_blob(payload)


def load_blob(blob: bytes) -> dict:
    return torch.load(io.BytesIO(blob), weights_only=True)


def dump_blob(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()
