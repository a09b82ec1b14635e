"""Committed chains (core/committed.py): a cycle drafted at depth d < K trains positions d+1..K along the
committed sequence, against the policy's own distribution there; a fixed K is left exactly as it was."""

import pytest
import torch

from helpers.ranks import TwoRanks, module_calls
from helpers.tiny import VOCAB, make_head, make_records
from openrlhf_growmtp.core import HeadKVCache, HeadLossConfig, Lockstep
from openrlhf_growmtp.core.committed import chain_lengths_from, committed_chains
from openrlhf_growmtp.core.head_loss import head_loss_backward
from openrlhf_growmtp.core.objectives import head_loss_per_cycle
from growmtp_lab.reference_drafting import chain_by_chain

K = 4


def update(head, records, hiddens=None, lockstep=None, **cfg):
    return head_loss_backward(head, records, hiddens, HeadLossConfig(**cfg), lockstep or Lockstep())


def _grads(head):
    return {name: p.grad.detach().clone() for name, p in head.named_parameters() if p.grad is not None}


def _committed_reference(head, records, depth: int, objective: str) -> torch.Tensor:
    """Chain by chain, with the head's recurrent API and full-vocabulary distributions: for every cycle that
    accepted all its drafts, the chain from its start fed the committed tokens, scored at positions depth+1..L
    against softmax(lm_head(H_{s+k}) / T); summed over chains, divided by the drafted cycles."""
    total, cycles = torch.zeros(()), 0
    for rec in records:
        s_last, temperature = int(rec.start[-1]), rec.temperature
        for r in range(rec.num_cycles):
            cycles += 1
            s = int(rec.start[r])
            length = min(K, s_last - s)
            if length <= depth or int(rec.accepted[r]) < depth:  # not reached past the drafted depth
                continue
            cache = HeadKVCache()
            prefix = head.prefill(rec.hidden[None, :s + 1], rec.token_ids[None, 1:s + 2], 0, cache)
            committed = rec.token_ids[None, s + 2:s + 2 + length]
            _, logits = head.draft_chain(prefix.last(), s, committed, length, cache, temperature=temperature)
            with torch.no_grad():
                logp = torch.log_softmax(head.lm_head(rec.hidden[s + 1:s + 1 + length]).float() / temperature, -1)
            logq = torch.log_softmax(logits[0], -1)
            logq, logp = logq[depth:], logp[depth:]  # positions depth+1..L
            if objective == "dca":
                alpha = torch.minimum(logq.exp(), logp.exp()).sum(-1)  # full-vocabulary α
                total = total - torch.log(torch.cumprod(alpha, 0).sum())
            else:  # cross-entropy against p, averaged over the positions
                total = total + (-(logp.exp() * logq).sum(-1)).mean()
    return total / cycles


@pytest.mark.parametrize("objective", ["dca", "ce"])
@pytest.mark.parametrize("depth", [1, 2])
def test_committed_chains_equal_chain_by_chain_teacher_forcing(objective, depth):
    # top-k = the whole vocabulary: the sparse α is then the full-vocabulary α, and CE its full sum
    head = make_head("qwen3")
    records = make_records(k=depth, topk=VOCAB)
    drafted, _ = head_loss_per_cycle(chain_by_chain(head, records), torch.cat([r.topk_ids for r in records]),
                                     torch.cat([r.topk_logprobs for r in records]),
                                     torch.cat([r.accepted for r in records]), objective)
    committed = _committed_reference(head, records, depth, objective)
    (drafted.mean() + committed).backward()
    reference = _grads(head)
    for p in head.parameters():
        p.grad = None
    stats = update(head, records, objective=objective, max_depth=K, chunk_cycles=3)
    assert stats.finite and stats.committed is not None and stats.committed.num_cycles > 0
    assert abs(stats.loss - drafted.mean().item()) <= 1e-5 * max(1.0, abs(drafted.mean().item()))
    assert abs(stats.committed.loss - committed.item()) <= 1e-5 * max(1.0, abs(committed.item()))
    assert committed.abs().item() > 0.1  # not vacuous: the chains carry a loss
    got = _grads(head)
    assert set(got) == set(reference)
    for name, want in reference.items():
        scale = want.abs().max().item()
        assert scale > 0, name
        assert (got[name] - want).abs().max().item() <= 1e-5 * max(1.0, scale), name


