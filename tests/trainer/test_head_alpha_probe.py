"""The lag probe (`head_alpha_on`): the trainer's α of a head on records, measured without a gradient step."""

from __future__ import annotations

import pytest

from helpers.tiny import make_head, make_records
from openrlhf_growmtp.core import ONE_RANK, HeadLossConfig, head_loss_backward
from openrlhf_growmtp.trainer.head_step.head_update import HeadUpdateConfig, head_alpha_on, update_head


def _setup():
    head = make_head("qwen3")
    records = make_records(k=4)
    return head, records, [rec.hidden for rec in records]


@pytest.mark.parametrize("vgm", [True, False])
def test_probe_equals_the_training_paths_alpha_and_leaves_no_gradient(vgm):
    head, records, hiddens = _setup()
    cfg = HeadUpdateConfig(HeadLossConfig(vgm=vgm, chunk_cycles=3))
    probed = head_alpha_on(head, records, hiddens, cfg, ONE_RANK, prefix="a")
    assert all(p.grad is None for p in head.parameters())
    reference = head_loss_backward(head, records, hiddens, HeadLossConfig(vgm=vgm, chunk_cycles=None)).alpha_mean
    assert [probed[f"a_{k}"] for k in range(1, 5)] == pytest.approx(reference, abs=1e-6)


def test_probe_equals_update_heads_own_alpha_for_the_same_head():
    head, records, hiddens = _setup()
    cfg = HeadUpdateConfig(HeadLossConfig(chunk_cycles=4))
    probed = head_alpha_on(head, records, hiddens, cfg, ONE_RANK)
    metrics = update_head(head, records, hiddens, cfg, ONE_RANK).metrics()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in head.parameters())
    for k in range(1, 5):
        assert probed[f"lag_alpha_{k}"] == pytest.approx(metrics[f"head_alpha_{k}"], abs=1e-6)


def test_probe_refuses_teacher_forcing():
    head, records, hiddens = _setup()
    with pytest.raises(ValueError, match="teacher forcing"):
        head_alpha_on(head, records, hiddens, HeadUpdateConfig(HeadLossConfig(teacher_forcing=True)), ONE_RANK)
