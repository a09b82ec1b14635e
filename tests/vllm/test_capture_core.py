"""The capture core from plain verification steps, without an engine or a model runner.

Every expected payload below is written out by hand from the steps' numbers: which cycles a drain keeps,
in which order, and which it drops.
"""

import math
import subprocess
import sys

import pytest
import torch

from vllm_patches.capture import core
from vllm_patches.capture.core import VerifyStep
from vllm_patches.settings import CaptureConfig

K, WIDTH = 2, 2  # drafts per cycle, recorded top-k width


@pytest.fixture
def state():
    """This process's capture state, replaced for the test and put back after (an engine may share it)."""
    saved, core.STATE = core.STATE, core.CaptureState()
    core.configure(CaptureConfig(enabled=True, topk=WIDTH))
    yield core.STATE
    core.STATE = saved


def step(rows, has_q=True, q=None):
    """A VerifyStep from rows (request id, start, drafts, accepted); a draft d's recorded top-k ids are
    [10 d, 10 d + 1], with log-probs [-d / 100, -1 - d / 100]."""
    drafts = [d for _, _, ds, _ in rows for d in ds]
    return VerifyStep(req_ids=[r[0] for r in rows], start=torch.tensor([r[1] for r in rows]),
                      num_drafts=[len(r[2]) for r in rows], accepted=torch.tensor([r[3] for r in rows]),
                      drafts=torch.tensor(drafts, dtype=torch.int32),
                      topk_ids=torch.tensor([[10 * d, 10 * d + 1] for d in drafts], dtype=torch.int32),
                      topk_logprobs=torch.tensor([[-d / 100, -1 - d / 100] for d in drafts]),
                      has_q=has_q, q=q, depth=K)


def test_drain_groups_kept_cycles_by_request_in_step_order_and_drops_the_rest(state):
    core.record_step(step([("a-1", 4, [10, 11], 1), ("b-2", 7, [20, 21], 0), ("c-3", 2, [], 0)]))
    core.record_step(step([("b-2", 8, [22], 1), ("a-1", 6, [12, 13], 2)]))  # b's drafts trimmed to 1
    core.record_step(step([("a-1", 9, [14, 15], 0)], has_q=False))  # drafted without q
    core.record_step(step([("b-2", 10, [23, 24], 2)]))
    payload = core.drain(as_blob=False)
    assert payload["errors"] == []
    assert payload["req_ids"] == ["a-1", "b-2"]  # c-3 had no drafts: no cycle, nothing dropped
    assert payload["counts"].tolist() == [2, 2]
    assert payload["start"].tolist() == [4, 6, 7, 10]
    assert payload["drafts"].tolist() == [[10, 11], [12, 13], [20, 21], [23, 24]]
    assert payload["accepted"].tolist() == [1, 2, 0, 2]
    assert payload["topk_ids"].tolist() == [[[100, 101], [110, 111]], [[120, 121], [130, 131]],
                                            [[200, 201], [210, 211]], [[230, 231], [240, 241]]]
    assert payload["topk_logprobs"][2].flatten().tolist() == pytest.approx([-0.20, -1.20, -0.21, -1.21])
    assert {r: [t.tolist() for t in v] for r, v in payload["dropped"].items()} == {"b-2": [[8], [1]],
                                                                                  "a-1": [[9], [0]]}
    assert payload["hidden"] == {} and "q" not in payload
    assert state.steps == [] and core.drain(as_blob=False)["req_ids"] == []  # a drain empties the state


def test_q_rows_follow_their_cycles_and_a_step_without_q_leaves_none(state):
    v = 3
    q1 = torch.arange(4 * v, dtype=torch.float32).reshape(4, v)  # rows 0..3 of step 1
    q2 = 100 + torch.arange(2 * v, dtype=torch.float32).reshape(2, v)
    core.record_step(step([("x", 1, [5, 6], 0), ("y", 3, [7, 8], 1)], q=q1))
    core.record_step(step([("x", 5, [1, 2], 0)], has_q=False))
    core.record_step(step([("y", 6, [3, 4], 2)], q=q2))
    payload = core.drain(as_blob=False)
    assert payload["req_ids"] == ["x", "y"] and payload["counts"].tolist() == [1, 2]
    assert payload["q"].shape == (3, K, v)
    assert payload["q"][0].tolist() == [[0, 1, 2], [3, 4, 5]]  # x's only kept cycle
    assert payload["q"][1].tolist() == [[6, 7, 8], [9, 10, 11]]  # y, step 1
    assert payload["q"][2].tolist() == [[100, 101, 102], [103, 104, 105]]  # y, step 3


def test_a_step_whose_positions_do_not_match_its_drafts_is_an_error_not_a_cycle(state):
    bad = step([("a", 4, [10, 11], 1), ("b", 7, [20, 21], 0)])
    bad.num_drafts = [2, 1]  # the rows claim 3 drafts; 4 positions were verified
    core.record_step(bad)
    core.record_step(step([("a", 6, [12, 13], 2)]))
    payload = core.drain(as_blob=False)
    assert payload["errors"] == ["a verification step verified 4 draft positions, but its requests drafted 3"]
    assert payload["req_ids"] == ["a"] and payload["start"].tolist() == [6]


