"""The GPU check's one drafting loop in place of vLLM (which the GPU check does not need on the GPU machine): the
rollout loop's timing, autoregressive and speculative side by side (check `rollout_loop`, `gpu_rollout_loop.py`),
and, with a record tap, the reference drafter whose records the trainer check trains on (`gpu_drafter.py`).

The loop. `batch` sequences (64) decode in lockstep over static KV caches (the policy's, one per layer, and
the head's), preallocated for `capacity` positions (`cycle_timing.KVBuffer`): a forward writes its new keys and
values at their absolute positions (a scatter per sequence) and attends over the whole buffer with a mask, key
<= query position (`cycle_timing.cached_forward`). Each sequence stands at its own position; slots a rejected
draft or a finished chain wrote are never read: the next forward writes over them before any query can see
them. Each phase has one shape, so on CUDA each is captured once in a CUDA graph (`torch.cuda.CUDAGraph`, one
per shape and context; a context's graphs share one memory pool, freed with them before the next context's are
captured: a pool whose graphs are all gone cannot take new ones) and replayed; on a CPU, or with a tap, the same
functions run eagerly. Nothing in a phase reads a value back to the host (but the tap).
- decode: one token per sequence through the policy, p = softmax (fp32), a token sampled from p;
- first: the head writes its entries for the K + 1 positions the previous verify committed or rejected,
  (H_p, x_{p+1}) at p (masked by position, so the rejected ones are never read) and drafts d_1 from q_1 at
  the cycle's start s;
- step (K - 1 replays of one graph): the chain's next position, (h'_{j-1}, d_{j-1}) at s + j - 1;
- verify: the policy over [x_{s+1}, d_1..d_K] at s + 1..s + K + 1, then `rejection_step`
  (`growmtp_lab/reference_drafting.py`, as every token here is drawn: `sample`, no host synchronisation), and
  the commit the next cycle's first phase reads.
A reset starts every sequence from `context` random committed positions, or, given `prompts`, from the
prompts' prefill (their whole forward, the head's entries for them, and x_P sampled from p as a decoding step
does: the first cycle starts at the last prompt position).

A tap (`gpu_drafter.Records`) is called by every reset with the prompts and x_P, and by every verify with the
cycle's start, drafts, the target's logits at the draft positions, accepted and emitted.

tau. The head's tau is set by the scale of its logits (its final norm's weight, `calibrate`): a bisection on
log2 of the scale against the tau the loop measures (flatter q overlaps a random policy's p more). Cycles cost
the same at every tau (every phase has one shape), so tokens per second at tau = tau x batch / cycle seconds.
The first drafts' acceptance is held to sum min(p_1, q_1) by the counters and `acceptance_z`.
"""

from __future__ import annotations

import time

import torch
from transformers import Qwen3ForCausalLM

from benchmarks.shared.bench_common import sync
from benchmarks.shared.cycle_timing import KVBuffer, MaskedGQA, cached_forward, visible
from openrlhf_growmtp.core import MTPHead
from growmtp_lab.reference_drafting import rejection_step, sample

COUNTERS = ("tokens", "cycles", "first_accepted", "all_accepted", "alpha_sum", "alpha_var")


