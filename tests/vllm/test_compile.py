"""The head compiles like vLLM's own draft heads (`@support_torch_compile`): an engine without enforce_eager
compiles the target and the head, and the compiled head's q is still what the trainer reconstructs."""

from helpers.engines import close_engine, core_head, make_engine
from test_records_engine import assert_records_rebuild_responses, engine_q_vs_reconstruction
from vllm import SamplingParams
from vllm.compilation.counter import compilation_counter

from growmtp_lab.worlds.toy import random_prompts


def compiled_models() -> int:
    """Models vLLM compiled so far in this process, fresh or loaded from its compile cache."""
    return compilation_counter.num_aot_compiles + compilation_counter.num_aot_artifacts_loaded


def test_compiled_head_q_equals_the_reconstruction(world):
    before = compiled_models()
    engine = make_engine(world, capture_q=True, enforce_eager=False)
    try:
        assert compiled_models() - before == 2  # the target and the head (eager heads add nothing)
        prompts = random_prompts(8, 128, min_len=3, max_len=60, seed=13)
        result = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True))
        assert_records_rebuild_responses(prompts, result)
        # fp32 on both sides, as in the eager engine tests: same bound
        assert engine_q_vs_reconstruction(core_head(world), world["policy"], result, exact=False).max() <= 1e-4
    finally:
        close_engine(engine)
