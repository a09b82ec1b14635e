"""The GPU check's reference drafter: rollouts of a policy drafted by a GrowMTP head on the device, with the
check's own rejection sampler, recorded as the engine records them (`core/records.py` has the terms).

All sequences run in lockstep, one cycle each per iteration, each at its own position:
1. the head writes its cache entries for the sequence's newly committed positions (H_p, x_{p+1}), from
   the policy's hidden states, and drafts K tokens from q, feeding each draft back (`MTPHead.forward`);
2. the policy verifies [x_{s+1}, d_1..d_K] in one forward over its KV cache: p at every draft position
   and the bonus position;
3. d_j is accepted with probability min(1, p_j(d_j) / q_j(d_j)) until the first rejection, whose token is
   drawn from norm(max(p_j - q_j, 0)); when all K pass, a bonus token is drawn from p_{K+1}.
Both caches keep an entry for every slot a forward wrote, rejected drafts and the head's chain included,
and a mask per sequence hides the slots that are not its committed prefix: no cache is cut per sequence.

The head's tau is set by the scale of its logits (its final norm): `calibrate_head` picks the scale at
which sum min(p, q), over the first draft position of every prompt, gives the wanted tau at every
position, so the recorded cycles are in the paper's regime (tau 2.91 at K = 5) and not the few accepts of
a random head. The records' log-probs are the target's full-vocabulary top-k at each draft position.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from transformers import Qwen3ForCausalLM

from openrlhf_growmtp.core import MTPHead, SequenceRecord
from openrlhf_growmtp.core.head import HeadKVCache


@dataclass
class Rollouts:
    records: list[SequenceRecord]
    tau: float  # 1 + mean accepted, over the kept cycles
    cycles: int
    seconds: float
    phases: dict[str, float]  # seconds per phase ("prefill", then the loop's "head", "verify", "sampling", "commit")
    first_accept_rate: float  # share of cycles whose first draft was accepted
    first_alpha: float  # mean over cycles of sum min(p_1, q_1): that share's expectation
    first_alpha_var: float  # sum over cycles of alpha (1 - alpha) / cycles^2: the share's variance


def alpha_for_tau(tau: float, k: int) -> float:
    """The per-position acceptance a with 1 + a + ... + a^k = tau (bisection)."""
    if not 1.0 <= tau <= k + 1:
        raise ValueError(f"tau must be in [1, {k + 1}], got {tau}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid ** i for i in range(k + 1)) < tau else (lo, mid)
    return (lo + hi) / 2


def _policy_step(policy: Qwen3ForCausalLM, ids, positions, mask, cache):
    """Final-norm hidden states [B, T, H] and fp32 logits [B, T, V] of T new tokens over `cache`."""
    out = policy.model(input_ids=ids, position_ids=positions, attention_mask=mask, past_key_values=cache,
                       use_cache=True)
    return out.last_hidden_state, policy.lm_head(out.last_hidden_state).float(), out.past_key_values


def _visible(valid_old: torch.Tensor, valid_new: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, S + T] bool: a new slot sees the valid old slots, the valid new slots up to itself, and itself
    (so that a padding slot's attention has a key and stays finite)."""
    batch, new = valid_new.shape
    causal = torch.ones(new, new, dtype=torch.bool, device=valid_new.device).tril()
    among = causal[None] & valid_new[:, None, :]
    among |= torch.eye(new, dtype=torch.bool, device=valid_new.device)[None]
    old = valid_old[:, None, :].expand(batch, new, valid_old.shape[1])
    return torch.cat([old, among], dim=2)[:, None]


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible,
                                                                                      torch.finfo(dtype).min)


def _final_norm(head: MTPHead) -> torch.nn.Module:
    return getattr(head, head.family.final_norm_name)


