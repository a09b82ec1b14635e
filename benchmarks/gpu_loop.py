"""Check `rollout_loop` of the GPU check: a minimal generation loop in place of vLLM (which the check does not
need on the GPU machine), timed autoregressive and speculative side by side, at the policy's shapes.

The loop. `batch` sequences (64) decode in lockstep over static KV caches (the policy's, one per layer, and
the head's), preallocated for `capacity` positions: a forward writes its new keys and values at their
absolute positions (a scatter per sequence) and attends over the whole buffer with a mask, key <= query
position. Slots a rejected draft or a finished chain wrote are never read: the next forward writes over
them before any query can see them. Each phase has one shape, so on CUDA each is captured once in a CUDA
graph (`torch.cuda.CUDAGraph`, one per shape and context; a context's graphs share one memory pool, freed with
them before the next context's are captured: a pool whose graphs are all gone cannot take new ones) and replayed; on
a CPU the same functions run eagerly. Nothing in a phase reads a value back to the host.
- decode: one token per sequence through the policy, p = softmax (fp32), a token sampled from p;
- head_first: the head writes its entries for the K + 1 positions the previous verify committed or
  rejected, (H_p, x_{p+1}) at p (masked by position, so the rejected ones are never read) and drafts d_1 from
  q_1 at the cycle's start s;
- head_step (K - 1 replays of one graph): the chain's next position, (h'_{j-1}, d_{j-1}) at s + j - 1;
- verify: the policy over [x_{s+1}, d_1..d_K] at s + 1..s + K + 1, then rejection sampling as the engine's
  (`gpu_sampler.py` has the terms): d_j accepted with probability min(1, p_j(d_j) / q_j(d_j)) until the first
  rejection, whose token comes from norm(max(p_j - q_j, 0)); all K accepted, a bonus token from p_{K+1}.
Tokens are sampled by the exponential race (argmax w / E, E ~ Exp(1)): exact for unnormalised weights and
free of host synchronisation, where torch.multinomial is not (`gpu_sampler.rejection_sample` counts on
the host). `rejection_step` is tested against `gpu_sampler.sampler_statistics`.

tau. The head's tau is set by the scale of its logits (its final norm's weight): a bisection on log2 of the
scale against the tau measured over `calib_cycles` cycles of the loop at the smallest context (flatter q
overlaps a random policy's p more), for each tau of the plan. Cycles cost the same at every tau (every
phase has one shape), so tokens per second at tau = tau x batch / cycle seconds.

Depth. The caches of 36 layers for 64 sequences of 8K tokens are 78 GB, so the loop runs the first `layers`
layers of a policy built with as many as fit the card's memory (`layers_that_fit`), and again with half of
them. The 36-layer times are read on the line through the two: t(36) = t(L) + (36 - L) x (t(L) - t(L/2)) /
(L - L/2), i.e. the measured per-layer time x 36 + the measured non-layer part (embedding, lm_head,
sampling, the head's steps), each context and phase on its own.

What it reports, per context: AR and speculative tokens per second at each tau (measured at L layers, and
read at 36); the break-even tau (cycle / decode seconds, = the tau at which the two loops' tokens per second
meet); the speedup at tau 2.91 (the paper: 2.13x) beside `cycle_cost`'s eager prediction; and over the
paper's rollout (8,192-token responses after 256) the speedup the contexts' lines give. The first draft's
acceptance over every timed cycle is held to sum min(p_1, q_1) within 5 standard errors (a sampler that
compared the wrong rows or positions would be far off). On a CPU (`--tiny`) also: with the target itself
as the drafter (q = p), every draft is accepted.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from bench_common import fit_line
from gpu_cycle import PAPER, layer_forward
from gpu_report import Row
from transformers import Qwen3ForCausalLM

from openrlhf_growmtp.core import MTPHead

Z_LIMIT = 5.0


@dataclass(frozen=True)
class LoopPlan:
    batch: int
    contexts: tuple[int, ...]
    taus: tuple[float, ...]
    ar_steps: int  # decode steps per timed run
    spec_cycles: int  # cycles per timed run
    repeats: int  # timed runs per (context, depth, tau); medians
    calib_cycles: int  # cycles per probe of the tau bisection
    calib_probes: int
    reserve_bytes: int  # device memory left to the graphs' pool, logits and the head
    check_cycles: int  # CPU only: cycles of the q = p and the acceptance checks


LOOP_PLANS = {
    "Qwen3-4B": LoopPlan(batch=64, contexts=(1024, 4096, 8192), taus=(1.5, 2.0, 2.5, 2.91), ar_steps=24,
                         spec_cycles=8, repeats=3, calib_cycles=4, calib_probes=7, reserve_bytes=12 * 2**30,
                         check_cycles=0),
    "tiny": LoopPlan(batch=16, contexts=(32, 64, 128), taus=(1.5, 2.0, 2.5, 2.91), ar_steps=8, spec_cycles=4,
                     repeats=2, calib_cycles=4, calib_probes=5, reserve_bytes=0, check_cycles=24),
}


def sample(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One index per row of weights [..., V] (>= 0, unnormalised) with P(i) = w_i / sum w: the exponential
    race argmax w / E. E is floored at the smallest normal float, as a draw of exactly 0 would pick its id
    whatever its weight."""
    race = torch.empty_like(weights).exponential_(generator=generator).clamp_(min=torch.finfo(weights.dtype).tiny)
    return (weights / race).argmax(-1)


