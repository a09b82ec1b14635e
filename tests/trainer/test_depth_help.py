"""`--growmtp_depth auto`'s help says the depths the controller chooses from: 1..K while the head trains (a head
at depth 0 has no records to learn from), 0..K for a frozen head."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from openrlhf_growmtp.trainer.args import add_growmtp_args
from openrlhf_growmtp.trainer.depth_controller import DepthController


def depth_help() -> str:
    parser = argparse.ArgumentParser()
    add_growmtp_args(parser)
    (action,) = [a for a in parser._actions if "--growmtp_depth" in a.option_strings]
    return " ".join(action.help.split())


@pytest.mark.parametrize("mode, lowest, said", [("detached", 1, "1..K for a training head"),
                                                ("joint", 1, "1..K for a training head"),
                                                ("frozen", 0, "0..K under --growmtp_mode frozen")])
def test_the_help_names_the_depths_the_controller_chooses_from(mode, lowest, said):
    args = SimpleNamespace(growmtp=SimpleNamespace(k=5, mode=mode, cycle_costs=None),
                           vllm=SimpleNamespace(max_num_seqs=None))
    rule = DepthController([], args).rule
    assert (rule.min_depth, rule.max_depth) == (lowest, 5)
    assert said in depth_help()
