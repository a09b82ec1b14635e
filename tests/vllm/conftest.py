"""Fixtures of the engine tests (helpers: `helpers.engines`): the toy world, and an exact-mode debug engine."""

import pytest

from helpers.engines import K, close_engine, core_head, make_engine
from openrlhf_growmtp.core.checkpoint import export_head, materialize_random_head
from growmtp_lab.worlds.toy import load_policy, make_policy, random_prompts, train_head_on_records


@pytest.fixture(scope="session")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("world")
    policy_dir = make_policy(root / "policy")
    head_dir = materialize_random_head(policy_dir, root / "head_random", seed=0)
    return {"root": root, "policy_dir": policy_dir, "head_dir": head_dir, "policy": load_policy(policy_dir)}


@pytest.fixture(scope="session")
def trained_head(world, tmp_path_factory):
    """A head trained on its own records (so τ is well above 1), exported with the depth it was trained at
    (as a run's export holds it: growmtp_head/ with growmtp_trained_k)."""
    from vllm import SamplingParams

    engine = make_engine(world)
    try:
        result = engine.generate(random_prompts(12, 128, seed=5), SamplingParams(temperature=1.0, max_tokens=32))
    finally:
        close_engine(engine)
    head = core_head(world)
    train_head_on_records(head, world["policy"], result.records, steps=30)
    head.config.growmtp_trained_k = K
    return export_head(head, tmp_path_factory.mktemp("head") / "growmtp_head")


@pytest.fixture(scope="module")
def engine(world):
    """Exact-mode debug engine: full-vocabulary top-k, fp32 log-probs, q rows and hidden states captured."""
    vocab = world["policy"].config.vocab_size
    eng = make_engine(world, topk=vocab, logprob_dtype="float32", capture_q=True, capture_hidden=True)
    yield eng
    close_engine(eng)
