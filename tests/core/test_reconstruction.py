"""Batched draft-path reconstruction equals chain-by-chain drafting: values, gradients, chunking, mask."""

import pytest
import torch

from helpers.ranks import TwoRanks, module_calls
from helpers.tiny import FAMILY_NAMES, make_head, make_records, synthetic_record
from openrlhf_growmtp.core import HeadLossConfig, Lockstep, reconstruct_draft_logits, validate_record
from openrlhf_growmtp.core.head_loss import head_loss_backward
from openrlhf_growmtp.core.objectives import chain_lengths, head_loss_per_cycle
from openrlhf_growmtp.core.prefix import PrefixStore
from openrlhf_growmtp.core.reconstruction import plan_chunks, reconstruct_states
from openrlhf_growmtp.core.records import RecordError
from openrlhf_growmtp.core.teacher_forcing import teacher_forced_chains, teacher_forcing_layout
from growmtp_lab.reference_drafting import chain_by_chain


def update(head, records, hiddens=None, lockstep=None, **cfg):
    """One head update (head_loss_backward) with these HeadLossConfig fields."""
    return head_loss_backward(head, records, hiddens, HeadLossConfig(**cfg), lockstep or Lockstep())


def _grads(head):
    return {name: p.grad.detach().clone() for name, p in head.named_parameters() if p.grad is not None}


def _zero(head):
    for p in head.parameters():
        p.grad = None


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_batched_reconstruction_equals_chain_by_chain(family):
    head = make_head(family)
    records = make_records(k=4)
    with torch.no_grad():
        batched = reconstruct_draft_logits(head, records, chunk_cycles=5)  # chunks cut through sequences
        reference = chain_by_chain(head, records)
    assert batched.shape == reference.shape == (sum(r.num_cycles for r in records), 4, 97)
    diff = (batched.log_softmax(-1) - reference.log_softmax(-1)).abs().max().item()
    assert diff <= 1e-5, diff
    # the comparison is not vacuous: positions differ from each other and q is far from uniform
    assert (reference[:, 0] - reference[:, 1]).abs().max() > 1e-2
    assert reference.softmax(-1).max() > 5.0 / 97


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_head_gradients_equal_chain_by_chain(family):
    head = make_head(family)
    records = make_records(k=4)
    topk_ids = torch.cat([r.topk_ids for r in records])
    topk_lp = torch.cat([r.topk_logprobs for r in records])
    accepted = torch.cat([r.accepted for r in records])
    loss, _ = head_loss_per_cycle(chain_by_chain(head, records), topk_ids, topk_lp, accepted, "dca")
    loss.mean().backward()
    reference = _grads(head)
    _zero(head)
    stats = update(head, records, objective="dca", chunk_cycles=1024)
    assert stats.finite and stats.num_chunks == 1
    batched = _grads(head)
    assert set(batched) == set(reference) and len(batched) == len(list(head.parameters()))
    for name in reference:
        scale = reference[name].abs().max().item()
        assert scale > 0, name
        assert (batched[name] - reference[name]).abs().max().item() <= 1e-5 * max(1.0, scale), name
    assert abs(stats.loss - loss.mean().item()) <= 1e-5


@pytest.mark.parametrize("objective", ["dca", "tv", "kl", "ce"])
def test_chunked_gradients_equal_unchunked(objective):
    head = make_head("qwen3")
    records = make_records(k=4)
    whole = update(head, records, objective=objective, chunk_cycles=10_000)
    reference = _grads(head)
    _zero(head)
    chunked = update(head, records, objective=objective, chunk_cycles=3)
    assert chunked.num_chunks == 4 and whole.num_chunks == 1
    assert abs(chunked.loss - whole.loss) <= 1e-6 * max(1.0, abs(whole.loss))
    assert chunked.alpha_mean == pytest.approx(whole.alpha_mean, abs=1e-6)
    for name, grad in _grads(head).items():
        assert (grad - reference[name]).abs().max().item() <= 1e-6 * max(1.0, reference[name].abs().max().item())


