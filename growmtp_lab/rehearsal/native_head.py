"""A native MTP head for a rehearsal stand-in, trained the way a shipped head is, and its realised tau.

A shipped native head (MiMo's, Qwen3.5's) was trained on its own model's text, so it drafts what that
model writes. The stand-in's head gets the same: depth-1 distillation on the stand-in's own samples after
the rehearsal's own chat-formatted prompts (the prompts its RL run starts from), then its realised tau is
measured by speculative sampling on prompts held out of the training pool, with the head frozen, so the
rehearsal can hold each RL step to it (`report.check`).

Terms: a *cycle* drafts K tokens with the head and verifies them in one target forward; its *accepted*
count A in 0..K is the number of drafts kept before the first rejection; tau = 1 + mean A (the bonus or
recovered token included, as `growmtp/tau` counts it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from openrlhf_growmtp.core.checkpoint import init_random_head_
from openrlhf_growmtp.core.head import MTPHead
from openrlhf_growmtp.core.head_cache import HeadKVCache
from growmtp_lab.reference_drafting import rejection_step, sample

NEW_TOKENS = 64  # the rehearsal's response cap (common.sh, MAX_NEW under GROWMTP_REHEARSAL=1)


@dataclass(frozen=True)
class Pool:
    """Samples of the model after a set of prompts: rows per prompt, each NEW_TOKENS long."""

    sequences: list[torch.Tensor]  # per prompt: [rows, P + NEW_TOKENS] (prompt, then the sample)
    prompt_lens: list[int]  # per prompt: P


def sample_pool(model, prompts: list[list[int]], rows: int, seed: int) -> Pool:
    """`rows` samples of NEW_TOKENS tokens per prompt at temperature 1, top-p 1 (the scripts' sampling)."""
    torch.manual_seed(seed)
    sequences = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt] * rows)
            sequences.append(model.generate(ids, do_sample=True, max_new_tokens=NEW_TOKENS,
                                            min_new_tokens=NEW_TOKENS, temperature=1.0, top_p=1.0, top_k=0,
                                            pad_token_id=0, eos_token_id=None))
    return Pool(sequences, [len(p) for p in prompts])


def distill(model, head: MTPHead, pool: Pool, seed: int, steps: int, lr: float, batch: int) -> MTPHead:
    """Depth-1 teacher forcing on the pool's responses: KL from the model's next-token distribution at t+1
    to the head's from (h_t, x_{t+1}), on mini-batches of `batch` rows of one prompt, Adam with the LR on a
    cosine to 0. Deeper draft positions are not trained, as in native heads trained for one position.

    The head starts from the random init with its fc's token half at the identity: it starts as a copy
    drafter (with a tied embedding, lm_head(norm(e(x))) peaks at x), which is what the tied stand-ins' loops
    reward. NOTE: a shipped head's training budget is out of reach here: from a fully random start, 300
    steps (11 min on 2 cores) reached Qwen3.5's tau 1.48 at K = 3 only (docs/rehearsal.md)."""
    init_random_head_(head, seed=seed)
    fc = getattr(head, head.family.fc_name)  # weight [H, 2H] over cat[norm_e(embed(token)), norm_h(hidden)]
    with torch.no_grad():
        fc.weight[:, :fc.out_features].copy_(torch.eye(fc.out_features))
    head.bind(model.model.embed_tokens, model.lm_head)
    with torch.no_grad():
        hidden = [model.model(s).last_hidden_state for s in pool.sequences]  # per prompt [rows, T, H]
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    for _ in range(steps):
        group = int(torch.randint(len(pool.sequences), (1,), generator=generator))
        pick = torch.randperm(pool.sequences[group].shape[0], generator=generator)[:batch]
        h, s, start = hidden[group][pick], pool.sequences[group][pick], pool.prompt_lens[group] - 1
        with torch.no_grad():  # p(x_{t+2} | x_{<=t+1}) for the response's slots t = P-1 .. T-2
            target = torch.log_softmax(model.lm_head(h[:, start + 1:]).float(), dim=-1)
        out = head.prefill(h[:, :-1], s[:, 1:], 0, HeadKVCache())
        log_q = torch.log_softmax(head.logits(out.normed[:, start:]).float(), dim=-1)
        loss = torch.nn.functional.kl_div(log_q, target, log_target=True, reduction="batchmean")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    return head