class Loop:
    """One context's loop at one depth: views of the caches, the state (device tensors only), its phases, and
    their CUDA graphs. `drafter` is "head" (the MTP head) or "target" (the policy drafts for itself: q = p).
    `draft_ids` [N] (int64, ascending, on the device): the head drafts over these ids alone, from their lm_head
    rows (sliced once); q is kept over them ([B, K, N]) and is zero at every other id (`core/draft_vocab.py`).
    `prompts` [B, P]: a reset prefills them (P = `context`) in place of random committed positions; `tap`: a
    `gpu_drafter.Records` (anything with its `started` and `verified`), called by every reset and verify."""

    PHASES = ("decode", "first", "step", "verify")

    def __init__(self, policy: Qwen3ForCausalLM, layers: int, head: MTPHead | None, policy_kv: list[KVBuffer],
                 head_kv: KVBuffer | None, context: int, capacity: int, k: int, seed: int = 0,
                 drafter: str = "head", draft_ids: torch.Tensor | None = None, prompts: torch.Tensor | None = None,
                 tap=None):
        if drafter not in ("head", "target") or (drafter == "head") != (head is not None):
            raise ValueError(f"drafter must be 'head' with a head or 'target' without, got {drafter!r}")
        if draft_ids is not None and drafter != "head":
            raise ValueError("a draft vocabulary is the head's: the target drafts over every id")
        if prompts is not None and tuple(prompts.shape) != (policy_kv[0].keys.shape[0], context):
            raise ValueError(f"prompts must be [batch, context] = [{policy_kv[0].keys.shape[0]}, {context}], "
                             f"got {list(prompts.shape)}")
        self.policy, self.layers, self.head, self.k, self.drafter = policy, layers, head, k, drafter
        self.context, self.capacity, self.prompts, self.tap = context, capacity, prompts, tap
        self.caches = [kv.view(capacity) for kv in policy_kv[:layers]]
        self.head_cache = head_kv.view(capacity) if head is not None else None
        weight = policy.model.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.vocab = weight.shape[0]
        self.draft_ids = draft_ids
        # the lm_head's rows of the draft vocabulary, sliced once (the product gathers them once per ranking)
        self.draft_weight = None if draft_ids is None else policy.lm_head.weight.detach()[draft_ids].contiguous()
        self.batch = policy_kv[0].keys.shape[0]
        self.generator = torch.Generator(device=self.device).manual_seed(seed)  # `capture` drops it on CUDA
        self.init_generator = torch.Generator(device=self.device).manual_seed(seed + 1)
        self._allocate_state(weight.shape[1])
        self.graphs: dict[str, torch.cuda.CUDAGraph] = {}

    def _allocate_state(self, hidden: int) -> None:
        """Every tensor a phase reads or writes, allocated once (a graph replays on these very tensors)."""
        batch, k, device = self.batch, self.k, self.device

        def longs(*shape):
            return torch.zeros(*shape, dtype=torch.long, device=device)

        self.token, self.position = longs(batch), longs(batch)  # decode's next token and its position
        # the previous verify: its hidden states, the tokens after its positions, its first position, accepted
        self.verify_hidden = torch.zeros(batch, k + 1, hidden, dtype=self.dtype, device=device)
        self.next_tokens, self.base, self.accepted = longs(batch, k + 1), longs(batch), longs(batch)
        self.start, self.last = longs(batch), longs(batch)  # s, x_{s+1}
        self.feed = torch.zeros(batch, hidden, dtype=self.dtype, device=device)  # h' fed to the next position
        self.draft, self.draft_position, self.j = longs(batch), longs(batch), longs(1)
        self.drafts = longs(batch, k)
        self.places = longs(batch, k)  # with a draft vocabulary: the drafts' places in draft_ids
        width = self.vocab if self.draft_ids is None else self.draft_ids.numel()
        self.q = torch.zeros(batch, k, width, dtype=torch.float32, device=device)
        self.counts = {name: torch.zeros((), dtype=torch.float64, device=device) for name in COUNTERS}

    # ---- the phases --------------------------------------------------------------------------------------
    def decode(self) -> None:
        hidden = self._policy(self.token[:, None], self.position[:, None])
        p = torch.softmax(self.policy.lm_head(hidden[:, 0]).float(), dim=-1)
        self.token.copy_(sample(p, self.generator))
        self.position.add_(1)
        self.counts["tokens"].add_(self.batch)

    def first(self) -> None:
        """The cycle's start s = base + accepted, x_{s+1}, and its first draft."""
        self.j.zero_()
        self.start.copy_(self.base + self.accepted)
        self.last.copy_(self.next_tokens.gather(1, self.accepted[:, None])[:, 0])
        if self.drafter == "target":
            hidden = self._policy(self.last[:, None], (self.start + 1)[:, None])[:, 0]
            self._drafted(self.policy.lm_head(hidden), hidden, self.start + 2)
            return
        # the head's entries for the previous verify's K + 1 positions; the output at s starts the chain
        positions = self.base[:, None] + torch.arange(self.k + 1, device=self.device)
        out = self._head(self.verify_hidden, self.next_tokens, positions)
        pick = self.accepted[:, None, None].expand(-1, 1, out.normed.shape[-1])
        self._drafted(self._draft_logits(out.normed.gather(1, pick)[:, 0]), out.feed_back.gather(1, pick)[:, 0],
                      self.start + 1)

    def step(self) -> None:
        """Draft position j + 1: d_j fed back at `draft_position`."""
        if self.drafter == "target":
            hidden = self._policy(self.draft[:, None], self.draft_position[:, None])[:, 0]
            self._drafted(self.policy.lm_head(hidden), hidden, self.draft_position + 1)
            return
        out = self._head(self.feed[:, None], self.draft[:, None], self.draft_position[:, None])
        self._drafted(self._draft_logits(out.normed[:, 0]), out.feed_back[:, 0], self.draft_position + 1)

    def verify(self) -> None:
        k = self.k
        ids = torch.cat([self.last[:, None], self.drafts], dim=1)
        positions = (self.start + 1)[:, None] + torch.arange(k + 1, device=self.device)
        hidden = self._policy(ids, positions)
        logits = self.policy.lm_head(hidden).float()
        p = torch.softmax(logits, dim=-1)  # [B, K+1, V]
        ids = self.draft_ids
        if ids is None:
            accepted, emitted = rejection_step(p, self.q, self.drafts, self.generator)
            alpha = torch.minimum(p[:, 0], self.q[:, 0]).sum(-1).double()
        else:  # q is zero outside the ids: sum min(p, q) runs over them
            accepted, emitted = rejection_step(p, self.q, self.places, self.generator, ids)
            alpha = torch.minimum(p[:, 0].index_select(-1, ids), self.q[:, 0]).sum(-1).double()
        if self.tap is not None:
            self.tap.verified(self.start, self.drafts, logits[:, :k], accepted, emitted)
        c = self.counts
        c["tokens"].add_((accepted + 1).sum())
        c["cycles"].add_(self.batch)
        c["first_accepted"].add_((accepted >= 1).sum())
        c["all_accepted"].add_((accepted == k).sum())
        c["alpha_sum"].add_(alpha.sum())
        c["alpha_var"].add_((alpha * (1 - alpha)).sum())
        # commit: what the next cycle's first phase reads
        self.verify_hidden.copy_(hidden)
        self.next_tokens.copy_(torch.cat([self.drafts, emitted[:, None]], dim=1).scatter_(1, accepted[:, None],
                                                                                           emitted[:, None]))
        self.base.copy_(self.start + 1)
        self.accepted.copy_(accepted)

    def _policy(self, ids, positions):
        for cache in self.caches:
            cache.positions = positions
        return cached_forward(self.policy, ids, positions, self.caches, visible(positions, self.capacity))

    def _head(self, hidden, ids, positions):
        self.head_cache.positions = positions
        return self.head(hidden, ids, positions, cache=self.head_cache,
                         draft_path=MaskedGQA(visible(positions, self.capacity)))

    def _draft_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The head's logits over every id, or over the draft vocabulary's ids alone."""
        if self.draft_weight is None:
            return self.head.logits(normed)
        return torch.nn.functional.linear(normed, self.draft_weight)

    def _drafted(self, logits, feed, next_position) -> None:
        q = torch.softmax(logits.float(), dim=-1)
        place = sample(q, self.generator)
        draft = place if self.draft_ids is None else self.draft_ids[place]
        self.q.index_copy_(1, self.j, q[:, None])
        self.drafts.index_copy_(1, self.j, draft[:, None])
        if self.draft_ids is not None:
            self.places.index_copy_(1, self.j, place[:, None])
        self.feed.copy_(feed)
        self.draft.copy_(draft)
        self.draft_position.copy_(next_position)
        self.j.add_(1)

    # ---- running -----------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Every sequence at `context` committed positions: decode's next token at `context`; the previous
        verify (random hidden states and tokens, or the prompts' prefill) at context - 1, none of its drafts
        accepted."""
        g = self.init_generator
        self.token.random_(0, self.vocab, generator=g)
        self.position.fill_(self.context)
        self.verify_hidden.normal_(generator=g)
        self.next_tokens.random_(0, self.vocab, generator=g)
        self.base.fill_(self.context - 1)
        self.accepted.zero_()
        for t in self.counts.values():
            t.zero_()
        if self.prompts is not None:
            with torch.no_grad():
                self._prefill()

    def _prefill(self) -> None:
        """The prompts through the policy (causal, into its caches) and the head (its entries for positions
        0..P-2); x_P sampled from p at P - 1 stands as the previous verify's token there, with H_{P-1}."""
        prompts, length = self.prompts, self.context
        positions = torch.arange(length, device=self.device).expand(self.batch, -1)
        hidden = self._policy(prompts, positions)
        token = sample(torch.softmax(self.policy.lm_head(hidden[:, -1]).float(), dim=-1), self.generator)
        if self.head is not None and length > 1:
            self._head(hidden[:, :-1], prompts[:, 1:], positions[:, :-1])
        self.verify_hidden[:, 0] = hidden[:, -1]
        self.next_tokens[:, 0] = token
        if self.tap is not None:
            self.tap.started(prompts, token)

    def capture(self) -> None:
        """One CUDA graph per phase, all in one new memory pool (warm-up runs first, on a side stream, as
        torch.cuda.graphs asks)."""
        if self.device.type != "cuda":
            return
        if self.tap is not None:
            raise ValueError("a loop with a tap reads back to the host at every verify: it runs eagerly")
        self.generator = None  # a graph draws from the device's default generator, which capture registers
        pool = torch.cuda.graph_pool_handle()
        self.reset()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(2):
                self.decode(), self.first(), self.step(), self.verify()
        torch.cuda.current_stream().wait_stream(side)
        for name in self.PHASES:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), torch.no_grad():
                getattr(self, name)()
            self.graphs[name] = graph
        self.reset()

    def run(self, name: str) -> None:
        if name in self.graphs:
            self.graphs[name].replay()
        else:
            with torch.no_grad():
                getattr(self, name)()

    def cycle(self) -> None:
        self.run("first")
        for _ in range(self.k - 1):
            self.run("step")
        self.run("verify")

    def timed(self, what: str, count: int) -> tuple[float, dict]:
        """Seconds of `count` decode steps or cycles from a reset, and the counters after them."""
        self.reset()
        sync(self.device)
        t0 = time.perf_counter()
        for _ in range(count):
            self.run("decode") if what == "decode" else self.cycle()
        sync(self.device)
        seconds = time.perf_counter() - t0
        return seconds, {name: float(t) for name, t in self.counts.items()}


