"""The engine in bf16, as users run it (this CPU has AMX): records are stored with bf16 log-probs and must
validate under the mass bound bf16 rounding allows (`core.record_values.mass_tolerance`), rebuild every response
and agree with vLLM's own counters, exactly as in fp32."""

import pytest
import torch
from helpers.engines import K, close_engine, make_engine
from test_records_engine import assert_records_rebuild_responses
from vllm import SamplingParams

from openrlhf_growmtp.core import validate_record

from growmtp_lab.worlds.toy import random_prompts

TOPK = 64  # the default width, narrower than the toy's 128 words: the top-k mass is below one


@pytest.fixture(scope="module")
def bf16_rollout(world):
    engine = make_engine(world, dtype="bfloat16", topk=TOPK)
    prompts = random_prompts(8, 128, min_len=3, max_len=60, seed=11)
    params = [SamplingParams(temperature=(1.0, 1.3)[i % 2], max_tokens=40, ignore_eos=True) for i in range(8)]
    yield prompts, engine.generate(prompts, params)
    close_engine(engine)


def test_bf16_records_validate_rebuild_responses_and_match_vllms_counters(world, bf16_rollout):
    prompts, result = bf16_rollout
    assert result.metrics.acceptance.cycles > 0
    vocab = world["policy"].config.vocab_size
    for rec in result.records:
        assert rec.topk_logprobs.dtype == torch.bfloat16 and rec.topk_ids.shape[-1] == TOPK
        validate_record(rec, depth=K, vocab_size=vocab, topk=TOPK)
    assert_records_rebuild_responses(prompts, result)

