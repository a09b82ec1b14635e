"""The head update over a draft vocabulary's lm_head rows alone (`draft_vocab.DraftRows`): logits [M, N] instead
of [M, V] masked to -inf outside, the same loss and gradients; the rows sliced once per update, from the lm_head as
it is then, through the lockstep's gather."""

import contextlib

import pytest
import torch

from helpers.ranks import TwoRanks, module_calls
from helpers.tiny import VOCAB, make_head, make_records
from openrlhf_growmtp.core import HeadLossConfig, Lockstep, head_loss_backward, measure_head_loss
from openrlhf_growmtp.core.committed import committed_chains
from openrlhf_growmtp.core.draft_vocab import DraftRows, DraftVocab, MaskedLMHead


def quarter(seed: int = 2) -> DraftVocab:
    """A quarter of the tiny vocabulary (24 of 97 ids), drawn at random."""
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[: VOCAB // 4]
    return DraftVocab(ids.sort().values, VOCAB)


def records_with_a_cycle_outside(vocab: DraftVocab, k: int = 4):
    """The default tiny records (early rejections, all-accepted cycles, a second temperature), one cycle's top-k
    at position 1 moved wholly outside the vocabulary."""
    records = make_records(k=k)
    outside = torch.nonzero(vocab.outside()).flatten()
    records[0].topk_ids[1, 0] = outside[: records[0].topk_ids.shape[-1]]
    return records


def head_in(dtype: torch.dtype, vocab: DraftVocab | None):
    head = make_head("qwen3").to(dtype)
    head.lm_head.to(dtype)
    head.embed_tokens.to(dtype)
    head.draft_vocab = vocab
    return head


def masked_reference(dtype: torch.dtype, vocab: DraftVocab):
    """The same head, scoring over [M, V] logits masked outside `vocab` (no draft vocabulary of its own)."""
    head = head_in(dtype, None)
    head.bind(head.embed_tokens, MaskedLMHead(head.lm_head, vocab))
    return head


def update(head, records, hiddens, **cfg):
    return head_loss_backward(head, records, hiddens, HeadLossConfig(**cfg))


@contextlib.contextmanager
def logits_widths():
    """The widths of every scoring logits tensor the draft rows make."""
    widths, original = [], DraftRows.logits

    def spy(self, normed):
        out = original(self, normed)
        widths.append(int(out.shape[-1]))
        return out

    DraftRows.logits = spy
    try:
        yield widths
    finally:
        DraftRows.logits = original


@pytest.mark.parametrize("groups", ["one", "many"])
@pytest.mark.parametrize("chunk_cycles", [1, 3, None])
@pytest.mark.parametrize("vgm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_update_over_the_rows_equals_the_masked_full_vocabulary_one(dtype, vgm, chunk_cycles, groups,
                                                                       monkeypatch):
    """Loss, α and every gradient (the head's parameters; with one chunk, the hidden states too, as in joint
    mode) over logits [M, 24] equal today's over [M, 97] with -inf outside the 24 ids: top-k ids outside the
    vocabulary (one cycle's top-k wholly outside it), all-accepted cycles, chunks of 1 and 3 cycles or one,
    each chunk's slots scored in one group or many (groups of different bounds in the two computations)."""
    from openrlhf_growmtp.core import topk_logq

    if groups == "many":  # 3 slots per group over 97 ids, 12 over 24
        monkeypatch.setattr(topk_logq, "GROUP_LOGITS", {"cpu": 3 * VOCAB, "cuda": 3 * VOCAB})
    vocab = quarter()
    records = records_with_a_cycle_outside(vocab)
    topk_ids, accepted = torch.cat([r.topk_ids for r in records]), torch.cat([r.accepted for r in records])
    assert vocab.outside()[topk_ids].any() and (~vocab.outside())[topk_ids].any()
    assert (accepted == 4).any() and (accepted == 0).any()
    results = []
    for head in (masked_reference(dtype, vocab), head_in(dtype, vocab)):
        hiddens = [r.hidden.to(dtype).clone().requires_grad_(chunk_cycles is None) for r in records]
        calls = {}
        with logits_widths() as widths:
            calls = module_calls(head, lambda: results.append(
                (update(head, records, hiddens, vgm=vgm, chunk_cycles=chunk_cycles), head, hiddens)))
        results[-1] += (widths, calls.get("lm_head", 0))
    (ref, ref_head, ref_hiddens, ref_widths, ref_calls), (got, head, hiddens, widths, calls) = results
    # not vacuous: the reference ran the lm_head over every id, the subset never called it and scored [M, 24]
    assert ref_calls > 0 and not ref_widths and calls == 0 and widths and set(widths) == {24}
    assert head.draft_rows is None  # the rows live for the update only
    # The two differ only in the order of sums: the lm_head's products over 24 or 97 columns (the same dot
    # products of 64 terms), log-sum-exp over 24 terms or 97 with 73 exact zeros, and the gradient's product
    # with the rows (73 zero columns fewer). Log q, the objective and their gradient are computed in fp32
    # whatever the head's dtype (`TopKLogQ`, `objectives`; u = 6e-8): the log-sum-exp's order moves log q and
    # d loss / d z by a few u relative, and the head's backward (the same operations on both sides) carries
    # that relative error, exactly in fp64 and with its own fp32 rounding in fp32. So each quantity agrees
    # within 1e-5 of its own largest value in fp64 (~170 u) and 1e-4 in fp32; a wrong column, a missed
    # gradient or a gradient outside the vocabulary is O(1). (First written as 1e-10 for fp64, before noticing
    # that the scoring is fp32 in every dtype: the first run's fp64 gradients differed by 2.4e-8 relative.)
    tol = 1e-5 if dtype == torch.float64 else 1e-4
    assert got.finite and ref.finite and got.num_chunks == ref.num_chunks
    assert abs(got.loss - ref.loss) <= tol * abs(ref.loss)
    assert max(abs(a - b) for a, b in zip(got.alpha_sum, ref.alpha_sum)) <= tol * max(ref.alpha_sum)
    pairs = [(name, p.grad, q.grad) for (name, p), (_, q) in zip(head.named_parameters(), ref_head.named_parameters())]
    if chunk_cycles is None:
        pairs += [(f"hidden {i}", h.grad, r.grad) for i, (h, r) in enumerate(zip(hiddens, ref_hiddens))]
    for name, grad, expected in pairs:
        scale = expected.abs().max().item()
        assert scale > 0, name
        assert (grad - expected).abs().max().item() <= tol * scale, name


def test_the_rows_are_sliced_once_per_update_through_the_lockstep_and_never_stale():
    """One gather of the lm_head's weight per update (draft paths and measurement alike); an lm_head changed
    between updates (the policy's step) is read afresh; outside an update the head holds no rows."""
    vocab = quarter()
    records = make_records(k=4)
    head = head_in(torch.float64, vocab)
    gathers = []

    def gathered(params):
        gathers.append([p is head.lm_head.weight for p in params])
        return contextlib.nullcontext()

    lockstep = Lockstep(gathered=gathered)
    hiddens = [r.hidden.double() for r in records]
    head_loss_backward(head, records, hiddens, HeadLossConfig(chunk_cycles=2), lockstep)
    assert gathers == [[True]] and head.draft_rows is None
    measure_head_loss(head, records, hiddens, HeadLossConfig(chunk_cycles=2), lockstep)
    assert gathers == [[True], [True]]
    with torch.no_grad():
        head.lm_head.weight.add_(torch.randn(head.lm_head.weight.shape, generator=torch.Generator().manual_seed(9),
                                             dtype=torch.float64))
    after = measure_head_loss(head, records, hiddens, HeadLossConfig(chunk_cycles=2), lockstep)
    reference = masked_reference(torch.float64, vocab)
    with torch.no_grad():
        reference.lm_head.lm_head.weight.copy_(head.lm_head.weight)
    expected = measure_head_loss(reference, records, hiddens, HeadLossConfig(chunk_cycles=2))
    assert abs(after.loss - expected.loss) <= 1e-10 * max(1.0, abs(expected.loss))
    # an update inside an enclosing slice (a benchmark's captured graph holds one) slices its own, then leaves the
    # enclosing rows as they were
    with head.sliced_draft_rows():
        outer = head.draft_rows
        measure_head_loss(head, records, hiddens, HeadLossConfig(chunk_cycles=2), lockstep)
        assert outer is not None and head.draft_rows is outer and len(gathers) == 4
    assert head.draft_rows is None
    # no draft vocabulary: nothing gathered, the lm_head scores every id as before
    head.draft_vocab = None
    head_loss_backward(head, records, hiddens, HeadLossConfig(chunk_cycles=2), lockstep)
    assert len(gathers) == 4


def test_ranks_gather_the_rows_alike_and_a_rank_with_empty_groups_stays_finite(monkeypatch):
    """Two ranks, one with far fewer slots: the busier's slots need more lm_head groups, the other scores
    empty padding groups (one slot of weight 0, whose log q is -inf at ids outside the vocabulary). Both
    gather once, make the same module calls, stay finite, and the idle rank's gradients are its own alone."""
    from openrlhf_growmtp.core import topk_logq

    monkeypatch.setattr(topk_logq, "GROUP_LOGITS", {"cpu": 2 * 24, "cuda": 2 * 24})  # two slots per group
    vocab = quarter()
    busy, idle = make_records(k=4), make_records(k=4, seed=5)[1:2]
    for rec in idle:  # every recorded id of the idle rank outside the vocabulary: its log q is all -inf
        rec.topk_ids[:] = torch.nonzero(vocab.outside()).flatten()[: rec.topk_ids.shape[-1]]
    alone = head_in(torch.float64, vocab)
    alone_stats = update(alone, idle, [r.hidden.double() for r in idle], chunk_cycles=64)
    heads = [head_in(torch.float64, vocab), head_in(torch.float64, vocab)]

    def rank(lockstep, recs):
        head, stats = heads[recs is idle], []
        calls = module_calls(head, lambda: stats.append(head_loss_backward(
            head, recs, [r.hidden.double() for r in recs], HeadLossConfig(chunk_cycles=64), lockstep)))
        return calls, lockstep.gathers, stats[0]

    (first_calls, first_gathers, first), (second_calls, second_gathers, second) = TwoRanks.run(rank, busy, idle)
    assert first_calls == second_calls and first_gathers == second_gathers == 1
    assert first.finite and second.finite and alone_stats.finite
    for (name, want), (_, got) in zip(alone.named_parameters(), heads[1].named_parameters()):
        assert (got.grad - want.grad).abs().max().item() <= 1e-12 * max(1.0, want.grad.abs().max().item()), name


def test_committed_chains_read_the_policys_p_over_every_id_whatever_the_head_drafts_over():
    """The committed chains' targets are the policy's top-k over the whole vocabulary: the head's draft
    vocabulary changes neither their ids nor their log-probs (it used to mask the policy's logits too)."""
    records = make_records(k=1, layouts=[(5, [1, 1, 0, 1, 1, 1]), (9, [1, 1, 1, 0])])
    head = make_head("qwen3")
    plain, _ = committed_chains(head, records, None, 1, 4, Lockstep())
    head.draft_vocab = quarter()
    drafted, _ = committed_chains(head, records, None, 1, 4, Lockstep())
    assert plain and len(plain) == len(drafted)
    for a, b in zip(plain, drafted):
        assert torch.equal(a.topk_ids, b.topk_ids) and torch.equal(a.topk_logprobs, b.topk_logprobs)
    ids = torch.cat([c.topk_ids.flatten() for c in plain])
    assert head.draft_vocab.outside()[ids].any()  # not vacuous: the policy's top-k reaches outside the vocabulary
