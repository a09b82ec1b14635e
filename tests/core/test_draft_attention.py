"""The reconstruction's attention against dense masked softmax attention: values and gradients (the
backward reads the forward's log-sum-exp, so a wrong one shows in the gradients)."""

import pytest
import torch

from openrlhf_growmtp.core.draft_attention import DraftPathAttention, draft_attention, plan_blocks

KV, REP, DIM = 2, 3, 8
SCALE = DIM ** -0.5


def dense(query, keys, values, visible):
    """query [Q, kv, rep, d], keys/values [kv, L, d], visible [Q, L] -> (out, lse), in float64."""
    scores = torch.einsum("nkrd,kld->nkrl", query.double(), keys.double()) * SCALE
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.nan_to_num(torch.exp(scores - lse[..., None]))  # a row without keys: 0
    return torch.einsum("nkrl,kld->nkrd", probs, values.double()), lse


@pytest.mark.parametrize("budget", [10**9, 100])  # one block per sequence; blocks of a few queries
def test_draft_attention_equals_dense_attention_with_gradients(budget):
    g = torch.Generator().manual_seed(0)
    lengths, depth = [7, 12], 3
    starts = [[0, 2, 2, 5, 7], [1, 4, 9, 11, 12, 12]]  # ascending; a query at 0 sees only its chain
    seq = [i for i, s in enumerate(starts) for _ in s]
    start = torch.tensor([s for ss in starts for s in ss])
    num = len(seq)
    query = torch.randn(num, KV, REP, DIM, generator=g, requires_grad=True)
    chain_k = torch.randn(num, KV, depth, DIM, generator=g, requires_grad=True)
    chain_v = torch.randn(num, KV, depth, DIM, generator=g, requires_grad=True)
    prefix = [(torch.randn(KV, n, DIM, generator=g, requires_grad=True),
               torch.randn(KV, n, DIM, generator=g, requires_grad=True)) for n in lengths]
    blocks = plan_blocks(seq, start.tolist(), KV * REP, budget)
    assert (len(blocks) > 4) == (budget == 100)
    out = draft_attention(query, chain_k, chain_v, start, blocks, SCALE, prefix)

    # the reference: every query over the keys of all sequences and all chains side by side, masked to
    # its own prefix p < s and its own chain
    offsets = [0, lengths[0]]
    keys = torch.cat([k for k, _ in prefix] + [chain_k.permute(1, 0, 2, 3).reshape(KV, -1, DIM)], dim=1)
    values = torch.cat([v for _, v in prefix] + [chain_v.permute(1, 0, 2, 3).reshape(KV, -1, DIM)], dim=1)
    column = torch.arange(sum(lengths))
    own_prefix = torch.stack([(column >= offsets[i]) & (column < offsets[i] + s)
                              for i, s in zip(seq, start.tolist())])
    own_chain = torch.arange(num).repeat_interleave(depth)[None, :] == torch.arange(num)[:, None]
    reference, _ = dense(query, keys, values, torch.cat([own_prefix, own_chain], dim=1))
    # fp32 scores against float64: |scores| <= ~10, so differences of a few 1e-6 are rounding
    assert (out.double() - reference).abs().max() <= 1e-5

    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    leaves = [query, chain_k, chain_v] + [t for pair in prefix for t in pair]
    got = torch.autograd.grad((out.double() * w).sum(), leaves)
    want = torch.autograd.grad((reference * w).sum(), leaves)
    for name, a, b in zip(["query", "chain keys", "chain values", "keys 0", "values 0", "keys 1", "values 1"],
                          got, want):
        assert b.abs().max() > 0, name
        assert (a.double() - b).abs().max() <= 1e-5 * max(1.0, b.abs().max().item()), name


def test_plan_blocks_cover_every_query_that_sees_a_key_once_within_its_sequence():
    seq = [0] * 6 + [1] * 5
    start = [0, 1, 1, 3, 8, 9, 2, 2, 5, 6, 20]
    for budget in (1, 30, 200, 10**6):
        blocks = plan_blocks(seq, start, 2, budget)
        covered = [q for b in blocks for q in range(b.lo, b.hi)]
        assert covered == sorted(set(covered))  # in order, none twice
        assert all(start[q] == 0 for q in set(range(len(seq))) - set(covered))  # only keyless ones left out
        for b in blocks:
            assert len({seq[q] for q in range(b.lo, b.hi)}) == 1 and b.seq == seq[b.lo]
            assert b.first == start[b.lo] and b.keys == max(start[b.lo:b.hi])
            assert b.hi - b.lo == 1 or (b.hi - b.lo) * 2 * b.keys <= budget


def test_draft_path_attention_matches_the_worked_example():
    # reconstruction.py's example: one sequence, 4 prefix slots, cycles starting at s = 1 and 3, draft
    # position 3 (keys: p0..p3 | position-1, -2 and -3 entries of c0 c1)
    visible = torch.tensor([[1, 0, 0, 0, 1, 0, 1, 0, 1, 0],
                            [1, 1, 1, 0, 0, 1, 0, 1, 0, 1]], dtype=torch.bool)
    g = torch.Generator().manual_seed(1)
    prefix_k, prefix_v = torch.randn(KV, 4, DIM, generator=g), torch.randn(KV, 4, DIM, generator=g)
    path = DraftPathAttention([(prefix_k, prefix_v)], torch.tensor([0, 0]), torch.tensor([1, 3]), KV * REP)
    cycles = torch.tensor([0, 1])
    chain_k, chain_v = [], []
    for position in range(1, 4):
        path.next_position(cycles)
        key, value = torch.randn(1, KV, 2, DIM, generator=g), torch.randn(1, KV, 2, DIM, generator=g)
        path.update(key, value)
        chain_k.append(key[0])
        chain_v.append(value[0])
        query = torch.randn(1, KV * REP, 2, DIM, generator=g)
        out, _ = path(query, key, value, SCALE)  # [1, 2, heads, d]
        keys = torch.cat([prefix_k] + chain_k, dim=1)
        values = torch.cat([prefix_v] + chain_v, dim=1)
        q = query[0].transpose(0, 1).reshape(2, KV, REP, DIM)
        ref, _ = dense(q, keys, values, visible[:, :4 + 2 * position])
        assert (out[0].double() - ref.reshape(2, KV * REP, DIM)).abs().max() <= 1e-5, position