@pytest.mark.parametrize("chunk_cycles", [3, 1024])
def test_gradients_are_exact_under_a_scaling_backward_and_reach_hidden_states_with_a_graph(chunk_cycles):
    # Chunks read each prefix's keys and values as leaves and one closing backward per sequence
    # backpropagates them (prefix.py); a trainer's backward scales what it is given (DeepSpeed divides by
    # the accumulation steps), and joint mode's hidden states carry a graph: both reach the reference.
    head = make_head("qwen3")
    records = make_records(k=4)
    for rec in records:
        rec.hidden = rec.hidden.clone().requires_grad_()
    loss, _ = head_loss_per_cycle(chain_by_chain(head, records), torch.cat([r.topk_ids for r in records]),
                                  torch.cat([r.topk_logprobs for r in records]),
                                  torch.cat([r.accepted for r in records]), "dca")
    loss.mean().backward()
    reference = _grads(head)
    reference.update({f"hidden{i}": rec.hidden.grad for i, rec in enumerate(records)})
    _zero(head)
    hiddens = [rec.hidden.detach().clone().requires_grad_() for rec in records]
    stats = update(head, records, hiddens, Lockstep(backward=lambda surrogate: (surrogate * 3.0).backward()),
                   chunk_cycles=chunk_cycles)
    assert stats.num_chunks == (4 if chunk_cycles == 3 else 1)
    got = _grads(head)
    got.update({f"hidden{i}": h.grad for i, h in enumerate(hiddens)})
    assert set(got) == set(reference)
    for name, want in reference.items():
        scale = want.abs().max().item()
        assert scale > 0, name
        assert (got[name] / 3.0 - want).abs().max().item() <= 1e-5 * max(1.0, scale), name


def test_plan_chunks_covers_every_cycle_once_in_order():
    records = make_records(k=3)
    chunks = plan_chunks(records, 4)
    flat = [(pc.seq, r) for pieces in chunks for pc in pieces for r in range(pc.lo, pc.hi)]
    assert flat == [(s, r) for s, rec in enumerate(records) for r in range(rec.num_cycles)]
    assert all(sum(pc.hi - pc.lo for pc in pieces) <= 4 for pieces in chunks)
    with pytest.raises(ValueError, match="chunk_cycles"):
        plan_chunks(records, 0)


def test_mask_blocks_attention_across_draft_paths():
    head = make_head("qwen3")
    records = make_records(k=4)
    with torch.no_grad():
        before = reconstruct_draft_logits(head, records)
        records[0].drafts[1, :] = (records[0].drafts[1, :] + 5) % 97  # cycle 1 rejected everything: legal
        records[0].accepted[1] = 0
        validate_record(records[0])
        after = reconstruct_draft_logits(head, records)
    changed = (after - before).abs().amax(dim=(1, 2))
    assert changed[1] > 1e-3  # its own deeper positions moved
    assert changed[torch.arange(len(changed)) != 1].max() == 0.0  # no other chain saw those drafts
    assert (after[1, 0] - before[1, 0]).abs().max() == 0.0  # position 1 reads only the committed prefix