def calibrate(loop: Loop, tau: float, cycles: int, probes: int) -> dict:
    """Scale the head's final norm so that the loop's measured tau is `tau`: a bisection on log2 of the
    scale (q flatter, closer to a random policy's p, as the scale falls). Leaves the best scale set."""
    norm = getattr(loop.head, loop.head.family.final_norm_name).weight
    base = norm.detach().clone()

    def measured(log2_scale: float) -> float:
        with torch.no_grad():
            norm.copy_(base * 2.0 ** log2_scale)
        counts = loop.timed("cycle", cycles)[1]
        return counts["tokens"] / counts["cycles"]

    lo, hi = -14.0, 2.0
    tried = {lo: measured(lo)}
    if tried[lo] < tau:
        with torch.no_grad():
            norm.copy_(base)
        raise RuntimeError(f"no scale of the head's logits reaches tau {tau} in the loop: tau {tried[lo]:.2f} at "
                           f"scale 2^{lo:g}, q near uniform")
    for _ in range(probes):
        mid = (lo + hi) / 2
        tried[mid] = measured(mid)
        lo, hi = (mid, hi) if tried[mid] >= tau else (lo, mid)
    best = min(tried, key=lambda x: abs(tried[x] - tau))
    with torch.no_grad():
        norm.copy_(base * 2.0 ** best)
    return {"log2_scale": best, "tau_probe": tried[best], "probes": {f"{x:g}": t for x, t in sorted(tried.items())},
            "base": base}


