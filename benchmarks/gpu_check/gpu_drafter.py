"""The GPU check's reference drafter: rollouts of a policy drafted by a GrowMTP head on the device, with the
check's own rejection sampler, recorded as the engine records them (`core/records.py` has the terms).

All sequences run in lockstep, one cycle each per iteration, each at its own position:
1. the head writes its cache entries for the sequence's newly committed positions (H_p, x_{p+1}), from
   the policy's hidden states, and drafts K tokens from q, feeding each draft back (`MTPHead.forward`);
2. the policy verifies [x_{s+1}, d_1..d_K] in one forward over its KV buffers (`cycle_timing.cached_forward`):
   p at every draft position and the bonus position;
3. `gpu_sampler.rejection_step`: d_j accepted with probability min(1, p_j(d_j) / q_j(d_j)) until the first
   rejection, whose token is drawn from norm(max(p_j - q_j, 0)); when all K pass, a bonus token from p_{K+1}.
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

from benchmarks.gpu_check.gpu_sampler import rejection_step, sample
from benchmarks.shared.cycle_timing import cached_forward, policy_caches, visible
from openrlhf_growmtp.core import MTPHead, SequenceRecord
from openrlhf_growmtp.core.head_cache import HeadKVCache, additive_mask


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


def _prefill(policy: Qwen3ForCausalLM, prompts: torch.Tensor, caches) -> torch.Tensor:
    """Final-norm hidden states [B, P, H] of prompts [B, P] (equal lengths), causal, written into `caches`."""
    positions = torch.arange(prompts.shape[1], device=prompts.device).expand(prompts.shape)
    return cached_forward(policy, prompts, positions, caches, visible(positions[:1], prompts.shape[1]))


def _seen(valid_old: torch.Tensor, valid_new: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, S + T] bool: a new slot sees the valid old slots, the valid new slots up to itself, and itself
    (so that a padding slot's attention has a key and stays finite)."""
    batch, new = valid_new.shape
    causal = torch.ones(new, new, dtype=torch.bool, device=valid_new.device).tril()
    among = causal[None] & valid_new[:, None, :]
    among |= torch.eye(new, dtype=torch.bool, device=valid_new.device)[None]
    old = valid_old[:, None, :].expand(batch, new, valid_old.shape[1])
    return torch.cat([old, among], dim=2)[:, None]


def calibrate_head(policy: Qwen3ForCausalLM, head: MTPHead, prompts: torch.Tensor, tau: float, k: int) -> dict:
    """Scale the head's final norm so that the first draft position's sum min(p, q) over `prompts` [B, P] is
    the per-position acceptance of `tau` (`alpha_for_tau`). Returns the scale and the alpha reached."""
    target = alpha_for_tau(tau, k)
    batch, length = prompts.shape
    with torch.no_grad():
        hidden = _prefill(policy, prompts, policy_caches(policy, batch, length))
        p = torch.softmax(policy.lm_head(hidden[:, -1]).float(), dim=-1)
        out = head(hidden[:, :-1], prompts[:, 1:], torch.arange(length - 1, device=prompts.device)
                   .expand(batch, -1), cache=HeadKVCache())
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
        getattr(head, head.family.final_norm_name).weight.mul_(scale)
    return {"scale": scale, "target_alpha": target, "alpha": alpha(scale)}


