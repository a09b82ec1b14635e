"""The draft vocabulary (`--growmtp_draft_vocab`): its ranking, the head's q over it, and the head loss and α
reading that same q, each against an independent reference."""

import collections

import pytest
import torch

from helpers.tiny import FAMILY_NAMES, VOCAB, make_head, make_records
from openrlhf_growmtp.core import HeadLossConfig, head_loss_backward
from openrlhf_growmtp.core.draft_vocab import DRAFT_VOCAB_META, DraftVocab, TokenCounts, check_drafted_over
from openrlhf_growmtp.core.objectives import (LOG_ALPHA_FLOOR, head_loss_per_cycle, log_acceptance_rates,
                                               log_acceptance_rates_at)
from growmtp_lab.reference_drafting import chain_by_chain


def quarter(seed: int = 0) -> DraftVocab:
    """A quarter of the tiny vocabulary, drawn at random (so the head's likeliest ids fall on both sides)."""
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[: VOCAB // 4]
    return DraftVocab(ids.sort().values, VOCAB)


def test_ranking_is_by_frequency_then_the_smaller_id():
    g = torch.Generator().manual_seed(0)
    tokens = (torch.rand(500, generator=g) ** 3 * 40).long()  # skewed, with ties and unseen ids
    counts = TokenCounts(60)
    counts.add(tokens[:123])
    counts.add(tokens[123:])
    seen = collections.Counter(tokens.tolist())
    reference = sorted(range(60), key=lambda i: (-seen.get(i, 0), i))
    for size in (1, 7, 20, 45, 60):
        assert counts.top(size).ids.tolist() == sorted(reference[:size]), size
    with pytest.raises(ValueError, match="does not fit"):
        counts.top(61)
    with pytest.raises(ValueError, match="outside"):
        counts.add(torch.tensor([60]))


def test_coverage_and_tag_name_the_ids():
    vocab = DraftVocab(torch.tensor([2, 5, 7]), 10)
    assert vocab.coverage(torch.tensor([[2, 3], [7, 7]])) == 0.75
    assert vocab.tag == DraftVocab(torch.tensor([2, 5, 7]), 10).tag != DraftVocab(torch.tensor([2, 5, 8]), 10).tag
    with pytest.raises(ValueError, match="ascending"):
        DraftVocab(torch.tensor([5, 2]), 10)


def test_the_heads_q_is_its_softmax_over_the_vocabulary_and_zero_outside():
    head = make_head("qwen3")
    normed = torch.randn(11, head.config.hidden_size, generator=torch.Generator().manual_seed(1))
    vocab = quarter()
    with torch.no_grad():
        full = head.logits(normed).float()
        head.draft_vocab = vocab
        q = torch.softmax(head.logits(normed).float(), dim=-1)
    outside = vocab.outside()
    assert torch.equal(q[:, outside], torch.zeros_like(q[:, outside]))
    # fp32 softmax over 24 logits either way: only the order of the sums differs
    assert (q[:, vocab.ids] - torch.softmax(full[:, vocab.ids], dim=-1)).abs().max() <= 1e-6
    # not vacuous: in every row the whole vocabulary's q puts real mass outside the subset
    assert torch.softmax(full, dim=-1)[:, outside].sum(-1).min() > 0.1


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_head_loss_over_a_draft_vocabulary_equals_the_chain_by_chain_reference(family):
    """The trainer's sparse path (log q at the top-k only, its own gradient) against dense masked q drafted
    chain by chain; top-k ids outside the vocabulary read log q = -inf there."""
    head = make_head(family)
    records = make_records(k=4)
    vocab = quarter(seed=2)
    head.draft_vocab = vocab
    topk_ids = torch.cat([r.topk_ids for r in records])
    assert vocab.outside()[topk_ids].any() and (~vocab.outside())[topk_ids].any()
    topk_logprobs, accepted = torch.cat([r.topk_logprobs for r in records]), torch.cat([r.accepted for r in records])
    loss, _ = head_loss_per_cycle(chain_by_chain(head, records), topk_ids, topk_logprobs, accepted, "dca")
    loss.mean().backward()
    reference = {name: p.grad.clone() for name, p in head.named_parameters()}
    head.zero_grad(set_to_none=True)
    stats = head_loss_backward(head, records, None, HeadLossConfig(objective="dca"))
    assert stats.finite and abs(stats.loss - loss.mean().item()) <= 1e-5
    for name, p in head.named_parameters():
        scale = reference[name].abs().max().item()
        assert scale > 0, name
        assert (p.grad - reference[name]).abs().max().item() <= 1e-5 * max(1.0, scale), name
    head.zero_grad(set_to_none=True)
    head.draft_vocab = None
    assert abs(head_loss_backward(head, records, None, HeadLossConfig(objective="dca")).loss - stats.loss) > 1e-3


def test_alpha_over_a_draft_vocabulary_is_the_exact_overlap_with_the_subset_q():
    """With every id recorded (top-k = V) the estimate is exact: Σ_d min(p, q) with q zero outside the subset,
    computed densely; it differs from the whole vocabulary's α by what the subset leaves out."""
    head = make_head("qwen3")
    records = make_records(k=3, topk=VOCAB)
    ids = torch.cat([r.topk_ids for r in records]).long()
    p = torch.zeros(ids.shape[:2] + (VOCAB,)).scatter_(-1, ids, torch.cat([r.topk_logprobs for r in records]).exp())
    with torch.no_grad():
        full_logits = chain_by_chain(head, records)
        head.draft_vocab = quarter(seed=4)
        logits = chain_by_chain(head, records)
    alpha = log_acceptance_rates(logits, ids, p.log().gather(-1, ids)).exp()
    dense = torch.minimum(p, torch.softmax(logits, dim=-1)).sum(-1)
    assert (alpha - dense).abs().max() <= 1e-5
    full_alpha = torch.minimum(p, torch.softmax(full_logits, dim=-1)).sum(-1)
    assert (full_alpha - dense).abs().max() > 1e-2


def test_records_drafted_over_another_vocabulary_are_refused():
    records = make_records(k=2)
    vocab = quarter()
    with pytest.raises(ValueError, match="all ids"):
        check_drafted_over(records, vocab)
    for record in records:
        record.meta[DRAFT_VOCAB_META] = vocab.tag
    check_drafted_over(records, vocab)
    with pytest.raises(ValueError, match=vocab.tag):
        check_drafted_over(records, quarter(seed=1))
    with pytest.raises(ValueError, match="all ids"):
        check_drafted_over(records, None)


def test_an_alpha_the_vocabulary_makes_zero_is_floored_without_a_gradient_and_others_are_untouched():
    """Every recorded id outside the vocabulary (log q = -inf there): with a target residual the α is that bin's,
    without one it is exactly 0, read as LOG_ALPHA_FLOOR; no NaN reaches log q (torch's logsumexp over only -inf
    has a NaN gradient). Rows with finite log q give torch's own values."""
    logp = torch.log(torch.tensor([[0.6, 0.3, 0.1 - 1e-9], [0.5, 0.2, 0.1], [0.5, 0.2, 0.1]]))
    inside = torch.log(torch.tensor([0.2, 0.3, 0.1]))
    logq = torch.stack([torch.full((3,), float("-inf")), torch.full((3,), float("-inf")), inside]).requires_grad_()
    log_alpha = log_acceptance_rates_at(logq, logp)
    assert log_alpha[0] == LOG_ALPHA_FLOOR
    assert torch.allclose(log_alpha[1].exp(), torch.tensor(0.2), atol=1e-6)  # min(residual p 0.2, residual q 1)
    reference = torch.logsumexp(torch.cat([torch.minimum(logp[2], logq[2].detach()),
                                           torch.minimum(torch.log1p(-logp[2].exp().sum()),
                                                         torch.log1p(-logq[2].detach().exp().sum()))[None]]), 0)
    assert torch.allclose(log_alpha[2], reference, atol=1e-6)
    log_alpha.sum().backward()
    assert torch.isfinite(logq.grad).all() and torch.equal(logq.grad[:2], torch.zeros(2, 3))