def calibrate_head(policy: Qwen3ForCausalLM, head: MTPHead, prompts: torch.Tensor, tau: float, k: int) -> dict:
    """Scale the head's final norm so that the first draft position's sum min(p, q) over `prompts` [B, P] is
    the per-position acceptance of `tau` (`alpha_for_tau`). Returns the scale and the alpha reached."""
    target = alpha_for_tau(tau, k)
    with torch.no_grad():
        hidden, logits, _ = _policy_step(policy, prompts, None, None, None)
        p = torch.softmax(logits[:, -1], dim=-1)
        out = head(hidden[:, :-1], prompts[:, 1:], torch.arange(prompts.shape[1] - 1, device=prompts.device)
                   .expand(prompts.shape[0], -1), cache=HeadKVCache())
        z = head.logits(out.normed[:, -1]).float()

        def alpha(scale: float) -> float:
            return float(torch.minimum(p, torch.softmax(scale * z, dim=-1)).sum(-1).mean())

        # sum min(p, q) is largest where q is as flat or as sharp as p: search the scale on the flat side
        lo, hi = -8.0, 0.0  # log2 of the scale
        if alpha(2.0 ** lo) < target:
            raise RuntimeError(f"no scale of the head's logits reaches alpha {target:.3f} on this policy "
                               f"(alpha {alpha(2.0 ** lo):.3f} at scale 2^{lo:g})")
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if alpha(2.0 ** mid) >= target else (lo, mid)
        scale = 2.0 ** lo
        _final_norm(head).weight.mul_(scale)
    return {"scale": scale, "target_alpha": target, "alpha": alpha(scale)}


