"""Evaluation kept apart from `--growmtp_depth auto` (`GrowMTPSamplesGenerator.generate_eval_samples`): its rollouts
neither ask the depth controller for a depth nor tell it their acceptance, its engine steps are dropped, and its
own acceptance is reported at the depth it drafted. The real run is the fault suite's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers.trainer import cpu_support  # noqa: F401  (the CPU layer before openrlhf is imported)

from openrlhf_growmtp.core.metrics import acceptance_summary
from openrlhf_growmtp.trainer import samples_generator
from openrlhf_growmtp.trainer.keys import RECORD_KEY, PackedRecord

EVALUATED = [[0, 1, 3, 2], [0, 0, 1]]  # accepted per cycle of each evaluation sample
TRAINED = [[3, 3, 2], [2, 3]]


class Controller:
    """What GrowMTPSamplesGenerator asks of the depth controller, recorded."""

    depth = 2

    def __init__(self):
        self.calls = []

    def before_rollout(self):
        self.calls.append("before_rollout")

    def after_rollout(self, experiences):
        self.calls.append(("after_rollout", [[r.accepted for r in e.info[RECORD_KEY]] for e in experiences]))

    def drop_engine_steps(self):
        self.calls.append("drop_engine_steps")


def test_evaluation_never_reaches_the_depth_controller_and_reports_its_own_acceptance(monkeypatch):
    def experiences(rows):
        return [SimpleNamespace(info={RECORD_KEY: [PackedRecord(b"", row)]}) for row in rows]

    served = {"eval": experiences(EVALUATED), "train": experiences(TRAINED)}
    monkeypatch.setattr(samples_generator.OrderedSamplesGenerator, "_generate_vllm",
                        lambda self, dataloader_iter, **kwargs: (served[next(dataloader_iter)], 1, True))
    generator = samples_generator.GrowMTPSamplesGenerator.__new__(samples_generator.GrowMTPSamplesGenerator)
    generator.args = SimpleNamespace(vllm=SimpleNamespace(enable_sleep=False), rollout=SimpleNamespace(batch_size=2),
                                     growmtp=SimpleNamespace(k=3))
    generator.eval_dataloader = ["eval"]
    generator.depth_controller = controller = Controller()

    assert generator.generate_eval_samples(temperature=0.6) == served["eval"]
    assert controller.calls == ["drop_engine_steps"]  # no depth asked for, no acceptance told; its steps dropped
    expected = acceptance_summary(torch.tensor(sum(EVALUATED, [])), 2)
    assert generator.eval_metrics == {**expected.as_dict("eval_growmtp/"), "eval_growmtp/depth": 2.0}
    assert generator.eval_metrics["eval_growmtp/tau"] == pytest.approx(1 + 7 / 7)  # 7 accepted over 7 cycles

    # a training rollout goes through the controller, with its own acceptance only
    generator._generate_vllm(iter(["train"]), num_prompts=2, dynamic_filtering=False)
    assert controller.calls[1:] == ["before_rollout", ("after_rollout", [[row] for row in TRAINED])]