def test_teacher_forcing_agrees_with_reconstruction_only_at_draft_position_one():
    head = make_head("qwen3")
    rec = make_records(k=4)[2]  # cycles with full accepts: every cycle start has a target at position 1
    with torch.no_grad():
        recon = reconstruct_draft_logits(head, [rec])
        tf = teacher_forced_chains(head, rec, rec.hidden)
        tf_logits = head.logits(tf.normed).float() / tf.temperature[:, None, None]
    starts = rec.start.tolist()
    tf_starts = tf.starts.tolist()
    rows = [tf_starts.index(s) for s in starts]
    assert (tf_logits[rows, 0] - recon[:, 0]).abs().max() <= 1e-5
    # cycle 0 accepted all K drafts, so both paths feed the same tokens; only the caches differ at positions >= 2
    assert torch.equal(rec.drafts[0], rec.token_ids[starts[0] + 2:starts[0] + 2 + rec.depth])
    assert (tf_logits[rows[0], 1:] - recon[0, 1:]).abs().max() > 1e-3
    # targets: position 1 of the chain at s is verified by row 1 of the cycle starting at s
    assert torch.equal(tf.topk_ids[rows, 0], rec.topk_ids[:, 0])
    # and position k <= accepted + 1 by its row k: token s + 1 + k, which no later cycle verifies (the next one
    # starts at s + accepted + 1 and verifies tokens from s + accepted + 3 on)
    deeper = 0
    for r, row in enumerate(rows):
        reach = min(int(rec.accepted[r]) + 1, rec.depth)
        assert int(tf.lengths[row]) >= reach
        assert torch.equal(tf.topk_ids[row, :reach].long(), rec.topk_ids[r, :reach].long())
        assert torch.equal(tf.topk_logprobs[row, :reach].float(), rec.topk_logprobs[r, :reach].float())
        deeper += reach - 1
    assert deeper > 0  # positions >= 2 were checked


def test_teacher_forcing_trains_through_the_head_update():
    head = make_head("qwen3")
    records = make_records(k=3)
    stats = update(head, records, objective="dca", teacher_forcing=True)
    assert stats.finite and stats.num_cycles > sum(r.num_cycles for r in records)  # every position is a start
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in head.parameters())


def test_nonfinite_head_loss_is_reported_and_not_backpropagated():
    head = make_head("qwen3")
    with torch.no_grad():
        head.fc.weight[0, 0] = float("nan")
    stats = update(head, make_records(k=3), chunk_cycles=100)
    assert not stats.finite
    assert all(p.grad is None for p in head.parameters())


def test_transport_free_records_need_hidden_from_the_trainer():
    head = make_head("qwen3")
    records = make_records(k=3)
    hiddens = [r.hidden for r in records]
    for r in records:
        r.hidden = None
    with pytest.raises(RecordError, match="hidden"):
        reconstruct_draft_logits(head, records)
    with torch.no_grad():
        assert reconstruct_draft_logits(head, records, hiddens=hiddens).isfinite().all()


def test_a_malformed_record_fails_before_any_model_work_naming_record_and_field():
    head = make_head("qwen3")
    records = make_records(k=4)
    records[2].drafts[0, 0] = 97  # out of the head's vocabulary
    with pytest.raises(RecordError, match=r"^record 2: drafts:"):
        update(head, records)
    assert all(p.grad is None for p in head.parameters())
    mixed = make_records(k=4)[:2] + make_records(k=3)[2:]
    with pytest.raises(RecordError, match=r"^record 2: drafts: K = 3"):
        update(head, mixed)


