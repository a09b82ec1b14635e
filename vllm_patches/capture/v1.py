"""The capture's adapter to vLLM 0.29's V1 model runner (`GPUModelRunner`, which the CPU runner subclasses).

The only code that knows the V1 runner's names. Each hook reads what one verification step decided,
translates it into `core`'s plain terms, and leaves record building to `core` (its docstring defines the
terms). `vllm_patches/README.md` lists each hook point with its vLLM lines and its V2 counterpart.

Hooks (installed once per process by the plugin, inert until `core.configure` enables capture):
- `rejection_sampler.rejection_sample`: the processed target logits and q (`core.read_verification`);
- `GPUModelRunner._sample`: the batch's request ids and starts, the drafts, and the accepted counts read
  off the sampler's output (`core.record_step`);
- `SpecDecodeBaseProposer.propose` inside `GPUModelRunner.propose_draft_token_ids`: exact mode's hidden
  states, attributed to the step's request ids (`core.record_hidden`);
- `GPUModelRunner._input_fits_in_drafter`: a step that skips the drafter for its batch marks the batch's
  requests stale (`core.mark_drafter_skipped`).

vLLM 0.29 verifies some cycles whose drafts are not K samples of the head's q on the request's path (`core`
drops them): near `max_model_len` it skips the drafter and drafts K zeros with no q for the whole batch when
its next input would not fit the drafter (`GPUModelRunner.sample_tokens`), which leaves holes in the draft
model's cache of every request in that batch (stale), and the scheduler trims a request's drafts to what
fits (`Scheduler.schedule`).
"""

from __future__ import annotations

import functools

import torch

from .. import check_vllm_version
from . import core

check_vllm_version()

import vllm.v1.sample.rejection_sampler as rejection_sampler  # noqa: E402
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer  # noqa: E402
from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # noqa: E402

PLACEHOLDER_TOKEN_ID = -1  # rejected slots in the sampler's output (vLLM's PLACEHOLDER_TOKEN_ID)
_HOOK_MARK = "__growmtp_hook__"


class _Pending:
    """What one hook saw for the next to finish, within one runner call (this process's runner)."""

    verified: dict | None = None  # rejection_sample -> _sample: core.read_verification's fields
    proposal: tuple | None = None  # propose -> propose_draft_token_ids: (query_start, sampled_index, positions, hidden)
    # propose -> the next step's _sample: the depth the drafts that step verifies were drafted at (the
    # scheduler's per-step depth under dynamic speculative decoding, `engine_depth`; else always K)
    drafted_depth: int | None = None


def hooks_active(runner) -> bool:
    """Whether the runner actually used in this worker runs through our hooks."""
    return isinstance(runner, GPUModelRunner) and all(
        getattr(getattr(type(runner), name), _HOOK_MARK, False)
        for name in ("_sample", "propose_draft_token_ids", "_input_fits_in_drafter"))


def accepted_counts(sampled: torch.Tensor) -> torch.Tensor:
    """[N] int64 accepted drafts per row of the sampler's [N, max_spec_len + 1] output: its valid tokens
    (accepted drafts + the recovered or bonus token, then PLACEHOLDER_TOKEN_ID) minus one."""
    assert sampled.ndim == 2, sampled.shape
    return (sampled != PLACEHOLDER_TOKEN_ID).sum(dim=1) - 1


def record_verification(req_ids: list[str], computed: list[int], metadata, sampled: torch.Tensor,
                        verified: dict, depth: int, draft_vocab: str | None = None) -> None:
    """One V1 verification step as a `core.VerifyStep`. req_ids, computed: per batch row (the input batch's
    ids and computed token counts); metadata: vLLM's SpecDecodeMetadata (num_draft_tokens per row,
    draft_token_ids [D]); sampled: the sampler's [batch, max_spec_len + 1] output (on its device); verified:
    what `core.read_verification` made of the step's rejection_sample call; depth: K; draft_vocab: the tag of
    the head's draft vocabulary (None: every id)."""
    rows = len(metadata.num_draft_tokens)  # the batch rows
    core.record_step(core.VerifyStep(
        req_ids=list(req_ids[:rows]), start=torch.tensor(computed[:rows], dtype=torch.int64) - 1,
        num_drafts=list(metadata.num_draft_tokens), accepted=accepted_counts(sampled[:rows]),
        drafts=core.device_copy(metadata.draft_token_ids, torch.int32), depth=depth, draft_vocab=draft_vocab,
        **verified))


