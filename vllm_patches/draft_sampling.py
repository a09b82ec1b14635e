"""Drafts sampled over the draft vocabulary's ids alone (`--growmtp_draft_vocab`).

The head's logits are -inf outside its draft vocabulary (`head_model.GrowMTPHeadModel.compute_logits`), so
vLLM's draft sampler (`llm_base_proposer.compute_probs_and_sample_next_token`) would run its softmax and draw
its noise over the whole vocabulary for ids whose q is 0. For the logits the head marked, vLLM's own sampler
runs on the vocabulary's columns alone, and q goes back into a row of zeros for the rejection sampler: the
same q and the same rule (temperature, softmax, noise, argmax; seeded rows from their generators), with the
noise drawn for N ids instead of V. Any other logits go to vLLM's sampler unchanged.
"""

from __future__ import annotations

import torch

from . import check_vllm_version

check_vllm_version()

_MARKED: list = [None]  # (logits, ids): the head's last logits over a draft vocabulary, until they are sampled


def mark(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`logits` [N, V] are -inf outside `ids` [N ids, int64]: sample them over `ids` alone."""
    _MARKED[0] = (logits, ids)
    return logits


def _over_marked_ids(original):
    def sample(logits: torch.Tensor, sampling_metadata, use_fp64_gumbel: bool = False):
        marked, _MARKED[0] = _MARKED[0], None
        if marked is None or marked[0] is not logits:
            return original(logits, sampling_metadata, use_fp64_gumbel)
        ids = marked[1]
        tokens, probs = original(logits.index_select(-1, ids), sampling_metadata, use_fp64_gumbel)  # [N], [N, n]
        return ids[tokens], probs.new_zeros(logits.shape).index_copy_(-1, ids, probs)

    sample.growmtp_draft_vocab = True
    return sample


def install_draft_sampling() -> bool:
    """Wrap vLLM's draft sampler (idempotent); returns whether it was wrapped now."""
    from vllm.v1.spec_decode import llm_base_proposer

    current = llm_base_proposer.compute_probs_and_sample_next_token
    if getattr(current, "growmtp_draft_vocab", False) or getattr(current, "growmtp_seeded", False):
        return False  # wrapped already (the seeded drafts' wrapper goes around this one)
    llm_base_proposer.compute_probs_and_sample_next_token = _over_marked_ids(current)
    return True
