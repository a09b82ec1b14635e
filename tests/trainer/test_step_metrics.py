"""What each RL step reports about the head update's α: the α gaps, like for like with the engine
(`trainer/head_update.py`), the top-k's mass, and the controller's warning about a top-k that holds too
little of the policy's mass (`trainer/ppo_trainer.py`)."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch

from helpers.tiny import make_head, make_records
from helpers.trainer import cpu_support  # noqa: F401  (the CPU layer before openrlhf is imported)
from openrlhf_growmtp.core import HeadLossConfig, Lockstep
from openrlhf_growmtp.core.objectives import acceptance_rates
from growmtp_lab.reference_drafting import chain_by_chain
from openrlhf_growmtp.trainer.head_step.head_update import HeadUpdateConfig, update_head
from openrlhf_growmtp.trainer.ppo_trainer import TRUSTED_TOPK_MASS, GrowMTPStepMetrics


@pytest.mark.parametrize("vgm", [True, False])
def test_the_alpha_gap_compares_the_head_and_the_engine_over_the_cycles_that_reached_k(vgm):
    # the records' accepted counts: 11 cycles of K = 4, with full accepts and early rejections
    head, records = make_head("qwen3"), make_records(k=4)
    metrics = update_head(head, records, [rec.hidden for rec in records],
                          HeadUpdateConfig(HeadLossConfig(vgm=vgm, chunk_cycles=3)), Lockstep()).metrics()
    cat = lambda name: torch.cat([getattr(rec, name) for rec in records])  # noqa: E731
    # the reference: each cycle drafted on its own, α from its full logits; the engine's counts by hand
    with torch.no_grad():
        alpha = acceptance_rates(chain_by_chain(head, records), cat("topk_ids"), cat("topk_logprobs"))
    accepted, positions = cat("accepted").long(), torch.arange(4)
    reached = positions[None, :] <= accepted[:, None]  # every earlier draft accepted
    passed = positions[None, :] < accepted[:, None]
    differ = 0
    for k in range(1, 5):
        rows = reached[:, k - 1]
        head_alpha, engine = float(alpha[rows, k - 1].mean()), float(passed[rows, k - 1].float().mean())
        # α in [0, 1] from fp32 logits, averaged over at most 11 cycles: batched and chain by chain agree to
        # a few ulps of 1; 1e-5 leaves room for the sums' order
        assert metrics[f"head_alpha_{k}"] == pytest.approx(head_alpha, abs=1e-5)
        assert metrics[f"alpha_gap_{k}"] == pytest.approx(head_alpha - engine, abs=1e-5)
        unconditional = float((accepted >= k).float().mean())  # growmtp/alpha_k, over every cycle
        differ += abs(unconditional - engine) > 0.1
    assert differ >= 2  # the case tells the two definitions apart at k >= 2
    # the top-k's mass over the pairs the loss reads: under VGM the reached ones, else all K
    mass = torch.logsumexp(cat("topk_logprobs").float(), dim=-1).exp()
    read = reached if vgm else torch.ones_like(reached)
    assert metrics["head_topk_mass"] == pytest.approx(float(mass[read].mean()), rel=1e-6)


def test_a_low_topk_mass_is_warned_about_once_naming_the_flag(tmp_path, caplog):
    metrics = GrowMTPStepMetrics()
    metrics.args = SimpleNamespace(growmtp=SimpleNamespace(topk=64))
    metrics._init_step_metrics(SimpleNamespace(ckpt=SimpleNamespace(path=str(tmp_path))))
    with caplog.at_level(logging.WARNING, logger="growmtp"):
        for mass in (None, TRUSTED_TOPK_MASS, 0.999):
            metrics._warn_topk_mass(mass)
        assert not caplog.records  # nothing to warn about
        for mass in (0.83, 0.85, 0.5):
            metrics._warn_topk_mass(mass)
    assert len(caplog.records) == 1
    assert "--growmtp_topk" in caplog.records[0].getMessage() and "0.830" in caplog.records[0].getMessage()


def test_a_resumed_run_sets_aside_the_rows_of_the_steps_it_logs_again(tmp_path):
    """Rows of steps after the checkpoint a run starts from (logged before a crash cut its save short), and a row
    cut short itself, move to the superseded file: the metrics file then holds each step once, nothing lost."""
    from openrlhf_growmtp.trainer.ppo_trainer import METRICS_FILE, SUPERSEDED_FILE, set_aside_rows_after

    path = tmp_path / METRICS_FILE
    path.write_text("".join(json.dumps({"step": s, "tau": s / 2}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "ta')
    assert set_aside_rows_after(path, 2) == 2
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    aside = (tmp_path / SUPERSEDED_FILE).read_text().splitlines()
    assert json.loads(aside[0]) == {"step": 3, "tau": 1.5} and aside[1] == '{"step": 4, "ta'
    assert set_aside_rows_after(path, 2) == 0 and set_aside_rows_after(tmp_path / "none.jsonl", 0) == 0
    assert set_aside_rows_after(path, 0) == 2  # a fresh start in a directory with an older run's rows
    assert path.read_text() == "" and len((tmp_path / SUPERSEDED_FILE).read_text().splitlines()) == 4
    # the evaluations' rows alike, beside their own file: a resumed run evaluates those steps again
    from openrlhf_growmtp.trainer.ppo_trainer import EVAL_METRICS_FILE

    evals = tmp_path / EVAL_METRICS_FILE
    evals.write_text("".join(json.dumps({"step": s, "eval_growmtp/tau": 2.0}) + "\n" for s in (5, 15)))
    assert set_aside_rows_after(evals, 10) == 1
    assert [json.loads(line)["step"] for line in evals.read_text().splitlines()] == [5]
    assert json.loads((tmp_path / "growmtp_eval_metrics.superseded.jsonl").read_text())["step"] == 15
    assert len((tmp_path / SUPERSEDED_FILE).read_text().splitlines()) == 4  # the steps' file untouched


def test_records_that_were_not_compared_with_vllms_counts_are_counted_and_warned_about(caplog):
    from openrlhf_growmtp.trainer.keys import RECORD_KEY, PackedRecord

    def sample(checked: int):
        return SimpleNamespace(info={RECORD_KEY: [PackedRecord(b"", [1, 0, 3], checked=bool(checked))]},
                               response_length=torch.tensor([7.0]))

    metrics = GrowMTPStepMetrics()
    metrics.args = SimpleNamespace(growmtp=SimpleNamespace(k=3))
    with caplog.at_level(logging.WARNING, logger="growmtp"):
        assert metrics._rollout_metrics([sample(1), sample(1)])["growmtp/records_checked"] == 2.0
        assert not caplog.records
        row = metrics._rollout_metrics([sample(1), sample(0), sample(0)])
    assert (row["growmtp/records"], row["growmtp/records_checked"]) == (3.0, 1.0)
    assert "2 of 3 records of this step were not compared with vLLM's per-request counts" in caplog.text
