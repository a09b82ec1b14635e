"""`update_head` called once per micro-batch (the trainer's path with mini-batches, epochs or dynamic
batching) against one call on every record: the same gradient and the same step metrics."""

from __future__ import annotations

import pytest
import torch

from helpers.tiny import make_head, make_records
from openrlhf_growmtp.core import HeadLossConfig, Lockstep
from openrlhf_growmtp.trainer.head_step.head_update import HeadUpdateTotals, HeadUpdateConfig, update_head
from openrlhf_growmtp.trainer.head_step.hidden_states import rows_per_sample

CFG = HeadUpdateConfig(HeadLossConfig(chunk_cycles=3))


def _grads(head) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in head.named_parameters() if p.grad is not None}
    head.zero_grad(set_to_none=True)
    return grads


# drafted at depth 1 of K = 4: committed chains train positions 2..4 (core/committed.py)
COMMITTED = HeadUpdateConfig(HeadLossConfig(chunk_cycles=3, max_depth=4))


def _call(head, records, cycles_per_step=None, cfg=CFG) -> HeadUpdateTotals:
    return update_head(head, records, [rec.hidden for rec in records], cfg, Lockstep(),
                       cycles_per_step=cycles_per_step)


@pytest.mark.parametrize("depth, cfg", [(4, CFG), (1, COMMITTED)])
def test_micro_batch_calls_add_up_to_one_call_over_every_record(depth, cfg):
    head, records = make_head("qwen3"), make_records(k=depth)
    whole = _call(head, records, cfg=cfg)
    reference = _grads(head)
    totals = HeadUpdateTotals()
    for part in ([records[0]], records[1:]):  # one optimizer step over two micro-batches
        totals.add(_call(head, part, cycles_per_step=whole.cycles, cfg=cfg))
    split = _grads(head)
    assert split.keys() == reference.keys() and len(reference) > 0
    # fp32 sums of the same per-cycle terms in another order: a few ulps of the largest gradient entry
    for name in reference:
        assert torch.allclose(split[name], reference[name], rtol=1e-5, atol=1e-7), name
    got, want = totals.metrics(), whole.metrics()
    assert got.keys() == want.keys()
    committed = {f"committed_alpha_{k}" for k in (2, 3, 4)} | {"head_committed_loss", "head_committed_chains"}
    assert committed <= want.keys() if depth == 1 else not any("committed" in key for key in want)
    for key in want:
        if key != "head_update_s":
            # a gap is a difference of two α in [0, 1], each agreeing to 1e-6 relative: 1e-6 absolute
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-6 if "gap" in key else 0), key


def test_cycles_per_step_divides_the_summed_loss():
    # two optimizer steps of the same records: each step's gradient is its summed loss over the mean per step
    head, records = make_head("qwen3"), make_records(k=4)
    cycles = _call(head, records).cycles
    mean = _grads(head)
    _call(head, records, cycles_per_step=2 * cycles)
    half = _grads(head)
    for name in mean:
        assert torch.allclose(half[name] * 2, mean[name], rtol=1e-6, atol=0), name


def test_a_non_finite_call_makes_the_totals_non_finite():
    totals = HeadUpdateTotals()
    totals.add(HeadUpdateTotals(k=2, cycles=3.0, loss_sum=1.5, alpha_sum=[1.0, 0.5], alpha_count=[3.0, 2.0]))
    totals.add(HeadUpdateTotals(k=2, cycles=2.0, loss_sum=float("nan"), finite=False, alpha_sum=[0.0, 0.0],
                              alpha_count=[0.0, 0.0]))
    metrics = totals.metrics()
    assert metrics["head_finite"] == 0.0 and metrics["head_cycles"] == 5.0
    assert metrics["head_loss"] != metrics["head_loss"]  # NaN: never a mean over the finite part only


def test_a_later_epochs_call_adds_its_time_and_finiteness_but_measures_nothing():
    totals = HeadUpdateTotals()
    totals.add(HeadUpdateTotals(k=1, cycles=4.0, loss_sum=2.0, alpha_sum=[2.0], alpha_count=[4.0], seconds=1.0))
    totals.add(HeadUpdateTotals(k=1, cycles=4.0, loss_sum=1.0, alpha_sum=[3.0], alpha_count=[4.0], seconds=0.5),
               first_visit=False)
    metrics = totals.metrics()
    assert metrics["head_cycles"] == 4.0 and metrics["head_loss"] == 0.5 and metrics["head_alpha_1"] == 0.5
    assert metrics["head_update_s"] == 1.5 and metrics["head_finite"] == 1.0
    totals.add(HeadUpdateTotals(finite=False), first_visit=False)
    assert totals.metrics()["head_finite"] == 0.0


def test_a_micro_batch_without_cycles_still_runs_one_zero_weight_backward():
    # every sample ended before its first cycle: the call still makes a padding chunk's head backward (under
    # optimizer offload DeepSpeed hands each parameter's gradient over at the window's last backward that
    # reaches it); one chunk on every rank, so its prefix goes back with it (core/prefix.py)
    from dataclasses import replace

    head = make_head("qwen3")
    # a prompt and one committed token, no cycle (vLLM finished the request at its first token)
    empty = [replace(rec, token_ids=rec.token_ids[:rec.prompt_len + 1], hidden=rec.hidden[:rec.prompt_len + 1],
                     start=rec.start[:0], drafts=rec.drafts[:0], topk_ids=rec.topk_ids[:0],
                     topk_logprobs=rec.topk_logprobs[:0], accepted=rec.accepted[:0]) for rec in make_records(k=4)]
    assert all(rec.num_cycles == 0 for rec in empty)
    losses = []
    lockstep = Lockstep(backward=lambda loss: (losses.append(loss), loss.backward()))
    totals = update_head(head, empty, [rec.hidden for rec in empty], CFG, lockstep,
                         cycles_per_step=0.0)  # an RL step without cycles
    assert len(losses) == 1 and float(losses[0]) == 0.0
    assert all(p.grad is None or not p.grad.any() for p in head.parameters())
    assert totals.cycles == 0 and totals.finite


def test_rows_per_sample_reads_padded_and_packed_forwards_alike():
    # a training forward's final hidden states, padded [B, T, H] or packed [1, sum T_i, H] (OpenRLHF's Actor
    # unpads the valid tokens row by row): each sample's valid rows, in order, either way
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0], [0, 1, 1, 0, 0]])
    padded = torch.randn(3, 5, 4)
    padded[~mask.bool()] = float("nan")  # padding must never be read
    expected = [padded[i, mask[i].bool()] for i in range(3)]
    for layout in (padded, padded[mask.bool()][None]):
        rows = rows_per_sample(layout, mask)
        assert [r.shape[0] for r in rows] == [3, 4, 2]
        assert all(torch.equal(r, e) for r, e in zip(rows, expected))
    with pytest.raises(ValueError, match="8 packed tokens for 9 valid tokens"):
        rows_per_sample(padded[mask.bool()][None, :8], mask)


def test_both_hidden_state_sources_answer_every_call_of_the_interface():
    from openrlhf_growmtp.trainer.head_step.hidden_states import HiddenStateSource, OwnForward, TrainingForward

    backbone = torch.nn.Linear(2, 2)
    assert isinstance(OwnForward(backbone, [], 1, grad=False, lockstep=Lockstep()), HiddenStateSource)
    assert isinstance(TrainingForward(backbone), HiddenStateSource)

    class WithoutTheSeam(TrainingForward):  # a source that lost a call no longer passes for one
        before_policy_backward = None

    assert not isinstance(WithoutTheSeam(backbone), HiddenStateSource)
