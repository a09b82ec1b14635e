"""The drafting depth set while the engine runs (`vllm_patches/engine_depth.py`, `--growmtp_depth auto`):
at every depth the records rebuild the responses, agree with vLLM's own counters and with the core's
reconstruction of q; the engine's step times and cycle costs; what is refused."""

import pytest
import torch
from helpers.engines import K, close_engine, core_head, make_engine
from test_records_engine import assert_records_rebuild_responses, engine_q_vs_reconstruction
from vllm import SamplingParams

from openrlhf_growmtp.core import measure_head_loss
from growmtp_lab.worlds.toy import random_prompts

DEPTHS = (K, 1, 0, 2)  # down, to none, and back up: each set between generates, never rebuilt


@pytest.fixture(scope="module")
def dynamic(world):
    vocab = world["policy"].config.vocab_size
    engine = make_engine(world, topk=vocab, logprob_dtype="float32", capture_q=True, capture_hidden=True,
                         dynamic_depth=True, max_num_seqs=4)
    yield engine
    close_engine(engine)


@pytest.fixture(scope="module")
def rollouts(dynamic):
    prompts = random_prompts(6, 128, min_len=3, max_len=40, seed=11)
    params = SamplingParams(temperature=1.0, max_tokens=29, ignore_eos=True)
    out = {}
    dynamic.step_times()
    for depth in DEPTHS:
        dynamic.set_depth(depth)
        out[depth] = (prompts, dynamic.generate(prompts, params), dynamic.step_times())
    return out


@pytest.mark.parametrize("depth", DEPTHS)
def test_records_at_each_depth_rebuild_responses_and_match_vllm_counters(rollouts, depth):
    prompts, result, _ = rollouts[depth]
    assert all(rec.depth == depth and rec.drafts.shape[1] == depth for rec in result.records)
    assert len(result.metrics.acceptance.alpha) == depth
    if depth:
        assert result.metrics.acceptance.cycles > 0
        assert_records_rebuild_responses(prompts, result, depth=depth)
    else:  # no drafts: every token decoded, no cycle recorded, and the records still hold the responses
        assert result.metrics.acceptance.cycles == 0
        assert result.metrics.vllm_counters.get("spec_decode_num_drafts", 0) == 0
        for prompt, output, rec in zip(prompts, result.outputs, result.records):
            assert rec.num_cycles == 0 and rec.token_ids.tolist() == prompt + list(output.outputs[0].token_ids)


@pytest.mark.parametrize("depth", [d for d in DEPTHS if d])
def test_engine_q_equals_reconstruction_at_each_depth(world, rollouts, depth):
    _, result, _ = rollouts[depth]
    per_depth = engine_q_vs_reconstruction(core_head(world), world["policy"], result, exact=True)
    assert per_depth.shape == (depth,) and per_depth.max().item() <= 1e-4, per_depth


def test_the_head_loss_reads_the_depth_each_record_was_drafted_at(world, rollouts):
    """One head, records of depth 1 and of depth K: the loss's per-position counts cover the depth drafted,
    over the cycles that reached each position (VGM), as the records count them."""
    head = core_head(world)
    for depth in (1, K):
        _, result, _ = rollouts[depth]
        stats = measure_head_loss(head, result.records)
        accepted = torch.cat([rec.accepted for rec in result.records])
        assert stats.finite and len(stats.alpha_count) == depth
        reached = [int((accepted >= j - 1).sum()) for j in range(1, depth + 1)]
        assert stats.alpha_count == pytest.approx(reached)
        assert stats.accepted_count == pytest.approx([int((accepted >= j).sum()) for j in range(1, depth + 1)])


def test_step_times_are_the_clean_steps_of_the_depth_drafted(rollouts):
    for depth in DEPTHS:
        _, _, steps = rollouts[depth]
        assert steps, depth
        assert all(d == depth and 1 <= requests <= 4 and seconds > 0 for d, requests, seconds in steps)
        # 6 requests of 29 tokens at up to 4 at once: most steps are clean (no prefill in them)
        assert len(steps) >= 29 // (depth + 1) // 2


def test_cycle_costs_cover_every_depth_and_leave_the_depth(dynamic):
    dynamic.set_depth(2)
    costs = dynamic.cycle_costs(requests=4)
    assert len(costs.seconds) == K + 1 and all(s > 0 for s in costs.seconds)
    assert dynamic.depth == 2 and dynamic.capture
    prompts = random_prompts(2, 128, seed=12)
    result = dynamic.generate(prompts, SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True))
    assert all(rec.depth == 2 for rec in result.records)  # capture back on, at the depth it had


def test_a_depth_outside_the_engines_range_or_on_a_fixed_engine_is_refused(world, dynamic):
    with pytest.raises(ValueError, match=rf"depth must be an int in 0..{K}"):
        dynamic.set_depth(K + 1)
    fixed = make_engine(world)
    try:
        with pytest.raises(RuntimeError, match="dynamic_depth=True"):
            fixed.set_depth(1)
        assert fixed.depth == K
    finally:
        close_engine(fixed)


def test_one_calibration_procedure_runs_on_a_sync_engine_and_an_async_one():
    # SpecEngine (vLLM's LLM) calls the engine directly, the rollout actor (AsyncLLM) awaits it: both run
    # Calibration.measure, so both warm up first, drop the warm-up's steps and time every depth of the plan
    import asyncio

    from vllm_patches.engine_depth import awaitable, calibration, run_now

    plan = calibration(3, 128, requests=2)

    class Engine:  # the steps a generate at depth d leaves: 2 requests, d + 1 seconds a step
        def __init__(self):
            self.calls, self.depth, self.pending = [], None, []

        def generate(self):
            self.calls.append(("generate", self.depth))
            self.pending += [(self.depth if self.depth is not None else 9, 2, 1.0 + (self.depth or 0))] * 3

        def set_depth(self, depth):
            self.calls.append(("depth", depth))
            self.depth = depth

        def step_times(self):
            steps, self.pending = self.pending, []
            return steps

    def suspending(fn):  # a call that yields to the event loop first, as AsyncLLM's calls do
        async def call(*args):
            await asyncio.sleep(0)
            return fn(*args)
        return call

    sync = Engine()
    costs = run_now(plan.measure(awaitable(sync.generate), awaitable(sync.set_depth), awaitable(sync.step_times)))
    asynchronous = Engine()
    async_costs = asyncio.run(plan.measure(suspending(asynchronous.generate), suspending(asynchronous.set_depth),
                                           suspending(asynchronous.step_times)))
    assert sync.calls == asynchronous.calls == [("generate", None)] + [
        call for d in plan.depths for call in (("depth", d), ("generate", d))]
    # the warm-up's steps (marked depth 9) are dropped: the line through depths 0, 1 and 3 gives depth 2 exactly
    assert costs.seconds == async_costs.seconds == (1.0, 2.0, 3.0, 4.0)
    with pytest.raises(RuntimeError, match="event loop"):
        run_now(plan.measure(suspending(sync.generate), awaitable(sync.set_depth), awaitable(sync.step_times)))