def test_a_skipped_drafter_drops_every_later_cycle_of_its_batch_and_no_earlier_one(state):
    core.record_step(step([("a", 4, [10, 11], 2), ("b", 7, [20, 21], 1)]))
    core.mark_drafter_skipped(["a", "b"])  # step 1 skipped the drafter: a and b are stale
    core.record_step(step([("a", 7, [12, 13], 0), ("b", 9, [22, 23], 1)], has_q=False))  # the zeros
    first = core.drain(as_blob=False)
    core.record_step(step([("a", 8, [14, 15], 1), ("c", 3, [30, 31], 2)]))  # c joined after the skip
    second = core.drain(as_blob=False)  # a request stays stale across drains
    assert first["req_ids"] == ["a", "b"] and first["start"].tolist() == [4, 7]  # step 1's cycles: before it
    assert {r: [t.tolist() for t in v] for r, v in first["dropped"].items()} == {"a": [[7], [0]], "b": [[9], [1]]}
    assert second["req_ids"] == ["c"] and second["start"].tolist() == [3]
    assert {r: [t.tolist() for t in v] for r, v in second["dropped"].items()} == {"a": [[8], [1]]}
    core.configure(CaptureConfig(enabled=True, topk=WIDTH))  # a new engine's capture: no request is stale
    core.record_step(step([("a", 10, [16, 17], 0)]))
    assert core.drain(as_blob=False)["req_ids"] == ["a"]


def test_hidden_rows_keep_each_requests_committed_positions_across_calls(state):
    hidden = torch.arange(10, dtype=torch.float32).reshape(5, 2)  # 5 tokens, H = 2
    # request r0 owns rows 0..2 and samples from row 1 (row 2 held a rejected draft); r1 owns rows 3..4
    core.record_hidden(["r0", "r1"], torch.tensor([0, 3, 5]), torch.tensor([1, 4]),
                       torch.tensor([5, 6, 7, 3, 4]), hidden)
    core.record_hidden(["r0"], torch.tensor([0, 1]), torch.tensor([0]), torch.tensor([7]), hidden[4:5] + 100)
    payload = core.drain(as_blob=False)
    positions, rows = payload["hidden"]["r0"]
    assert positions.tolist() == [5, 6, 7] and rows.tolist() == [[0, 1], [2, 3], [108, 109]]
    positions, rows = payload["hidden"]["r1"]
    assert positions.tolist() == [3, 4] and rows.tolist() == [[6, 7], [8, 9]]


@pytest.mark.parametrize("capture_q", [False, True])
def test_read_verification_keeps_the_top_k_of_p_as_private_copies(state, capture_q):
    core.configure(CaptureConfig(enabled=True, topk=2, logprob_dtype="float32", capture_q=capture_q))
    # p = (0.1, 0.2, 0.3, 0.4) and (0.4, 0.3, 0.2, 0.1): logits log p + 5 (softmax ignores the shift)
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]])
    logits = p.log() + 5
    q = torch.full((2, 4), 0.25)
    seen = core.read_verification(logits, q)
    logits.zero_()
    q.zero_()  # the runner reuses its buffers: what was read must not change
    order = seen["topk_logprobs"].argsort(dim=-1, descending=True)
    assert seen["topk_ids"].gather(1, order).tolist() == [[3, 2], [0, 1]]
    # fp32 log-softmax of values near 1: a few ulps of 1, far below 1e-6
    assert seen["topk_logprobs"].gather(1, order).flatten().tolist() == pytest.approx(
        [math.log(0.4), math.log(0.3)] * 2, abs=1e-6)
    assert seen["topk_ids"].dtype == torch.int32 and seen["has_q"]
    assert (seen["q"].tolist() == [[0.25] * 4] * 2) if capture_q else seen["q"] is None
    assert core.read_verification(p.log(), None)["has_q"] is False


def test_log_probs_are_kept_in_the_configured_dtype(state):
    core.configure(CaptureConfig(enabled=True, topk=1, logprob_dtype="bfloat16"))
    seen = core.read_verification(torch.tensor([[0.0, math.log(3.0)]]), None)  # p = (1/4, 3/4)
    assert seen["topk_logprobs"].dtype == torch.bfloat16 and seen["topk_ids"].tolist() == [[1]]
    # bf16 keeps 8 significant bits: in [1/4, 1/2), where log(3/4) = -0.2877 lies, an ulp is 2^-9 and
    # rounding stays within half of it
    assert abs(float(seen["topk_logprobs"]) - math.log(0.75)) <= 2 ** -10


def test_v1_accepted_counts_are_the_valid_sampled_tokens_minus_one():
    from vllm_patches.capture.v1 import PLACEHOLDER_TOKEN_ID as P
    from vllm_patches.capture.v1 import accepted_counts

    sampled = torch.tensor([[5, 6, P], [7, P, P], [1, 2, 3]])  # 1 accepted + recovered; 0 + recovered; 2 + bonus
    assert accepted_counts(sampled).tolist() == [1, 0, 2]


def test_the_core_imports_no_model_runner():
    code = ("import sys, vllm_patches.capture.core; "
            "print(sorted(m for m in sys.modules if m.startswith(('vllm.v1.worker', 'vllm.v1.sample', "
            "'vllm.v1.spec_decode'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"
