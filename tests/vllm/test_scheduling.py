"""Records stay exact when the scheduler reuses cached prefixes, preempts requests, or skips the drafter near
max_model_len."""

from helpers.engines import close_engine, core_head, make_engine
from test_records_engine import assert_records_rebuild_responses, engine_q_vs_reconstruction
from vllm import SamplingParams

from growmtp_lab.worlds.toy import random_prompts

PARAMS = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)


def test_prefix_cache_hits_keep_records_exact(world):
    """Transport-free mode: cached prefix positions are never recomputed, yet q is reconstructed exactly."""
    engine = make_engine(world, capture_q=True, enable_prefix_caching=True, block_size=32)
    try:
        prompts = random_prompts(4, 128, min_len=150, max_len=300, seed=21)
        engine.generate(prompts, PARAMS)
        result = engine.generate(prompts, PARAMS)  # same prompts: full prefix blocks come from the cache
        assert result.metrics.vllm_counters["prefix_cache_hits"] > 0
        assert_records_rebuild_responses(prompts, result)
        assert engine_q_vs_reconstruction(core_head(world), world["policy"], result, exact=False).max() <= 1e-4
    finally:
        close_engine(engine)


def test_preemption_keeps_records_exact(world):
    """A KV cache too small for the batch forces preemption and recompute mid-generation."""
    engine = make_engine(world, capture_q=True, capture_hidden=True, block_size=32, num_gpu_blocks_override=12,
                         max_model_len=256)
    try:
        prompts = random_prompts(8, 128, min_len=20, max_len=60, seed=22)
        result = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=120, ignore_eos=True))
        preemptions = result.metrics.vllm_counters["num_preemptions"]
        assert preemptions > 0
        # each recompute samples one token without drafting, so the next cycle starts one later
        assert_records_rebuild_responses(prompts, result, steps_without_drafts=preemptions)
        # exact mode falls back to transport-free records after a preemption (engine hidden rows dropped)
        assert all(rec.hidden is None for rec in result.records)
        per_depth = engine_q_vs_reconstruction(core_head(world), world["policy"], result, exact=False)
        assert per_depth.max() <= 1e-4, per_depth
    finally:
        close_engine(engine)


def test_requests_that_reach_max_model_len_keep_the_rollout_and_count_dropped_cycles(world):
    """Near max_model_len vLLM drafts without q for the whole batch and trims drafts: those cycles are
    dropped (counted), every other cycle is recorded exactly, and the rollout goes on."""
    length = 64
    engine = make_engine(world, capture_q=True, max_model_len=length)
    try:
        prompts = random_prompts(4, 128, min_len=20, max_len=30, seed=5)
        params = [SamplingParams(temperature=1.0, max_tokens=length - len(p), ignore_eos=True) for p in prompts]
        result = engine.generate(prompts, params)
        assert [len(p) + len(o.outputs[0].token_ids) for p, o in zip(prompts, result.outputs)] == [length] * 4
        metrics = result.metrics
        assert metrics.dropped_cycles > 0 and metrics.acceptance.cycles > 0
        assert metrics.vllm_counters["spec_decode_num_drafts"] == metrics.acceptance.cycles + metrics.dropped_cycles
        assert engine_q_vs_reconstruction(core_head(world), world["policy"], result, exact=False).max() <= 1e-4
    finally:
        close_engine(engine)


def test_a_request_that_goes_on_after_another_reached_max_model_len_keeps_exact_records(world):
    """While one request is within K of max_model_len vLLM skips the drafter for the whole batch (no draft forward,
    so the draft model's cache gets no entries for the positions committed then). The shorter request that goes on
    drafting after the long one ends drafts from a cache with holes: its cycles after the skip are dropped, and
    every cycle kept is the trainer's reconstruction, from the engine's hidden states (exact mode) or the policy's."""
    length = 64
    # exact mode with fp32 hidden rows (bf16 ones, the default, round q by ~5e-4)
    engine = make_engine(world, capture_q=True, capture_hidden=True, logprob_dtype="float32", max_model_len=length)
    try:
        long = random_prompts(1, 128, min_len=30, max_len=30, seed=7)[0]
        short = random_prompts(1, 128, min_len=5, max_len=5, seed=8)[0]
        # the long request reaches max_model_len (its last K steps skip the drafter); the short one ends at 50
        params = [SamplingParams(temperature=1.0, max_tokens=length - len(long), ignore_eos=True),
                  SamplingParams(temperature=1.0, max_tokens=45, ignore_eos=True)]
        result = engine.generate([long, short], params)
        metrics = result.metrics
        assert metrics.dropped_cycles > 0
        assert metrics.vllm_counters["spec_decode_num_drafts"] == metrics.acceptance.cycles + metrics.dropped_cycles
        assert all(rec.hidden is not None and rec.num_cycles > 0 for rec in result.records)
        for exact in (True, False):
            per_depth = engine_q_vs_reconstruction(core_head(world), world["policy"], result, exact=exact)
            assert per_depth.max() <= 1e-4, (exact, per_depth)
    finally:
        close_engine(engine)


def test_rollout_engines_get_headroom_for_k_drafts_within_the_models_limit(world):
    from vllm_patches.settings import with_draft_headroom

    limit = world["policy"].config.max_position_embeddings
    kwargs = {"model": str(world["policy_dir"]), "max_model_len": 512}
    assert with_draft_headroom(kwargs, 3)["max_model_len"] == 518  # a request's last step + the drafter's K
    assert with_draft_headroom({**kwargs, "max_model_len": limit - 2}, 3)["max_model_len"] == limit
    assert with_draft_headroom({**kwargs, "max_model_len": limit + 8}, 3)["max_model_len"] == limit + 8