# ---- hooks ----------------------------------------------------------------------------------------
def _rejection_sample_hook(original):
    @functools.wraps(original)
    def rejection_sample(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                         target_logits, *args, **kwargs):
        # draft_token_ids: [D]; draft_probs: [D, V] or None; target_logits: [D, V], constraints applied
        if core.STATE.config.enabled:
            _Pending.verified = core.read_verification(target_logits, draft_probs)
        return original(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                        target_logits, *args, **kwargs)

    setattr(rejection_sample, _HOOK_MARK, True)
    return rejection_sample


def _sample_hook(original):
    @functools.wraps(original)
    def _sample(self, logits, spec_decode_metadata):
        if not core.STATE.config.enabled or spec_decode_metadata is None:
            return original(self, logits, spec_decode_metadata)
        req_ids = list(self.input_batch.req_ids)
        computed = self.input_batch.num_computed_tokens_cpu[: len(req_ids)].tolist()  # per batch row
        _Pending.verified = None
        output = original(self, logits, spec_decode_metadata)
        verified, _Pending.verified = _Pending.verified, None
        if verified is None:
            core.report_error("a verification step bypassed rejection_sample (hook not reached)")
            return output
        # sampled_token_ids: [batch, max_spec_len + 1], PLACEHOLDER_TOKEN_ID after the first rejection
        depth = _Pending.drafted_depth
        if depth is None:
            depth = self.speculative_config.num_speculative_tokens
        # accepted counts read on the sampler's device: no host copy in the step
        record_verification(req_ids, computed, spec_decode_metadata, output.sampled_token_ids, verified, depth=depth,
                            draft_vocab=getattr(self.get_draft_model(), "draft_vocab_tag", None))
        return output

    setattr(_sample, _HOOK_MARK, True)
    return _sample


def _propose_hook(original):
    @functools.wraps(original)
    def propose(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                next_token_ids, token_indices_to_sample, common_attn_metadata, *args, **kwargs):
        # target_positions: [num_tokens] (or [3, num_tokens] with M-RoPE); target_hidden_states: [num_tokens, H]
        _Pending.drafted_depth = int(num_speculative_tokens)
        config = core.STATE.config
        if config.enabled and config.capture_hidden:
            query_start = core.host_copy(common_attn_metadata.query_start_loc_cpu, torch.int64)  # [batch + 1]
            sampled_index = token_indices_to_sample  # [batch], the slot each request samples from
            if sampled_index is None:
                sampled_index = common_attn_metadata.query_start_loc[1:] - 1
            positions = target_positions if target_positions.dim() == 1 else target_positions[0]
            total = int(query_start[-1])
            _Pending.proposal = (query_start, core.host_copy(sampled_index, torch.int64),
                                 core.host_copy(positions[:total], torch.int64),
                                 core.host_copy(target_hidden_states[:total], torch.float32))
        return original(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                        next_token_ids, token_indices_to_sample, common_attn_metadata, *args, **kwargs)

    setattr(propose, _HOOK_MARK, True)
    return propose


def _propose_draft_token_ids_hook(original):
    @functools.wraps(original)
    def propose_draft_token_ids(self, *args, **kwargs):
        _Pending.proposal = None
        result = original(self, *args, **kwargs)
        proposal, _Pending.proposal = _Pending.proposal, None
        if proposal is not None:
            core.record_hidden(self.input_batch.req_ids, *proposal)
        return result

    setattr(propose_draft_token_ids, _HOOK_MARK, True)
    return propose_draft_token_ids


def _input_fits_in_drafter_hook(original):
    @functools.wraps(original)
    def _input_fits_in_drafter(self, common_attn_metadata):
        fits = original(self, common_attn_metadata)
        if not fits and core.STATE.config.enabled:  # the drafter will not run for this step's batch
            core.mark_drafter_skipped(list(self.input_batch.req_ids))
        return fits

    setattr(_input_fits_in_drafter, _HOOK_MARK, True)
    return _input_fits_in_drafter


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
    GPUModelRunner._input_fits_in_drafter = _input_fits_in_drafter_hook(GPUModelRunner._input_fits_in_drafter)
    _INSTALLED = True
