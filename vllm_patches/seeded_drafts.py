"""Drafts sampled from each request's own generator where the request has a seed.

vLLM 0.29 samples probabilistic drafts (`llm_base_proposer.compute_probs_and_sample_next_token`, called
through the module global by `SpecDecodeBaseProposer._sample_from_logits`) with one draw of exponential
noise for the whole batch from the global RNG, so a seeded request's drafts depend on which other
requests share its batch. Its rejection sampler already draws a seeded request's uniforms and recovered
tokens from the request's generator (`rejection_sampler.sample_recovered_tokens`), and its target sampler
a seeded request's noise (`topk_topp_sampler.random_sample`: the batch's draw, then each seeded row's
drawn again from its generator). Drafts take that same path: around vLLM's draft sampler, the noise it
drew is redrawn for every seeded row from the row's generator, in place, just before vLLM's own
`sample_with_exponential_noise` turns it into tokens (the Gumbel-max rule, argmax of q / E, E ~ Exp(1)).
So the whole draft-then-verify cycle of a seeded request depends only on its own seed and inputs, with no
per-row work beyond the draw and no host sync. Greedy rows are left to vLLM (it takes the argmax for them
whatever the noise); unseeded rows keep vLLM's draw; q (the returned probabilities) is vLLM's either way.
"""

from __future__ import annotations

import torch

from . import check_vllm_version

check_vllm_version()

_ROWS: dict[int, torch.Generator] = {}  # the seeded rows of the draft sampler's call in progress


def _with_row_generators(original):
    """compute_probs_and_sample_next_token: the call's seeded rows, visible to the noise hook below."""
    def sample(logits: torch.Tensor, sampling_metadata, use_fp64_gumbel: bool = False):
        # rows are the batch's requests in order, as the generators' keys are (one draft position at a time)
        _ROWS.clear()
        if not sampling_metadata.all_greedy:
            _ROWS.update(sampling_metadata.generators)
        try:
            return original(logits, sampling_metadata, use_fp64_gumbel)
        finally:
            _ROWS.clear()

    sample.growmtp_seeded = True
    return sample


def _seeded_noise(original):
    """sample_with_exponential_noise(probs [N, V], q [N, V]): each seeded row's q from its own generator."""
    def sample_with_exponential_noise(probs: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        for row, generator in _ROWS.items():
            if row < q.shape[0]:
                q[row].exponential_(generator=generator)
        return original(probs, q)

    return sample_with_exponential_noise


def install_seeded_drafts() -> bool:
    """Wrap vLLM's draft sampler and the noise step it calls (idempotent); returns whether it was wrapped now."""
    from vllm.v1.spec_decode import llm_base_proposer

    current = llm_base_proposer.compute_probs_and_sample_next_token
    if getattr(current, "growmtp_seeded", False):
        return False
    llm_base_proposer.compute_probs_and_sample_next_token = _with_row_generators(current)
    llm_base_proposer.sample_with_exponential_noise = _seeded_noise(llm_base_proposer.sample_with_exponential_noise)
    return True
