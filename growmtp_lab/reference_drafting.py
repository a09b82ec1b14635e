"""The lab's reference speculative sampling, in torch: the sampler every drafter outside the product draws with,
its one z-score, and the chain-by-chain drafting reference.

Who uses it: the GPU check's loop (`benchmarks/gpu_check/gpu_loop.py`: the rollout loop's timing and the
reference drafter's records) and its sampler check (d) (`gpu_sampler.py`); the rehearsal's native head
(`rehearsal/native_head.py`); the benchmarks and tests that hold the batched reconstruction to `chain_by_chain`.
It lives in the lab because the rehearsal, in the lab, draws with it and the lab does not import benchmarks/; the
product (core, trainer, vllm_patches, cli) imports nothing from here (tests/test_layout.py).

Terms as in `core/records.py`: a chain drafts d_1..d_K, d_j ~ q_j; d_j is *accepted* with probability
min(1, p_j(d_j) / q_j(d_j)) while every earlier draft was (`accepted_count`); at the first rejection j the
*recovered* token is drawn from norm(max(p_j - q_j, 0)) (`residual`); when all K pass, the *bonus* token is
drawn from p_{K+1}. Position j then accepts with probability alpha_j = sum min(p_j, q_j). Tokens are drawn by
the exponential race (`sample`: argmax w / E, E ~ Exp(1)), exact for unnormalised weights and free of host
synchronisation, where torch.multinomial is not.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from openrlhf_growmtp.core import HeadKVCache, MTPHead, SequenceRecord  # the package face: where head.py's
# pieces live is core's own business


def sample(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One index per row of weights [..., V] (>= 0, unnormalised) with P(i) = w_i / sum w: the exponential
    race argmax w / E. E is floored at the smallest normal float, as a draw of exactly 0 would pick its id
    whatever its weight."""
    race = torch.empty_like(weights).exponential_(generator=generator).clamp_(min=torch.finfo(weights.dtype).tiny)
    return (weights / race).argmax(-1)


def accepted_count(p_draft: torch.Tensor, q_draft: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Drafts accepted before the first rejection, [...] in 0..K, from p_j(d_j), q_j(d_j) and uniforms u, each
    [..., K]: d_j passes where u < p / q, with probability min(1, p / q)."""
    return (u * q_draft < p_draft).long().cumprod(dim=-1).sum(dim=-1)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(p - q, 0): the unnormalised law of the token recovered at a rejection."""
    return (p - q).clamp(min=0.0)


def rejection_step(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, generator: torch.Generator | None,
                   ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """p [B, K+1, V] the target's rows, q [B, K, V] the drafter's, drafts [B, K] sampled from q.

    With `ids` [N] (a draft vocabulary), q [B, K, N] holds the drafter's rows over those ids alone (zero at
    every other id) and drafts [B, K] are places in `ids`: the same draws and results as q scattered to
    [B, K, V], without writing its zeros (the residual is p itself outside the ids).

    Returns (accepted [B] in 0..K, emitted [B]: the recovered token at the first rejection, or the bonus)."""
    k = q.shape[1]
    tokens = drafts if ids is None else ids[drafts]
    p_draft = p[:, :k].gather(2, tokens[..., None])[..., 0]
    q_draft = q.gather(2, drafts[..., None])[..., 0]
    u = torch.rand(p_draft.shape, generator=generator, device=p.device, dtype=p.dtype)
    accepted = accepted_count(p_draft, q_draft, u)
    stop = accepted.clamp(max=k - 1)[:, None, None]
    p_stop, q_stop = (rows.gather(1, stop.expand(-1, 1, rows.shape[-1]))[:, 0] for rows in (p, q))
    if ids is None:
        recovered = residual(p_stop, q_stop)
    else:
        recovered = p_stop.index_copy(1, ids, residual(p_stop.index_select(1, ids), q_stop))
    return accepted, sample(torch.where((accepted == k)[:, None], p[:, k], recovered), generator)


def acceptance_z(counts: dict) -> float:
    """The first drafts' acceptance against its expectation, in standard errors, from counters over n cycles:
    `first_accepted` (cycles whose d_1 passed), `alpha_sum` (sum over the cycles of alpha_1 = sum min(p_1, q_1)),
    `alpha_var` (sum of alpha_1 (1 - alpha_1)): (first_accepted - alpha_sum) / sqrt(alpha_var), the cycles
    independent Bernoulli trials. 0 without cycles."""
    if not counts["cycles"]:
        return 0.0
    return (counts["first_accepted"] - counts["alpha_sum"]) / math.sqrt(max(counts["alpha_var"], 1e-30))


def chain_by_chain(head: MTPHead, records: Sequence[SequenceRecord],
                   hiddens: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """Draft logits [sum R, K, V] of every record's cycles the way drafting computes them, cycle after cycle:
    one incremental head KV cache per response, each cycle appends its newly committed entries, runs its K
    chain steps one at a time (`MTPHead.draft_chain`, at the record's temperature) and crops them again.
    `hiddens` (one [T, H] per record) replace the records' own hidden states."""
    device = next(head.parameters()).device
    out = []
    for i, rec in enumerate(records):
        hidden = (rec.hidden if hiddens is None else hiddens[i]).to(device)
        ids = rec.token_ids.to(device)
        cache, written = HeadKVCache(), 0
        for r in range(rec.num_cycles):
            s = int(rec.start[r])
            first = head.prefill(hidden[None, written:s + 1], ids[None, written + 1:s + 2], written, cache)
            written = s + 1
            _, logits = head.draft_chain(first.last(), s, rec.drafts[r:r + 1].to(device), rec.depth, cache,
                                         temperature=rec.temperature)
            cache.crop(written)
            out.append(logits[0])
    return torch.stack(out)