def draft_rollouts(policy: Qwen3ForCausalLM, head: MTPHead, prompts: torch.Tensor, response_tokens: int, k: int,
                   topk: int, seed: int = 0) -> Rollouts:
    """Draft-and-verify rollouts of every prompt in `prompts` [B, P] (equal lengths) until each has at least
    `response_tokens` new tokens, cut to one common length (trailing cycles that pass it dropped)."""
    device = prompts.device
    batch, prompt = prompts.shape
    g = torch.Generator(device=device).manual_seed(seed)
    # a sequence keeps cycling until the slowest has its tokens: up to k + 1 tokens per cycle of the slowest
    capacity = prompt + 1 + (k + 1) * (response_tokens + 1)
    tokens = torch.zeros(batch, capacity, dtype=torch.long, device=device)
    tokens[:, :prompt] = prompts
    written = [0] * batch  # head cache entries written per sequence (positions 0..written-1)
    cycles = [[] for _ in range(batch)]  # (start, drafts, topk ids, topk log-probs, accepted)
    first_alpha = []
    phases = dict.fromkeys(("prefill", "head", "verify", "sampling", "commit"), 0.0)
    mark = time.perf_counter()

    def lap(phase: str) -> None:  # where the loop's time goes (the first device run took 0.4 s an iteration)
        nonlocal mark
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        phases[phase] += now - mark
        mark = now

    started = time.perf_counter()
    with torch.no_grad():
        # the prefill: the whole prompt, and its next token sampled from p as a decoding step does; the first
        # cycle starts at the last prompt position, with that token as x_{s+1}
        hidden, logits, cache = _policy_step(policy, prompts, None, None, None)
        tokens[:, prompt] = torch.multinomial(torch.softmax(logits[:, -1], dim=-1), 1, generator=g)[:, 0]
        lengths = [prompt + 1] * batch  # committed tokens per sequence
        hiddens = torch.zeros(batch, capacity, hidden.shape[-1], dtype=hidden.dtype, device=device)
        hiddens[:, :prompt] = hidden
        valid = torch.ones(batch, prompt, dtype=torch.bool, device=device)  # the policy's cache slots
        head_cache, head_valid = HeadKVCache(), torch.zeros(batch, 0, dtype=torch.bool, device=device)
        dtype = hidden.dtype
        lap("prefill")
        while min(lengths) - prompt < response_tokens:
            lap("commit")  # the loop's test, with the commit before it
            starts = [n - 2 for n in lengths]
            # 1. the head's entries for the newly committed positions, then its chain of k drafts
            counts = [s - w + 1 for s, w in zip(starts, written)]
            new = max(counts)
            index = torch.tensor([[min(w + j, s) for j in range(new)] for w, s in zip(written, starts)], device=device)
            valid_new = torch.arange(new, device=device)[None, :] < torch.tensor(counts, device=device)[:, None]
            out = head(hiddens.gather(1, index[..., None].expand(-1, -1, hiddens.shape[-1])),
                       tokens.gather(1, index + 1), index, cache=head_cache,
                       attention_mask=_additive(_visible(head_valid, valid_new), dtype))
            head_valid = torch.cat([head_valid, valid_new], dim=1)
            written = [s + 1 for s in starts]
            last = torch.tensor(counts, device=device) - 1
            pick = last[:, None, None].expand(-1, 1, out.normed.shape[-1])
            normed, feed = out.normed.gather(1, pick)[:, 0], out.feed_back.gather(1, pick)[:, 0]
            start = torch.tensor(starts, device=device)
            drafts, q = [], []
            for j in range(k):
                q.append(torch.softmax(head.logits(normed).float(), dim=-1))
                drafts.append(torch.multinomial(q[-1], 1, generator=g)[:, 0])
                if j + 1 < k:
                    step_valid = torch.ones(batch, 1, dtype=torch.bool, device=device)
                    out = head(feed[:, None], drafts[-1][:, None], (start + j + 1)[:, None], cache=head_cache,
                               attention_mask=_additive(_visible(head_valid, step_valid), dtype))
                    head_valid = torch.cat([head_valid, step_valid], dim=1)
                    normed, feed = out.normed[:, -1], out.feed_back[:, -1]
            if k > 1:  # the chain's entries are this cycle's only
                head_valid[:, -(k - 1):] = False
            drafts, q = torch.stack(drafts, dim=1), torch.stack(q, dim=1)  # [B, K], [B, K, V]
            lap("head")
            # 2. the policy verifies [x_{s+1}, d_1..d_K]
            last_token = tokens.gather(1, (start + 1)[:, None])
            ids = torch.cat([last_token, drafts], dim=1)
            positions = (start + 1)[:, None] + torch.arange(k + 1, device=device)[None, :]
            verify_valid = torch.ones(batch, k + 1, dtype=torch.bool, device=device)
            hidden, logits, cache = _policy_step(policy, ids, positions, _visible(valid, verify_valid), cache)
            lap("verify")
            logp = torch.log_softmax(logits, dim=-1)
            p = logp.exp()
            # 3. rejection sampling
            p_draft = p[:, :k].gather(2, drafts[..., None])[..., 0]
            q_draft = q.gather(2, drafts[..., None])[..., 0]
            u = torch.rand(batch, k, generator=g, device=device)
            accepted = (u < p_draft / q_draft).long().cumprod(dim=1).sum(dim=1)
            first_alpha.append(torch.minimum(p[:, 0], q[:, 0]).sum(-1).double())
            stop = accepted.clamp(max=k - 1)
            residual = (p.gather(1, stop[:, None, None].expand(-1, 1, p.shape[-1]))[:, 0]
                        - q.gather(1, stop[:, None, None].expand(-1, 1, q.shape[-1]))[:, 0]).clamp(min=0)
            bonus = p[:, k]
            source = torch.where((accepted == k)[:, None], bonus, residual)
            emitted = torch.multinomial(source / source.sum(-1, keepdim=True), 1, generator=g)[:, 0]
            top = logp[:, :k].topk(topk, dim=-1)
            lap("sampling")
            # commit: the accepted drafts and the emitted token; the policy's slots of rejected drafts go
            valid = torch.cat([valid, torch.arange(k + 1, device=device)[None, :] <= accepted[:, None]], dim=1)
            acc = accepted.tolist()
            for b in range(batch):
                a, n = acc[b], lengths[b]
                tokens[b, n:n + a] = drafts[b, :a]
                tokens[b, n + a] = emitted[b]
                hiddens[b, n - 1:n + a] = hidden[b, :a + 1]
                lengths[b] = n + a + 1
                cycles[b].append((starts[b], drafts[b].cpu(), top.indices[b].cpu(), top.values[b].cpu(), a))
    lap("commit")
    seconds = time.perf_counter() - started
    length = min(lengths)
    records, kept = [], []
    for b in range(batch):
        mine = [c for c in cycles[b] if c[0] + c[4] + 2 <= length - 1]
        kept.extend(c[4] for c in mine)
        records.append(SequenceRecord(
            token_ids=tokens[b, :length].cpu(), prompt_len=prompt,
            start=torch.tensor([c[0] for c in mine]), drafts=torch.stack([c[1] for c in mine]),
            topk_ids=torch.stack([c[2] for c in mine]), topk_logprobs=torch.stack([c[3] for c in mine]),
            accepted=torch.tensor([c[4] for c in mine]), hidden=None, temperature=1.0))
    alpha = torch.cat(first_alpha)
    all_accepted = torch.tensor([c[4] for rows in cycles for c in rows])
    n = alpha.numel()
    return Rollouts(records=records, tau=1.0 + sum(kept) / max(1, len(kept)), cycles=len(kept), seconds=seconds,
                    phases=phases,
                    first_accept_rate=float((all_accepted >= 1).double().mean()), first_alpha=float(alpha.mean()),
                    first_alpha_var=float((alpha * (1 - alpha)).sum()) / (n * n))


def first_accept_z(rollouts: Rollouts) -> float:
    """The first drafts' acceptance rate against its expectation sum min(p_1, q_1), in standard errors."""
    return (rollouts.first_accept_rate - rollouts.first_alpha) / math.sqrt(max(rollouts.first_alpha_var, 1e-30))
