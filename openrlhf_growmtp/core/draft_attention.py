"""The attention of batched draft-path reconstruction: every query scores only the keys it can see.

At draft position j of a chunk, the query of cycle c (sequence i, start s) sees two sets of keys:

- the committed prefix of its own sequence, positions p < s. Queries are taken per sequence in blocks
  of consecutive cycles (ascending starts), and a block scores the keys up to its own largest start
  only: no other sequence's keys, and about half of a long prefix;
- its own chain entries of draft positions 1..j (at most K keys).

One autograd function (`draft_attention`) runs both and merges them by their log-sum-exps. It keeps for
backward only its inputs, the output and the log-sum-exp (nothing of size queries x keys): the backward
recomputes each block's probabilities, as flash attention does. The prefix keys and values are read in
place at every draft position, never copied or expanded to the query heads: grouped-query attention folds the
query heads sharing a key head into one matrix product. Scores and sums are in fp32. A block launches its
matrix products and a few elementwise passes only: the queries are laid out by key head once per call
(a block's rows are then a view), and its masks broadcast over the query heads.

The head's decoder layer reaches this through transformers' attention interface: the head's config
names `ATTENTION_NAME`, which runs SDPA unless the call passes `draft_path=` (`DraftPathAttention`, or
any callable with its signature). `DraftPathAttention` is also the layer's cache: `update` receives the
draft position's new keys and values.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

ATTENTION_NAME = "growmtp_draft_path"

# At most this many fp32 scores in one block of the prefix. On CPU small blocks stay in cache and skip
# more of the masked keys (`benchmarks/bench_reconstruction.py` chose 2^18); a GPU wants fewer, larger
# launches (`benchmarks/bench_launches.py`): 256 MiB of scores, 512 MiB with the backward's two.
BLOCK_SCORES = {"cpu": 2**18, "cuda": 2**26}


def _attention(module, query, key, value, attention_mask, scaling=None, draft_path=None, **kwargs):
    if draft_path is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    return draft_path(query, key, value, scaling)


AttentionInterface.register(ATTENTION_NAME, _attention)


class Block(NamedTuple):
    """Queries [lo, hi) of sequence `seq`; keys p < `keys` are scored, and those from `first` (the
    smallest start) on are masked per query."""

    lo: int
    hi: int
    seq: int
    first: int
    keys: int


def plan_blocks(seq: Sequence[int], start: Sequence[int], heads: int, budget: int) -> list[Block]:
    """Blocks of consecutive queries of one sequence (ascending starts), each scoring the keys p < its
    last start, with at most `budget` scores (one query's row alone may exceed it). Blocks whose queries
    see no key are left out."""
    blocks, lo = [], 0
    for i in range(1, len(seq) + 1):
        if i < len(seq) and seq[i] == seq[lo] and (i + 1 - lo) * heads * start[i] <= budget:
            continue
        if start[i - 1] > 0:
            blocks.append(Block(lo, i, seq[lo], start[lo], start[i - 1]))
        lo = i
    return blocks


def _by_key_head(t: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """[Q, kv, rep, ...] -> fp32 [kv, Q * rep, ...], contiguous, times `scale`: a block's queries (rows
    lo * rep .. hi * rep) are then a view, so that a block launches its matrix products and little else."""
    moved = t.movedim(1, 0)
    out = torch.empty(moved.shape, dtype=torch.float32, device=t.device).copy_(moved)
    if scale != 1.0:
        out.mul_(scale)
    return out.view(t.shape[1], t.shape[0] * t.shape[2], *t.shape[3:])


def _block_scores(q: torch.Tensor, key: torch.Tensor, start: torch.Tensor, first: int, rep: int,
                  positions: torch.Tensor) -> torch.Tensor:
    """Scores [kv, n * rep, L] of one block (q already scaled), -inf at keys p >= the query's start (every
    key before `first`, the block's smallest start, is visible to all of its queries)."""
    scores = torch.bmm(q, key.transpose(1, 2))
    hidden = positions[first:key.shape[1]][None, :] >= start[:, None]  # [n, L - first]
    scores.view(scores.shape[0], -1, rep, scores.shape[2])[..., first:].masked_fill_(hidden[None, :, None],
                                                                                      float("-inf"))
    return scores


