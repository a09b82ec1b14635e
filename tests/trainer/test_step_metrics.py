"""What the controller adds to each RL step's metrics (`trainer/ppo_trainer.py`): the α gaps and the
warning about a top-k that holds too little of the policy's mass."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from helpers.trainer import cpu_support  # noqa: F401  (the CPU layer before openrlhf is imported)
from openrlhf_growmtp.trainer.ppo_trainer import TRUSTED_TOPK_MASS, GrowMTPStepMetrics, alpha_gaps


def test_the_gap_is_the_updates_alpha_minus_the_realised_one_where_both_were_logged():
    status = {"growmtp/head_alpha_1": 0.30, "growmtp/alpha_1": 0.25, "growmtp/head_alpha_2": 0.2,
              "growmtp/alpha_2": 0.1, "growmtp/head_alpha_3": 0.1, "growmtp/tau": 1.3}
    gaps = alpha_gaps(status)
    assert set(gaps) == {"growmtp/alpha_gap_1", "growmtp/alpha_gap_2"}  # no realised α_3 logged: no gap
    assert abs(gaps["growmtp/alpha_gap_1"] - 0.05) < 1e-12 and abs(gaps["growmtp/alpha_gap_2"] - 0.1) < 1e-12


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