def measure_tau(model, head: MTPHead, prompts: list[list[int]], rows: int, k: int, seed: int) -> dict:
    """The frozen head's realised tau at depth k over `rows` responses per prompt, with what the rehearsal's
    verdict needs to argue its margin (report.MeasuredTau): the cycles, the variance of one cycle's accepted
    count, and the design effect, the variance of a response's mean accepted count over what independent
    cycles would give (at least 1: cycles of one response share its loops)."""
    return tau_statistics(accepted_counts(model, head, prompts, rows, k, seed))


def tau_statistics(per_response: list[torch.Tensor]) -> dict:
    """tau, cycles, the variance of one cycle's accepted count and the design effect from per-response accepted
    counts. The design effect is sum_r m_r (mean_r - mean)^2 / (R - 1) / variance over R responses of m_r
    cycles: about 1 where cycles are independent, m where a response's cycles are all alike."""
    counts = torch.cat(per_response).double()
    variance = float(counts.var())
    spread = sum(len(c) * (float(c.double().mean()) - float(counts.mean())) ** 2 for c in per_response)
    design_effect = spread / (len(per_response) - 1) / variance if variance > 0 else 1.0
    return {"tau": 1.0 + float(counts.mean()), "cycles": len(counts), "accepted_variance": variance,
            "design_effect": max(1.0, design_effect)}


@torch.no_grad()
def accepted_counts(model, head: MTPHead, prompts: list[list[int]], rows: int, k: int, seed: int) -> list[torch.Tensor]:
    """Speculative sampling with the frozen head, `rows` responses of NEW_TOKENS per prompt: per response,
    its cycles' accepted counts (0..k).

    A cycle, after committed tokens x_0..x_{T-1} (x_{T-1} the target's own sample): the head drafts
    d_1..d_k from (h_{T-2}, x_{T-1}) on, feeding each draft back; one target forward over x, d gives p at
    positions T..T+k; the lab's one rejection step (`reference_drafting.rejection_step`) keeps d_i with
    probability min(1, p_i(d_i) / q_i(d_i)), replaces the first rejected one by a sample of max(p_i - q_i, 0),
    and after k kept drafts samples a bonus token from p_{k+1}. The prompt's own forward samples x_P without
    drafts, as the engine's prefill does.
    """
    generator = torch.Generator().manual_seed(seed)
    per_response = []
    for prompt in prompts:
        for _ in range(rows):
            counts = []
            x = torch.tensor([prompt])
            hidden = model.model(x).last_hidden_state  # [1, T - 1, H] at every cycle's start: x_{T-1}'s is not needed
            p = torch.softmax(model.lm_head(hidden[:, -1]).float(), dim=-1)
            x = torch.cat([x, sample(p, generator)[:, None]], dim=1)
            while x.shape[1] - len(prompt) < NEW_TOKENS:
                length = x.shape[1]
                out = head.prefill(hidden, x[:, 1:], 0, cache := HeadKVCache())
                drafts, draft_logits = head.draft_chain(out.last(), length - 2, None, k, cache, generator=generator)
                state = model.model(torch.cat([x, drafts], dim=1)).last_hidden_state
                p = torch.softmax(model.lm_head(state[:, length - 1:]).float(), dim=-1)  # [1, k + 1, V]
                accepted, token = rejection_step(p, torch.softmax(draft_logits, dim=-1), drafts, generator)
                accepted = int(accepted)
                counts.append(accepted)
                x = torch.cat([x, drafts[:, :accepted], token.view(1, 1)], dim=1)
                hidden = state[:, :length + accepted]  # the committed prefix's states, all but the new token's
            per_response.append(torch.tensor(counts))
    return per_response