def _prefix_forward(qs, start, blocks, rep, prefix) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [kv, Q * rep, d], lse [kv, Q * rep]) over the prefix keys alone, fp32, from the scaled queries
    qs [kv, Q * rep, d] (no key: 0 and -inf). Per block, its exponentials' row sum s is 0 (no key) or at
    least 1 (the row's maximum contributes exp(0)), so dividing by max(s, 1) is exact and safe."""
    kv, rows, dim = qs.shape
    out = torch.zeros(kv, rows, dim, dtype=torch.float32, device=qs.device)
    lse = torch.full((kv, rows), float("-inf"), dtype=torch.float32, device=qs.device)
    positions = torch.arange(max((b.keys for b in blocks), default=0), device=qs.device)
    for lo, hi, seq, first, length in blocks:
        key, value = prefix[2 * seq][:, :length].float(), prefix[2 * seq + 1][:, :length].float()
        scores = _block_scores(qs[:, lo * rep:hi * rep], key, start[lo:hi], first, rep, positions)
        peak = torch.nan_to_num(scores.amax(-1), neginf=0.0)  # no key: -inf -> 0, and the row stays 0
        weights = scores.sub_(peak[..., None]).exp_()
        total = weights.sum(-1)
        torch.div(torch.bmm(weights, value), total.clamp(min=1.0)[..., None], out=out[:, lo * rep:hi * rep])
        torch.add(total.log_(), peak, out=lse[:, lo * rep:hi * rep])
    return out, lse


class _DraftAttention(torch.autograd.Function):
    """Softmax attention of queries [Q, kv, rep, d] over their prefix keys p < start and their own chain
    keys [Q, kv, j, d]. Saves the inputs, the output and the log-sum-exp; the backward recomputes
    the probabilities block by block: dS = P (dO V^T - rowsum(dO * O)), as flash attention does. The
    prefix part runs on the queries laid out by key head (`_by_key_head`), made once per call."""

    @staticmethod
    def forward(ctx, query, chain_keys, chain_values, start, blocks, scale, *prefix):
        num, kv, rep, dim = query.shape
        out_p, lse_p = _prefix_forward(_by_key_head(query, scale), start, blocks, rep, prefix)
        out_p, lse_p = out_p.view(kv, num, rep, dim).movedim(0, 1), lse_p.view(kv, num, rep).movedim(0, 1)
        q = query.float()
        scores = torch.einsum("nkrd,nkjd->nkrj", q, chain_keys.float()).mul_(scale)
        lse_c = torch.logsumexp(scores, dim=-1)
        out_c = torch.einsum("nkrj,nkjd->nkrd", scores.sub_(lse_c[..., None]).exp_(), chain_values.float())
        lse = torch.logaddexp(lse_p, lse_c)  # finite: every query sees its own position-1 entry
        out = (torch.exp(lse_p - lse)[..., None] * out_p + torch.exp(lse_c - lse)[..., None] * out_c).to(query.dtype)
        # the output as returned (the head's dtype, as flash attention keeps it; o_proj keeps it anyway)
        ctx.save_for_backward(query, chain_keys, chain_values, start, out, lse, *prefix)
        ctx.blocks, ctx.scale = blocks, scale
        return out

    @staticmethod
    def backward(ctx, d_out):
        query, chain_keys, chain_values, start, out, lse, *prefix = ctx.saved_tensors
        num, kv, rep, dim = query.shape
        scale = ctx.scale
        d_out = d_out.float()
        shift = (d_out * out.float()).sum(-1)  # rowsum(dO * O) [Q, kv, rep]
        # the chain keys
        q, keys, values = query.float(), chain_keys.float(), chain_values.float()
        p = torch.einsum("nkrd,nkjd->nkrj", q, keys).mul_(scale).sub_(lse[..., None]).exp_()
        d_values = torch.einsum("nkrj,nkrd->nkjd", p, d_out)
        d_scores = torch.einsum("nkrd,nkjd->nkrj", d_out, values).sub_(shift[..., None]).mul_(p).mul_(scale)
        d_query = torch.einsum("nkrj,nkjd->nkrd", d_scores, keys)
        d_keys = torch.einsum("nkrj,nkrd->nkjd", d_scores, q)
        # the prefix keys, block by block, on the rows laid out by key head (d_query's share unscaled)
        # one zeroed buffer for every prefix tensor's gradient (one launch, not one per tensor)
        sizes = [t.numel() for t in prefix]
        d_flat = torch.zeros(sum(sizes), dtype=torch.float32, device=query.device)
        d_prefix = [g.view(t.shape) for g, t in zip(d_flat.split(sizes), prefix)]
        if ctx.blocks:
            qs, grad_out = _by_key_head(query, scale), _by_key_head(d_out)
            lse_k, shift_k = _by_key_head(lse), _by_key_head(shift)
            d_query_k = torch.zeros_like(qs)
            positions = torch.arange(max(b.keys for b in ctx.blocks), device=qs.device)
            for lo, hi, seq, first, length in ctx.blocks:
                rows = slice(lo * rep, hi * rep)
                key, value = prefix[2 * seq][:, :length].float(), prefix[2 * seq + 1][:, :length].float()
                p = _block_scores(qs[:, rows], key, start[lo:hi], first, rep, positions)
                p = p.sub_(lse_k[:, rows, None]).exp_()
                d_prefix[2 * seq + 1][:, :length].baddbmm_(p.transpose(1, 2), grad_out[:, rows])
                d_scores = torch.bmm(grad_out[:, rows], value.transpose(1, 2)).sub_(shift_k[:, rows, None]).mul_(p)
                d_query_k[:, rows].baddbmm_(d_scores, key)
                d_prefix[2 * seq][:, :length].baddbmm_(d_scores.transpose(1, 2), qs[:, rows])  # dK = scale dS^T Q
            d_query.add_(d_query_k.view(kv, num, rep, dim).movedim(0, 1), alpha=scale)
        d_query = d_query.to(query.dtype)
        if len({t.dtype for t in prefix}) == 1:  # cast all at once, then views again
            d_prefix = [g.view(t.shape) for g, t in zip(d_flat.to(prefix[0].dtype).split(sizes), prefix)]
        return (d_query, d_keys.to(chain_keys.dtype), d_values.to(chain_values.dtype), None, None, None,
                *(g.to(t.dtype) for g, t in zip(d_prefix, prefix)))


def draft_attention(query: torch.Tensor, chain_keys: torch.Tensor, chain_values: torch.Tensor, start: torch.Tensor,
                    blocks: list[Block], scale: float, prefix: Sequence[tuple[torch.Tensor, torch.Tensor]]
                    ) -> torch.Tensor:
    """Attention of queries [Q, kv, rep, d] over the union of their sequence's prefix keys p < start [Q]
    (keys and values [kv, L_i, d] per sequence, indexed by `plan_blocks`' sequence) and their own chain
    keys and values [Q, kv, j, d] (at least one each). Returns [Q, kv, rep, d] in the query's dtype."""
    flat = [t for pair in prefix for t in pair]
    return _DraftAttention.apply(query, chain_keys, chain_values, start, blocks, scale, *flat)


class DraftPathAttention:
    """One chunk's attention: the head's cache (`update` stores each draft position's chain entries) and,
    passed as `draft_path=`, its attention function.

    prefix: (keys, values) [kv, L_i, d] per sequence of the chunk; seq, start [N]: each cycle's sequence
    (index into prefix) and start. Before each draft position, `next_position(cycles)` names its queries:
    the cycles still drafting, ascending (a subset of the previous position's).
    """

    def __init__(self, prefix: Sequence[tuple[torch.Tensor, torch.Tensor]], seq: torch.Tensor, start: torch.Tensor,
                 heads: int):
        self.prefix, self.heads = list(prefix), heads
        self.seq, self.start = seq, start
        self.seq_list, self.start_list = seq.tolist(), start.tolist()
        self.cycles: torch.Tensor | None = None  # this draft position's cycles
        self.kept: torch.Tensor | None = None  # their rows among the previous position's cycles
        # this position's cycles' chain entries at every position so far: [N_j, kv, j, d]
        self.chain_keys: torch.Tensor | None = None
        self.chain_values: torch.Tensor | None = None

    def next_position(self, cycles: torch.Tensor) -> None:
        self.kept = None if self.cycles is None else torch.searchsorted(self.cycles, cycles)
        self.cycles = cycles
        chosen = cycles.tolist()
        self.blocks = plan_blocks([self.seq_list[c] for c in chosen], [self.start_list[c] for c in chosen],
                                  self.heads, BLOCK_SCORES.get(self.start.device.type, BLOCK_SCORES["cuda"]))

    # transformers' Cache duck type: the layer writes the position's keys and values [1, kv, N_j, d]
    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int = 0, cache_kwargs=None):
        new_keys, new_values = key[0].transpose(0, 1)[:, :, None], value[0].transpose(0, 1)[:, :, None]
        if self.kept is None:
            self.chain_keys, self.chain_values = new_keys, new_values
        else:  # one gather of the earlier positions' entries (the cycles still drafting), then this position's
            self.chain_keys = torch.cat([self.chain_keys[self.kept], new_keys], dim=2)
            self.chain_values = torch.cat([self.chain_values[self.kept], new_values], dim=2)
        return key, value

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float):
        """query [1, heads, N_j, d] of this position's cycles -> ([1, N_j, heads, d], None)."""
        num, kv = self.cycles.shape[0], key.shape[1]
        q = query[0].transpose(0, 1).reshape(num, kv, -1, query.shape[-1])
        out = draft_attention(q, self.chain_keys, self.chain_values, self.start[self.cycles], self.blocks, scaling,
                              self.prefix)
        return out.reshape(1, num, -1, query.shape[-1]), None