class Drafting:
    """The rollouts in progress: per sequence its committed tokens and hidden states and its cycles; the
    policy's KV buffers and the head's cache, with which of their slots hold committed entries."""

    def __init__(self, policy: Qwen3ForCausalLM, head: MTPHead, prompts: torch.Tensor, response_tokens: int,
                 k: int, topk: int, seed: int):
        self.policy, self.head, self.k, self.topk = policy, head, k, topk
        self.device = device = prompts.device
        self.batch, self.prompt = batch, prompt = prompts.shape
        self.response_tokens = response_tokens
        self.generator = torch.Generator(device=device).manual_seed(seed)
        # a sequence keeps cycling until the slowest has its tokens: up to k + 1 tokens per cycle of the slowest
        capacity = prompt + 1 + (k + 1) * (response_tokens + 1)
        self.tokens = torch.zeros(batch, capacity, dtype=torch.long, device=device)
        self.tokens[:, :prompt] = prompts
        self.hiddens = None  # [B, capacity, H], from the prefill
        # every verify writes k + 1 slots, and commits at least one token of every sequence
        self.caches = policy_caches(policy, batch, prompt + (k + 1) * response_tokens)
        self.valid = torch.ones(batch, prompt, dtype=torch.bool, device=device)  # the policy's committed slots
        self.head_cache, self.head_valid = HeadKVCache(), torch.zeros(batch, 0, dtype=torch.bool, device=device)
        self.lengths = [prompt + 1] * batch  # committed tokens per sequence
        self.written = [0] * batch  # head cache entries written per sequence (positions 0..written-1)
        self.cycles = [[] for _ in range(batch)]  # (start, drafts, topk ids, topk log-probs, accepted)
        self.first_alpha = []
        self.phases = dict.fromkeys(("prefill", "head", "verify", "sampling", "commit"), 0.0)
        self.mark = self.started = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Seconds since the last lap, to `phase` (where the loop's time goes)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.phases[phase] += now - self.mark
        self.mark = now

    def prefill(self) -> None:
        """The whole prompt, and its next token sampled from p as a decoding step does; the first cycle starts at
        the last prompt position, with that token as x_{s+1}."""
        hidden = _prefill(self.policy, self.tokens[:, :self.prompt], self.caches)
        p = torch.softmax(self.policy.lm_head(hidden[:, -1]).float(), dim=-1)
        self.tokens[:, self.prompt] = sample(p, self.generator)
        self.hiddens = torch.zeros(self.batch, self.tokens.shape[1], hidden.shape[-1], dtype=hidden.dtype,
                                   device=self.device)
        self.hiddens[:, :self.prompt] = hidden

    def done(self) -> bool:
        return min(self.lengths) - self.prompt >= self.response_tokens

    def draft(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each sequence's cycle start s, its K drafts [B, K] and their rows of q [B, K, V]."""
        starts = [n - 2 for n in self.lengths]
        normed, feed = self._head_entries(starts)
        start = torch.tensor(starts, device=self.device)
        drafts, q = [], []
        for j in range(self.k):
            q.append(torch.softmax(self.head.logits(normed).float(), dim=-1))
            drafts.append(sample(q[-1], self.generator))
            if j + 1 < self.k:
                out = self._head(feed[:, None], drafts[-1][:, None], (start + j + 1)[:, None],
                                 torch.ones(self.batch, 1, dtype=torch.bool, device=self.device))
                normed, feed = out.normed[:, -1], out.feed_back[:, -1]
        if self.k > 1:  # the chain's entries are this cycle's only
            self.head_valid[:, -(self.k - 1):] = False
        return start, torch.stack(drafts, dim=1), torch.stack(q, dim=1)

    def _head_entries(self, starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's entries for each sequence's committed positions it has not written, up to its start s;
        the output at s (its normed state and what it feeds back), where the chain starts."""
        counts = [s - w + 1 for s, w in zip(starts, self.written)]
        new = max(counts)
        index = torch.tensor([[min(w + j, s) for j in range(new)] for w, s in zip(self.written, starts)],
                             device=self.device)
        valid_new = torch.arange(new, device=self.device)[None, :] < torch.tensor(counts, device=self.device)[:, None]
        out = self._head(self.hiddens.gather(1, index[..., None].expand(-1, -1, self.hiddens.shape[-1])),
                         self.tokens.gather(1, index + 1), index, valid_new)
        self.written = [s + 1 for s in starts]
        last = torch.tensor(counts, device=self.device) - 1
        pick = last[:, None, None].expand(-1, 1, out.normed.shape[-1])
        return out.normed.gather(1, pick)[:, 0], out.feed_back.gather(1, pick)[:, 0]

    def _head(self, hidden, ids, positions, valid_new):
        mask = additive_mask(_seen(self.head_valid, valid_new), hidden.dtype)
        out = self.head(hidden, ids, positions, cache=self.head_cache, attention_mask=mask)
        self.head_valid = torch.cat([self.head_valid, valid_new], dim=1)
        return out

    def verify(self, start: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy over [x_{s+1}, d_1..d_K]: its hidden states [B, K+1, H] and log p [B, K+1, V] (fp32)."""
        ids = torch.cat([self.tokens.gather(1, (start + 1)[:, None]), drafts], dim=1)
        positions = (start + 1)[:, None] + torch.arange(self.k + 1, device=self.device)[None, :]
        seen = _seen(self.valid, torch.ones(self.batch, self.k + 1, dtype=torch.bool, device=self.device))
        hidden = cached_forward(self.policy, ids, positions, self.caches, seen)
        return hidden, torch.log_softmax(self.policy.lm_head(hidden).float(), dim=-1)

    def commit(self, start, drafts, accepted, emitted, hidden, top) -> None:
        """The accepted drafts and the emitted token; the policy's slots of rejected drafts are not committed."""
        self.valid = torch.cat([self.valid, torch.arange(self.k + 1, device=self.device)[None, :] <= accepted[:, None]],
                               dim=1)
        starts, acc = start.tolist(), accepted.tolist()
        for b in range(self.batch):
            a, n = acc[b], self.lengths[b]
            self.tokens[b, n:n + a] = drafts[b, :a]
            self.tokens[b, n + a] = emitted[b]
            self.hiddens[b, n - 1:n + a] = hidden[b, :a + 1]
            self.lengths[b] = n + a + 1
            self.cycles[b].append((starts[b], drafts[b].cpu(), top.indices[b].cpu(), top.values[b].cpu(), a))

    def rollouts(self) -> Rollouts:
        """The records, cut to one common length (trailing cycles that pass it dropped), and their statistics."""
        length = min(self.lengths)
        records, kept = [], []
        for b in range(self.batch):
            mine = [c for c in self.cycles[b] if c[0] + c[4] + 2 <= length - 1]
            kept.extend(c[4] for c in mine)
            records.append(SequenceRecord(
                token_ids=self.tokens[b, :length].cpu(), prompt_len=self.prompt,
                start=torch.tensor([c[0] for c in mine]), drafts=torch.stack([c[1] for c in mine]),
                topk_ids=torch.stack([c[2] for c in mine]), topk_logprobs=torch.stack([c[3] for c in mine]),
                accepted=torch.tensor([c[4] for c in mine]), hidden=None, temperature=1.0))
        alpha = torch.cat(self.first_alpha)
        all_accepted = torch.tensor([c[4] for rows in self.cycles for c in rows])
        n = alpha.numel()
        return Rollouts(records=records, tau=1.0 + sum(kept) / max(1, len(kept)), cycles=len(kept),
                        seconds=self.mark - self.started, phases=self.phases,
                        first_accept_rate=float((all_accepted >= 1).double().mean()), first_alpha=float(alpha.mean()),
                        first_alpha_var=float((alpha * (1 - alpha)).sum()) / (n * n))


def draft_rollouts(policy: Qwen3ForCausalLM, head: MTPHead, prompts: torch.Tensor, response_tokens: int, k: int,
                   topk: int, seed: int = 0) -> Rollouts:
    """Draft-and-verify rollouts of every prompt in `prompts` [B, P] (equal lengths) until each has at least
    `response_tokens` new tokens, cut to one common length (trailing cycles that pass it dropped)."""
    drafting = Drafting(policy, head, prompts, response_tokens, k, topk, seed)
    with torch.no_grad():
        drafting.prefill()
        drafting.lap("prefill")
        while not drafting.done():
            drafting.lap("commit")  # the loop's test, with the commit before it
            start, drafts, q = drafting.draft()
            drafting.lap("head")
            hidden, logp = drafting.verify(start, drafts)
            drafting.lap("verify")
            p = logp.exp()
            accepted, emitted = rejection_step(p, q, drafts, drafting.generator)
            drafting.first_alpha.append(torch.minimum(p[:, 0], q[:, 0]).sum(-1).double())
            top = logp[:, :k].topk(topk, dim=-1)
            drafting.lap("sampling")
            drafting.commit(start, drafts, accepted, emitted, hidden, top)
        drafting.lap("commit")
    return drafting.rollouts()


def first_accept_z(rollouts: Rollouts) -> float:
    """The first drafts' acceptance rate against its expectation sum min(p_1, q_1), in standard errors."""
    return (rollouts.first_accept_rate - rollouts.first_alpha) / math.sqrt(max(rollouts.first_alpha_var, 1e-30))