def test_chains_run_to_the_last_start_and_past_the_drafted_depth_only():
    records = make_records(k=1, topk=8)  # starts 4 6 7 9 11 | 2 3 | 8 10 12 14; accepted 1 0 1 1 0 | 0 0 | 1 1 1 1
    assert [chain_lengths_from(rec, K).tolist() for rec in records] == [[4, 4, 4, 2, 0], [1, 0], [4, 4, 2, 0]]
    chains, hiddens = committed_chains(make_head("qwen3"), records, None, 1, K, Lockstep())
    # a chain where the cycle accepted its draft and a target lies past it; the second record has none
    assert [c.start.tolist() for c in chains] == [[4, 7, 9], [8, 10, 12]]
    first = chains[0]
    assert first.depth == K and first.accepted.tolist() == [3, 3, 1]  # L - 1
    assert torch.equal(first.drafts[0], records[0].token_ids[6:10])  # x_{s+2..s+K+1}, s = 4
    assert torch.equal(first.drafts[0, :1], records[0].drafts[0])  # up to the depth: the accepted draft
    assert torch.equal(hiddens[0], records[0].hidden)


def test_a_fixed_depth_is_unchanged_bit_for_bit():
    records = make_records(k=K)
    plain, chained = make_head("qwen3"), make_head("qwen3")
    without = update(plain, records, chunk_cycles=5)
    with_k = update(chained, records, chunk_cycles=5, max_depth=K)
    assert with_k.committed is None and with_k.loss == without.loss and with_k.alpha_sum == without.alpha_sum
    for (name, a), (_, b) in zip(plain.named_parameters(), chained.named_parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_committed_gradients_reach_only_the_head():
    # hidden states with a graph (joint mode): the draft paths' gradient reaches them, the chains' does not;
    # nothing reaches the backbone's embedding or lm_head
    records = make_records(k=1)
    grads = {}
    for max_depth in (None, K):
        head = make_head("qwen3")
        hiddens = [rec.hidden.clone().requires_grad_() for rec in records]
        stats = update(head, records, hiddens, chunk_cycles=4, max_depth=max_depth)
        assert (stats.committed is None) == (max_depth is None)
        assert head.lm_head.weight.grad is None and head.embed_tokens.weight.grad is None
        grads[max_depth] = ([h.grad for h in hiddens], _grads(head))
    for without, with_chains in zip(grads[None][0], grads[K][0]):
        assert torch.equal(without, with_chains)
    changed = [name for name, g in grads[K][1].items() if not torch.allclose(g, grads[None][1][name])]
    assert changed  # the chains did train the head


def test_a_rank_without_chains_keeps_step_and_its_gradients():
    # one rank has committed chains, the other none (its cycles end too close to their record's last start):
    # both make the same module calls, and the second's gradients equal its records' updated alone
    busy, idle = make_records(k=1), make_records(k=1, seed=5)[1:2]
    assert not committed_chains(make_head("qwen3"), idle, None, 1, K, Lockstep())[0]
    mode = dict(chunk_cycles=3, max_depth=K)
    alone = make_head("qwen3")
    update(alone, idle, **mode)
    heads = [make_head("qwen3"), make_head("qwen3")]

    def calls(lockstep, recs):
        head = heads[recs is idle]
        return module_calls(head, lambda: update(head, recs, lockstep=lockstep, **mode))

    first, second = TwoRanks.run(calls, busy, idle)
    assert first == second
    for (name, want), (_, got) in zip(alone.named_parameters(), heads[1].named_parameters()):
        assert (got.grad - want.grad).abs().max().item() <= 1e-6 * max(1.0, want.grad.abs().max().item()), name