def test_vgm_builds_only_the_positions_up_to_the_first_rejection_with_unchanged_states():
    head = make_head("qwen3")
    records = make_records(k=4)
    pieces = plan_chunks(records, None)[0]
    accepted = torch.cat([r.accepted for r in records])
    lengths = chain_lengths(accepted, len(accepted), 4)
    with torch.no_grad():
        prefix = PrefixStore(head, records)
        prefix.open([pc.seq for pc in pieces])
        full = reconstruct_states(head, records, pieces, prefix)
        pruned = reconstruct_states(head, records, pieces, prefix, lengths=lengths)
    assert full.normed.shape[0] == 4 * len(accepted)
    assert pruned.normed.shape[0] == int(lengths.sum()) < full.normed.shape[0]
    assert torch.equal(torch.bincount(pruned.cycle, minlength=len(accepted)), lengths)
    # a pruned chain's neighbours are masked out of every other chain, so dropping them changes nothing
    # beyond rounding: the same fp32 layer over differently shaped batches, a few ulps of |normed| <= ~5
    index = {(int(c), int(p)): m for m, (c, p) in enumerate(zip(full.cycle, full.position))}
    rows = torch.tensor([index[(int(c), int(p))] for c, p in zip(pruned.cycle, pruned.position)])
    assert (pruned.normed - full.normed[rows]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("vgm", [True, False])
def test_alpha_statistics_average_each_position_over_the_cycles_that_reached_it(vgm):
    # with or without VGM: the cycles whose earlier drafts were all accepted, where the engine's own
    # acceptance at that position is known (accepted_count counts those it accepted)
    head = make_head("qwen3")
    records = make_records(k=4)
    accepted = torch.cat([r.accepted for r in records])
    with torch.no_grad():
        _, alpha = head_loss_per_cycle(chain_by_chain(head, records), torch.cat([r.topk_ids for r in records]),
                                       torch.cat([r.topk_logprobs for r in records]), accepted, "dca")
    reached = torch.arange(4)[None, :] < chain_lengths(accepted, len(accepted), 4)[:, None]
    expected = (alpha * reached).sum(0) / reached.sum(0)
    stats = update(head, records, objective="dca", vgm=vgm, chunk_cycles=5)
    assert stats.alpha_count == reached.sum(0).float().tolist()
    assert stats.accepted_count == [float((accepted >= k).sum()) for k in range(1, 5)]
    assert stats.alpha_mean == pytest.approx(expected.tolist(), abs=1e-5)


@pytest.mark.parametrize("objective", ["dca", "kl"])
@pytest.mark.parametrize("chunk_cycles", [None, 12])
def test_teacher_forced_loss_and_gradients_equal_the_full_vocabulary_path(objective, chunk_cycles):
    # The reference runs each sequence alone with full-vocabulary logits; the update runs the sequences
    # side by side (right-padded, of different lengths and temperatures), in one group or in several.
    head = make_head("qwen3")
    records = make_records(k=3)
    batches = [teacher_forced_chains(head, rec, rec.hidden) for rec in records]
    total = sum(int(b.starts.shape[0]) for b in batches if b is not None)
    reference = 0.0
    for b in batches:
        if b is not None:
            logits = head.logits(b.normed).float() / b.temperature[:, None, None]
            loss, _ = head_loss_per_cycle(logits, b.topk_ids, b.topk_logprobs, b.lengths - 1, objective)
            reference = reference + loss.sum() / total
    reference.backward()
    expected = _grads(head)
    _zero(head)
    stats = update(head, records, objective=objective, teacher_forcing=True, chunk_cycles=chunk_cycles)
    assert stats.num_chunks == len(teacher_forcing_layout(records, chunk_cycles).chunks)
    assert stats.num_chunks == (1 if chunk_cycles is None else 2)  # 12 chains: the sequences do not fit in one
    assert abs(stats.loss - reference.item()) <= 1e-5 * max(1.0, abs(reference.item()))
    for name, grad in _grads(head).items():
        scale = expected[name].abs().max().item()
        assert scale > 0, name
        assert (grad - expected[name]).abs().max().item() <= 1e-5 * max(1.0, scale), name


def _module_calls(head, records, lockstep=None, **cfg):
    """Forward calls per module (the backward's recomputations included) during one head update."""
    return module_calls(head, lambda: update(head, records, lockstep=lockstep, **cfg))


def test_every_rank_makes_the_same_module_calls_whatever_its_records(monkeypatch):
    # Under ZeRO-3 each call of a partitioned module gathers its parameters, a collective: ranks whose
    # records differ (cycle counts, accepted lengths) must still call every module the same number of times.
    from openrlhf_growmtp.core import topk_logq

    # two slots' logits per group: 14 groups for 27 slots
    monkeypatch.setattr(topk_logq, "GROUP_LOGITS", {"cpu": 2 * 97, "cuda": 2 * 97})
    mixed = make_records(k=4)  # full accepts and early rejections
    rejected = make_records(k=4, seed=5)[1:2]  # two cycles, both rejected at once: no chain reaches position 2
    assert int(rejected[0].accepted.max()) == 0
    for objective in ("dca", "kl"):
        mode = dict(objective=objective, chunk_cycles=64)
        assert _module_calls(make_head("qwen3"), mixed, **mode) != _module_calls(make_head("qwen3"), rejected, **mode)
        first, second = TwoRanks.run(lambda lockstep, recs: _module_calls(make_head("qwen3"), recs, lockstep, **mode),
                                     mixed, rejected)
        assert first == second and first["lm_head"] > 2 * 3, (first, second)


def test_a_rank_with_fewer_chunks_runs_padding_chunks_that_change_no_gradient():
    # one rank has 4 chunks, the other 1: the second pads with 3 zero-weighted padding chunks
    busy, idle = make_records(k=4), make_records(k=4, seed=5)[1:2]
    assert len(plan_chunks(busy, 3)) == 4 and len(plan_chunks(idle, 3)) == 1
    _assert_padding_changes_nothing(busy, idle, objective="dca", chunk_cycles=3)


def _assert_padding_changes_nothing(busy, idle, **mode):
    """On two ranks (busy's, idle's) every rank makes the same module calls, and the idle rank's gradients
    equal those of idle's records updated alone: its padding changes no gradient."""
    alone = make_head("qwen3")
    update(alone, idle, **mode)
    heads = [make_head("qwen3"), make_head("qwen3")]
    first, second = TwoRanks.run(lambda lockstep, recs: _module_calls(heads[recs is idle], recs, lockstep, **mode),
                                 busy, idle)
    assert first == second
    for (name, want), (_, got) in zip(alone.named_parameters(), heads[1].named_parameters()):
        assert (got.grad - want.grad).abs().max().item() <= 1e-6 * max(1.0, want.grad.abs().max().item()), name


def test_scored_groups_are_whole_cycles_with_about_equal_slots():
    from openrlhf_growmtp.core.topk_logq import group_bounds

    slots = [3, 1, 4, 2, 1, 1, 1, 4, 4, 2, 4]  # per cycle, as VGM's chain lengths at K=4
    cycle = torch.repeat_interleave(torch.arange(len(slots)), torch.tensor(slots))
    for groups in (1, 2, 3, 5, 11, 27, 40):
        bounds = group_bounds(cycle, len(slots), groups)
        assert len(bounds) == groups + 1 and bounds[0] == 0 and bounds[-1] == len(slots)
        assert bounds == sorted(bounds)
        sizes = [sum(slots[lo:hi]) for lo, hi in zip(bounds, bounds[1:])]
        # a group ends at the last whole cycle within its share: at most a share plus one cycle's slots
        assert max(sizes) <= -(-sum(slots) // groups) + max(slots) - 1, (groups, sizes)


@pytest.mark.parametrize("busy_chunks", [1, 2])
def test_ranks_run_as_many_prefix_pieces_as_the_busiest_rank(busy_chunks):
    # A prefix opens (and, unless every rank runs one chunk, closes) in pieces of at most chunk_cycles x K
    # positions (prefix.py): a long prompt takes several, a short one one; padded to the busiest rank's
    # count, every rank makes the same calls, and the padding changes no gradient.

    long = [synthetic_record(prompt_len=60, accepted=[1, 4, 0, 0, 2][:4 * busy_chunks - 3], depth=4,
                             topk=8, vocab_size=97, hidden_size=64, seed=3)]
    short = make_records(k=4, seed=5)[1:2]  # prompt of 3, two cycles
    assert len(plan_chunks(long, 4)) == busy_chunks and len(plan_chunks(short, 4)) == 1
    mode = dict(chunk_cycles=4)
    assert _module_calls(make_head("qwen3"), long, **mode) != _module_calls(make_head("qwen3"), short, **mode)
    _assert_padding_changes_nothing(long, short, **mode)


@pytest.mark.parametrize("objective", ["dca", "kl"])
def test_gradients_are_exact_when_the_slots_are_scored_in_many_groups_and_blocks(objective, monkeypatch):
    from openrlhf_growmtp.core import topk_logq

    head = make_head("qwen3")
    records = make_records(k=4)
    stats = update(head, records, objective=objective, chunk_cycles=64)
    reference = _grads(head)
    _zero(head)
    # one slot's logits per group: 27 groups for 27 slots in 11 cycles, so most groups are padding;
    # and the softmax's passes in blocks of one row
    monkeypatch.setattr(topk_logq, "GROUP_LOGITS", {"cpu": 97, "cuda": 97})
    monkeypatch.setattr(topk_logq, "SOFTMAX_BLOCK", {"cpu": 97, "cuda": 97})
    grouped = update(head, records, objective=objective, chunk_cycles=64)
    assert abs(grouped.loss - stats.loss) <= 1e-6 * max(1.0, abs(stats.loss))
    assert grouped.alpha_mean == pytest.approx(stats.alpha_mean, abs=1e-6)
    for name, grad in _grads(head).items():
        assert (grad - reference[name]).abs().max().item() <= 1e-6 * max(1.0, reference[name].abs().max().item())


def test_the_default_chunk_is_the_devices():
    from openrlhf_growmtp.core.reconstruction import CHUNK_CYCLES, DEFAULT_CHUNK_CYCLES, chunk_cycles_for

    assert chunk_cycles_for("cpu") == DEFAULT_CHUNK_CYCLES == CHUNK_CYCLES["cpu"]
    assert chunk_cycles_for(torch.device("cuda", 3)) == CHUNK_CYCLES["cuda"] > CHUNK_CYCLES["cpu"]
    assert chunk_cycles_for("xpu") == CHUNK_CYCLES["cuda"]  # another accelerator is launch-bound alike


def test_the_head_gradients_rows_are_added_as_index_add_adds_them(monkeypatch):
    # add_rows_ (index_put_ with accumulate: CUDA's one kernel in both modes) against index_add_, which the
    # update used before. With 27 groups for 27 slots most groups are padding, whose row is another group's
    # real slot: the same row is added to in several calls. Exactly equal: each call adds one term per row.
    from openrlhf_growmtp.core import head_loss, topk_logq

    monkeypatch.setattr(topk_logq, "GROUP_LOGITS", {"cpu": 97, "cuda": 97})
    records = make_records(k=4)
    grads = {}
    for name, add in (("index_put", head_loss.add_rows_),
                      ("index_add", lambda dest, rows, values: dest.index_add_(0, rows, values))):
        monkeypatch.setattr(head_loss, "add_rows_", add)
        head = make_head("qwen3")
        update(head, records, chunk_cycles=64)
        grads[name] = _grads(head)
    assert grads["index_put"].keys() == grads["index_add"].keys() and grads["index_put"]
    for name, grad in grads["index_put"].items():
        assert torch.equal(grad, grads["index_add"][name]), name
    # within one call, rows repeated: summed as index_add_ sums them. dest and the values are multiples of 1/8
    # below 64 in size, so every partial sum is exact in fp32 and the order of the adds cannot show
    g = torch.Generator().manual_seed(0)
    rows = torch.tensor([3, 0, 3, 5, 3, 0])
    values = torch.randint(-512, 512, (6, 7), generator=g).float() / 8
    dest = torch.randint(-512, 512, (6, 7), generator=g).float() / 8  # so is every sum onto dest
    assert torch.equal(head_loss.add_rows_(dest.clone(), rows, values), dest.clone().index_add_(0, rows, values))
    # a row out of range: an error naming it (RuntimeError on CPU, IndexError from CUDA's host-side check)
    with pytest.raises((IndexError, RuntimeError), match="index 6 is out of bounds for dimension 0 with size 6"):
        head_loss.add_rows_(dest.clone(), torch.tensor([6]), values[:1])