def rejection_step(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, generator: torch.Generator | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """p [B, K+1, V] the target's rows, q [B, K, V] the drafter's, drafts [B, K] sampled from q.

    Returns (accepted [B] in 0..K, emitted [B]: the recovered token at the first rejection, or the bonus)."""
    k = q.shape[1]
    p_draft = p[:, :k].gather(2, drafts[..., None])[..., 0]
    q_draft = q.gather(2, drafts[..., None])[..., 0]
    u = torch.rand(p_draft.shape, generator=generator, device=p.device, dtype=p.dtype)
    accepted = (u * q_draft < p_draft).long().cumprod(dim=1).sum(dim=1)  # u < p / q: probability min(1, p / q)
    stop = accepted.clamp(max=k - 1)[:, None, None].expand(-1, 1, p.shape[-1])
    residual = (p.gather(1, stop) - q.gather(1, stop))[:, 0].clamp(min=0.0)
    source = torch.where((accepted == k)[:, None], p[:, k], residual)
    return accepted, sample(source, generator)


class StaticKV:
    """One attention layer's keys and values for `capacity` positions, written at absolute positions.
    `view(length)` gives the first `length` slots, the buffers a context's graphs read and write."""

    def __init__(self, batch, kv_heads, capacity, head_dim, device, dtype):
        self.keys = torch.zeros(batch, kv_heads, capacity, head_dim, device=device, dtype=dtype)
        self.values = torch.zeros_like(self.keys)

    def fill_random(self, length: int, generator: torch.Generator) -> None:
        for t in (self.keys, self.values):
            t.zero_()
            t[:, :, :length].normal_(generator=generator)


class KVView:
    """The first `length` slots of a StaticKV; `positions` [B, T] (set before a forward) say where `update`
    writes. Duck-types the `update` of transformers' Cache for the head's decoder layer."""

    def __init__(self, kv: StaticKV, length: int):
        self.keys, self.values = kv.keys[:, :, :length], kv.values[:, :, :length]
        self.positions = None

    def update(self, key, value, layer_idx=0, cache_kwargs=None):
        index = self.positions[:, None, :, None].expand(-1, key.shape[1], -1, key.shape[3])
        self.keys.scatter_(2, index, key)
        self.values.scatter_(2, index, value)
        return self.keys, self.values

    def __len__(self) -> int:
        return self.keys.shape[2]


def visible(positions: torch.Tensor, length: int) -> torch.Tensor:
    """[B, 1, T, length] bool: slot <= the query's position."""
    return (torch.arange(length, device=positions.device)[None, None, None, :] <= positions[:, None, :, None])


def folded_sdpa(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
                ) -> torch.Tensor:
    """Grouped-query attention, query [B, heads, T, d] over keys, values [B, kv, L, d], mask [B, 1, T, L] bool
    (True: seen) -> [B, heads, T, d]. The query heads of one key head are folded into the query axis (head
    h = kv x rep + r, as transformers' repeat_kv pairs them): SDPA then reads each key head once, with any
    of its kernels, and no key is copied."""
    batch, heads, new, dim = query.shape
    kv_heads = keys.shape[1]
    rep = heads // kv_heads
    folded = query.reshape(batch, kv_heads, rep * new, dim)
    mask = mask[:, :, None].expand(-1, -1, rep, -1, -1).reshape(batch, 1, rep * new, -1)
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(batch, heads, new, dim)


class MaskedGQA:
    """`folded_sdpa` with a fixed mask, as the head's decoder layer calls an attention (its `draft_path=`)."""

    def __init__(self, mask: torch.Tensor):
        self.mask = mask

    def __call__(self, query, key, value, scaling):
        return folded_sdpa(query, key, value, self.mask, scaling).transpose(1, 2), None


def policy_forward(model: Qwen3ForCausalLM, layers: int, ids: torch.Tensor, positions: torch.Tensor,
                   caches: list[KVView]) -> torch.Tensor:
    """Final-norm hidden states [B, T, H] of ids [B, T] at `positions` through the first `layers` layers."""
    core = model.model
    batch, new = ids.shape
    x = core.embed_tokens(ids)
    cos, sin = core.rotary_emb(x, positions)
    mask = visible(positions, len(caches[0]))  # [B, 1, T, L]
    def attention(q, keys, values, scale):
        return folded_sdpa(q, keys, values, mask, scale)

    for layer, cache in zip(core.layers[:layers], caches):
        cache.positions = positions
        x = layer_forward(layer, x, cos, sin, cache, attention)
    return core.norm(x)


class Loop:
    """One context's loop at one depth: views of the caches, the state (device tensors only), its phases, and
    their CUDA graphs. `drafter` is "head" (the MTP head) or "target" (the policy drafts for itself: q = p)."""

    PHASES = ("decode", "first", "step", "verify")

    def __init__(self, policy: Qwen3ForCausalLM, layers: int, head: MTPHead | None, policy_kv: list[StaticKV],
                 head_kv: StaticKV | None, context: int, capacity: int, k: int, seed: int = 0,
                 drafter: str = "head"):
        if drafter not in ("head", "target") or (drafter == "head") != (head is not None):
            raise ValueError(f"drafter must be 'head' with a head or 'target' without, got {drafter!r}")
        self.policy, self.layers, self.head, self.k, self.drafter = policy, layers, head, k, drafter
        self.context, self.capacity = context, capacity
        self.caches = [KVView(kv, capacity) for kv in policy_kv[:layers]]
        self.head_cache = KVView(head_kv, capacity) if head is not None else None
        weight = policy.model.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.vocab, hidden = weight.shape
        self.batch = batch = policy_kv[0].keys.shape[0]
        self.generator = None if self.device.type == "cuda" else torch.Generator().manual_seed(seed)
        self.init_generator = torch.Generator(device=self.device).manual_seed(seed + 1)
        longs = dict(dtype=torch.long, device=self.device)
        self.token, self.position = torch.zeros(batch, **longs), torch.zeros(batch, **longs)  # decode
        # the previous verify: its hidden states, the tokens after its positions, its first position, accepted
        self.verify_hidden = torch.zeros(batch, k + 1, hidden, dtype=self.dtype, device=self.device)
        self.next_tokens, self.base, self.accepted = (torch.zeros(batch, k + 1, **longs), torch.zeros(batch, **longs),
                                                      torch.zeros(batch, **longs))
        self.start, self.last = torch.zeros(batch, **longs), torch.zeros(batch, **longs)  # s, x_{s+1}
        self.feed = torch.zeros(batch, hidden, dtype=self.dtype, device=self.device)
        self.draft, self.draft_position, self.j = torch.zeros(batch, **longs), torch.zeros(batch, **longs), \
            torch.zeros(1, **longs)
        self.drafts = torch.zeros(batch, k, **longs)
        self.q = torch.zeros(batch, k, self.vocab, dtype=torch.float32, device=self.device)
        counters = dict(dtype=torch.float64, device=self.device)
        self.counts = {name: torch.zeros((), **counters) for name in
                       ("tokens", "cycles", "first_accepted", "all_accepted", "alpha_sum", "alpha_var")}
        self.graphs: dict[str, torch.cuda.CUDAGraph] = {}

    # ---- the phases --------------------------------------------------------------------------------------
    def decode(self) -> None:
        hidden = policy_forward(self.policy, self.layers, self.token[:, None], self.position[:, None], self.caches)
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
            hidden = policy_forward(self.policy, self.layers, self.last[:, None], (self.start + 1)[:, None],
                                    self.caches)[:, 0]
            self._drafted(self.policy.lm_head(hidden), hidden, self.start + 2)
            return
        # the head's entries for the previous verify's K + 1 positions; the output at s starts the chain
        positions = self.base[:, None] + torch.arange(self.k + 1, device=self.device)
        out = self._head(self.verify_hidden, self.next_tokens, positions)
        pick = self.accepted[:, None, None].expand(-1, 1, out.normed.shape[-1])
        self._drafted(self.head.logits(out.normed.gather(1, pick)[:, 0]), out.feed_back.gather(1, pick)[:, 0],
                      self.start + 1)

    def step(self) -> None:
        """Draft position j + 1: d_j fed back at `draft_position`."""
        if self.drafter == "target":
            hidden = policy_forward(self.policy, self.layers, self.draft[:, None], self.draft_position[:, None],
                                    self.caches)[:, 0]
            self._drafted(self.policy.lm_head(hidden), hidden, self.draft_position + 1)
            return
        out = self._head(self.feed[:, None], self.draft[:, None], self.draft_position[:, None])
        self._drafted(self.head.logits(out.normed[:, 0]), out.feed_back[:, 0], self.draft_position + 1)

    def verify(self) -> None:
        k = self.k
        ids = torch.cat([self.last[:, None], self.drafts], dim=1)
        positions = (self.start + 1)[:, None] + torch.arange(k + 1, device=self.device)
        hidden = policy_forward(self.policy, self.layers, ids, positions, self.caches)
        p = torch.softmax(self.policy.lm_head(hidden).float(), dim=-1)  # [B, K+1, V]
        accepted, emitted = rejection_step(p, self.q, self.drafts, self.generator)
        alpha = torch.minimum(p[:, 0], self.q[:, 0]).sum(-1).double()
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

    def _head(self, hidden, ids, positions):
        self.head_cache.positions = positions
        return self.head(hidden, ids, positions, cache=self.head_cache,
                         draft_path=MaskedGQA(visible(positions, self.capacity)))

    def _drafted(self, logits, feed, next_position) -> None:
        q = torch.softmax(logits.float(), dim=-1)
        draft = sample(q, self.generator)
        self.q.index_copy_(1, self.j, q[:, None])
        self.drafts.index_copy_(1, self.j, draft[:, None])
        self.feed.copy_(feed)
        self.draft.copy_(draft)
        self.draft_position.copy_(next_position)
        self.j.add_(1)

    # ---- running -----------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Every sequence at `context` committed positions: decode's next token at `context`; the previous
        verify (random hidden states and tokens) at context - 1, none of its drafts accepted."""
        g = self.init_generator
        self.token.random_(0, self.vocab, generator=g)
        self.position.fill_(self.context)
        self.verify_hidden.normal_(generator=g)
        self.next_tokens.random_(0, self.vocab, generator=g)
        self.base.fill_(self.context - 1)
        self.accepted.zero_()
        for t in self.counts.values():
            t.zero_()

    def capture(self) -> None:
        """One CUDA graph per phase, all in one new memory pool (warm-up runs first, on a side stream, as
        torch.cuda.graphs asks)."""
        if self.device.type != "cuda":
            return
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
        _sync(self.device)
        t0 = time.perf_counter()
        for _ in range(count):
            self.run("decode") if what == "decode" else self.cycle()
        _sync(self.device)
        seconds = time.perf_counter() - t0
        return seconds, {name: float(t) for name, t in self.counts.items()}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _round_up(n: int, multiple: int = 64) -> int:
    return -(-n // multiple) * multiple


def capacity_for(context: int, plan: LoopPlan, k: int) -> int:
    """Slots a context's runs need: the context, the longest run's steps (a cycle commits up to K + 1
    tokens, and its verify writes K + 1 slots past its start), rounded up to 64 (aligned rows for the kernels)."""
    longest = max(plan.ar_steps, (max(plan.spec_cycles, plan.calib_cycles) + 1) * (k + 1) + 1)
    return _round_up(context + longest)


def layers_that_fit(config, batch: int, capacity: int, free_bytes: int, reserve_bytes: int) -> int:
    """Policy layers whose weights and KV caches fit in `free_bytes` less the reserve, the embedding, the
    head (its layer and its cache) and the loop's logits; at most 36, at least 2 (two depths make the line)."""
    h, inter, kv, d = config.hidden_size, config.intermediate_size, config.num_key_value_heads, config.head_dim
    attn = h * d * (config.num_attention_heads * 2 + kv * 2)
    layer_bytes = 2 * (attn + 3 * h * inter)
    cache_bytes = 2 * 2 * batch * kv * capacity * d  # keys and values, bf16
    fixed = 2 * config.vocab_size * h + layer_bytes + 2 * 2 * h * h + cache_bytes
    fixed += 4 * batch * 16 * config.vocab_size * 4  # q, p and the samplers' fp32 rows, 16 rows a sequence
    fit = (free_bytes - reserve_bytes - fixed) // (layer_bytes + cache_bytes)
    return int(max(2, min(36, fit)))


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


def acceptance_z(counts: dict) -> float:
    """The first drafts' acceptance rate against its expectation, the mean of sum min(p_1, q_1) over the
    cycles, in standard errors: sqrt(sum alpha (1 - alpha)) / cycles (independent Bernoulli trials)."""
    n = counts["cycles"]
    return (counts["first_accepted"] - counts["alpha_sum"]) / math.sqrt(max(counts["alpha_var"], 1e-30)) if n else 0.0


def _add(total: dict, counts: dict) -> None:
    for name, value in counts.items():
        total[name] = total.get(name, 0.0) + value


def measure(plan, loop_plan: LoopPlan, build_policy, build_head, device: torch.device, log) -> dict:
    """The loop at every context and tau at the deepest policy that fits, and at half its depth (module
    docstring). `build_policy(layers)` gives an eval policy in bf16, `build_head(policy)` its head."""
    k, batch, contexts = plan.k, loop_plan.batch, loop_plan.contexts
    config = plan.config
    capacity = {c: capacity_for(c, loop_plan, k) for c in contexts}
    biggest = max(capacity.values())
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        layers = layers_that_fit(config, batch, biggest, free, loop_plan.reserve_bytes)
    else:
        free, layers = None, plan.trainer_layers or 2
    depths = (layers, max(1, layers // 2))
    policy = build_policy(layers)
    head = build_head(policy)
    g = torch.Generator(device=device).manual_seed(0)
    dtype = policy.model.embed_tokens.weight.dtype
    kv = lambda: StaticKV(batch, config.num_key_value_heads, biggest, config.head_dim, device, dtype)  # noqa: E731
    policy_kv, head_kv = [kv() for _ in range(layers)], kv()
    room = "" if free is None else f", {free / 2**30:.1f} GiB free"
    log(f"  (rollout_loop) {layers} of {config.num_hidden_layers} layers fit (caches for {batch} x {biggest} "
        f"positions{room})")
    scales, per, totals, loop = {}, {}, {}, None
    for depth in depths:
        for context in contexts:
            loop = None  # the last context's graphs and their pool go before this context's are captured
            if device.type == "cuda":
                torch.cuda.empty_cache()
            for cache in policy_kv + [head_kv]:
                cache.fill_random(context, g)
            t0 = time.perf_counter()
            loop = Loop(policy, depth, head, policy_kv, head_kv, context, capacity[context], k)
            loop.capture()
            captured = time.perf_counter() - t0
            if not scales:  # the scales of the taus, once, at the deepest policy and the smallest context
                for tau in loop_plan.taus:
                    found = calibrate(loop, tau, loop_plan.calib_cycles, loop_plan.calib_probes)
                    scales[tau] = found
                    log(f"  (rollout_loop) tau {tau}: scale 2^{found['log2_scale']:.2f} (probe tau "
                        f"{found['tau_probe']:.2f})")
            norm = getattr(head, head.family.final_norm_name).weight
            ar = [loop.timed("decode", loop_plan.ar_steps) for _ in range(loop_plan.repeats)]
            decode_s = statistics.median(s for s, _ in ar) / loop_plan.ar_steps
            row = {"layers": depth, "capacity": capacity[context], "capture_s": captured, "decode_s": decode_s,
                   "ar_tokens_per_s": batch / decode_s, "taus": {}}
            for tau in (loop_plan.taus if depth == layers else (PAPER["tau"],)):
                with torch.no_grad():
                    norm.copy_(scales[tau]["base"] * 2.0 ** scales[tau]["log2_scale"])
                runs = [loop.timed("cycle", loop_plan.spec_cycles) for _ in range(loop_plan.repeats)]
                counts = {}
                for _, c in runs:
                    _add(counts, c)
                if depth == layers:
                    _add(totals, counts)
                cycle_s = statistics.median(s for s, _ in runs) / loop_plan.spec_cycles
                measured_tau = counts["tokens"] / counts["cycles"]
                row["taus"][str(tau)] = {"tau": measured_tau, "cycle_s": cycle_s,
                                         "spec_tokens_per_s": measured_tau * batch / cycle_s,
                                         "speedup": measured_tau * decode_s / cycle_s}
            row["cycle_s"] = statistics.median(t["cycle_s"] for t in row["taus"].values())
            row["break_even_tau"] = row["cycle_s"] / decode_s
            per[(depth, context)] = row
            log(f"  (rollout_loop) {depth} layers, {context} tokens: decode {decode_s * 1e3:.2f} ms, cycle "
                f"{row['cycle_s'] * 1e3:.2f} ms, break-even tau {row['break_even_tau']:.2f} (graphs "
                f"{captured:.1f} s)")
            del loop
    with torch.no_grad():
        getattr(head, head.family.final_norm_name).weight.copy_(next(iter(scales.values()))["base"])
    return {"layers": layers, "depths": list(depths), "per": per, "scales": scales, "counts": totals,
            "graphs": device.type == "cuda", "batch": batch, "capacity": capacity}


def at_real_layers(measured: dict, contexts, real_layers: int) -> dict:
    """Per context, decode and cycle seconds read at `real_layers` on the line through the two depths: the
    per-layer time (the slope) x layers + the non-layer part (the intercept), both measured."""
    deep, shallow = measured["depths"]
    out = {}
    for c in contexts:
        rows = measured["per"][(deep, c)], measured["per"][(shallow, c)]
        fits = {name: fit_line([deep, shallow], [r[name] for r in rows], nonnegative_slope=True)
                for name in ("decode_s", "cycle_s")}
        decode, cycle = fits["decode_s"].at(real_layers), fits["cycle_s"].at(real_layers)
        out[c] = {"decode_s": decode, "cycle_s": cycle, "break_even_tau": cycle / decode,
                  "speedup_at_paper_tau": PAPER["tau"] * decode / cycle,
                  "per_layer_s": {n: f.b for n, f in fits.items()}, "non_layer_s": {n: f.a for n, f in fits.items()}}
    return out


def target_drafts_are_all_accepted(plan, loop_plan: LoopPlan, build_policy, device) -> dict:
    """q = p: the policy drafts for itself (fp64, so that its one-token forwards and the verify's six-token
    forward round alike to ~1e-16) and the loop must accept every draft."""
    policy = build_policy(plan.trainer_layers or 2, torch.float64)
    config, context, batch = plan.config, loop_plan.contexts[0], loop_plan.batch
    capacity = _round_up(context + (loop_plan.check_cycles + 1) * (plan.k + 1) + 1)
    g = torch.Generator(device=device).manual_seed(3)
    caches = [StaticKV(batch, config.num_key_value_heads, capacity, config.head_dim, device, torch.float64)
              for _ in range(len(policy.model.layers))]
    for cache in caches:
        cache.fill_random(context, g)
    loop = Loop(policy, len(caches), None, caches, None, context, capacity, plan.k, seed=3, drafter="target")
    counts = loop.timed("cycle", loop_plan.check_cycles)[1]
    return {"cycles": counts["cycles"], "all_accepted": counts["all_accepted"],
            "tau": counts["tokens"] / counts["cycles"]}


def check_rollout_loop(plan, build_policy, build_head, device: torch.device, log) -> tuple[list[Row], dict]:
    """The rows and the details of check `rollout_loop` (module docstring). `build_policy(layers, dtype=bf16)`."""
    loop_plan = LOOP_PLANS[plan.name]
    measured = measure(plan, loop_plan, lambda n: build_policy(n, torch.bfloat16), build_head, device, log)
    contexts, real, batch = loop_plan.contexts, plan.real_layers, loop_plan.batch
    deep = measured["layers"]
    at_real = at_real_layers(measured, contexts, real)
    rollout = rollout_from_loop(at_real, contexts, plan)
    rows, per_context = [], {}
    for c in contexts:
        row, real_c = measured["per"][(deep, c)], at_real[c]
        at_paper = row["taus"].get(str(PAPER["tau"]), {})
        per_context[str(c)] = {"measured": {d: {**measured["per"][(d, c)]} for d in measured["depths"]},
                               "at_real_layers": real_c}
        taus = ", ".join(f"{t['tau']:.2f}: {t['spec_tokens_per_s']:.0f}" for t in row["taus"].values())
        rows.append(Row("rollout_loop", f"{batch} sequences at {c} tokens, {deep} layers: tokens/s AR; spec at "
                        f"measured tau", f"AR {row['ar_tokens_per_s']:.0f}; {taus}",
                        f"break-even tau {row['break_even_tau']:.2f}; at tau {at_paper.get('tau', float('nan')):.2f} "
                        f"{at_paper.get('speedup', float('nan')):.2f}x", None,
                        {"break_even_tau": row["break_even_tau"], "speedup": at_paper.get("speedup")}))
        rows.append(Row("rollout_loop", f"the same at {real} layers (per-layer line through {measured['depths'][0]} "
                        f"and {measured['depths'][1]})", f"decode {real_c['decode_s'] * 1e3:.2f} ms, cycle "
                        f"{real_c['cycle_s'] * 1e3:.2f} ms", f"break-even tau {real_c['break_even_tau']:.2f}; at tau "
                        f"{PAPER['tau']} {real_c['speedup_at_paper_tau']:.2f}x (paper {PAPER['rollout_speedup']}x)",
                        None, {"break_even_tau": real_c["break_even_tau"], "speedup": real_c["speedup_at_paper_tau"]}))
    rows.append(Row("rollout_loop", f"rollout speedup at tau {PAPER['tau']}, {plan.rollout_response}-token responses, "
                    f"{real} layers", f"{rollout['speedup']:.2f}x", f"paper {PAPER['rollout_speedup']}x", None,
                    {"speedup": rollout["speedup"]}))
    counts = measured["counts"]
    z = acceptance_z(counts)
    rows.append(Row("rollout_loop", f"first-draft acceptance vs sum min(p, q), {counts['cycles']:.0f} cycles",
                    f"z {z:.2f} ({counts['first_accepted'] / counts['cycles']:.4f} vs "
                    f"{counts['alpha_sum'] / counts['cycles']:.4f})", f"|z| <= {Z_LIMIT:g}", abs(z) <= Z_LIMIT,
                    {"z": z}))
    details = {"batch": batch, "k": plan.k, "layers_measured": deep, "depths": measured["depths"],
               "real_layers": real, "cuda_graphs": measured["graphs"], "contexts": list(contexts),
               "capacity": {str(c): v for c, v in measured["capacity"].items()},
               "scaling_rule": "t(36) = t(L) + (36 - L) x (t(L) - t(L2)) / (L - L2), per context and phase: the "
                               "per-layer time x 36 + the non-layer part, both measured at L and L2 = L // 2",
               "tau_scales": {str(t): {k2: v for k2, v in s.items() if k2 != "base"}
                              for t, s in measured["scales"].items()},
               "per_context": per_context, "rollout": rollout, "acceptance": {**counts, "z": z}, "paper": PAPER,
               "leaves_out": ["vLLM's scheduler and paged attention", "the prefill",
                              "the length tail: every sequence runs to the cap",
                              "attention reads the whole static buffer (context + the runs' margin)"]}
    if loop_plan.check_cycles and device.type == "cpu":
        same = target_drafts_are_all_accepted(plan, loop_plan, build_policy, device)
        details["target_as_drafter"] = same
        rows.append(Row("rollout_loop", f"q = p (the target drafts): drafts accepted, {same['cycles']:.0f} cycles",
                        f"{same['all_accepted']:.0f} of {same['cycles']:.0f} cycles accept all {plan.k}",
                        "every one", same["all_accepted"] == same["cycles"], same))
    return rows, details


def rollout_from_loop(at_real: dict, contexts, plan) -> dict:
    """The paper's rollout (responses of `rollout_response` after `rollout_prompt`) at tau 2.91 from the
    loop's 36-layer decode and cycle seconds, linear in the context (`gpu_cycle.rollout_prediction`)."""
    from gpu_cycle import rollout_prediction

    return rollout_prediction(list(contexts), [at_real[c]["decode_s"] for c in contexts],
                              [at_real[c]["cycle_s"] for c in contexts], PAPER["tau"], plan.rollout_prompt,
                              plan.rollout_response)
