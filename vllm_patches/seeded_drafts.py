"""Drafts sampled from each request's own generator where the request has a seed.

vLLM 0.29 samples probabilistic drafts (`llm_base_proposer.compute_probs_and_sample_next_token`, called
through the module global by `SpecDecodeBaseProposer._sample_from_logits`) with one draw of exponential
noise for the whole batch from the global RNG, so a seeded request's drafts depend on which other
requests share its batch. Its rejection sampler already draws a seeded request's uniforms and recovered
tokens from the request's generator (`rejection_sampler.sample_recovered_tokens`). Here a seeded row's
draft is redrawn from its own generator, by the same Gumbel-max rule (argmax of q / E, E ~ Exp(1)), so
the whole draft-then-verify cycle of a seeded request depends only on its own seed and inputs. Unseeded
rows keep vLLM's draw; q (the returned probabilities) is vLLM's either way.
"""

from __future__ import annotations

import torch

from . import check_vllm_version

check_vllm_version()

_GREEDY_BELOW = 1e-5  # temperatures vLLM treats as greedy (`sampler._SAMPLING_EPS`)


def _seeded(original):
    def sample(logits: torch.Tensor, sampling_metadata, use_fp64_gumbel: bool = False):
        draft_ids, probs = original(logits, sampling_metadata, use_fp64_gumbel)
        generators = sampling_metadata.generators
        if not generators or sampling_metadata.all_greedy:
            return draft_ids, probs
        # rows are the batch's requests in order, as the generators' keys are (one draft position at a time)
        temperature = sampling_metadata.temperature
        for row, generator in generators.items():
            if row >= probs.shape[0] or (temperature is not None and float(temperature[row]) < _GREEDY_BELOW):
                continue
            noise = torch.empty(probs.shape[-1], dtype=torch.float64 if use_fp64_gumbel else torch.float32,
                                device=probs.device).exponential_(generator=generator)
            draft_ids[row] = (probs[row] / noise).argmax()
        return draft_ids, probs

    sample.growmtp_seeded = True
    return sample


def install_seeded_drafts() -> bool:
    """Wrap vLLM's draft sampler (idempotent); returns whether it was wrapped now."""
    from vllm.v1.spec_decode import llm_base_proposer

    current = llm_base_proposer.compute_probs_and_sample_next_token
    if getattr(current, "growmtp_seeded", False):
        return False
    llm_base_proposer.compute_probs_and_sample_next_token = _seeded(current)
    return True
