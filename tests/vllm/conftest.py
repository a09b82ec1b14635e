"""Fixtures of the engine tests (helpers: `helpers.engines`): the toy world, and an exact-mode debug engine."""

import pytest

from helpers.engines import close_engine, make_engine
from openrlhf_growmtp.core.checkpoint import materialize_random_head
from openrlhf_growmtp.toy_world import load_policy, make_policy


@pytest.fixture(scope="session")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("world")
    policy_dir = make_policy(root / "policy")
    head_dir = materialize_random_head(policy_dir, root / "head_random", seed=0)
    return {"root": root, "policy_dir": policy_dir, "head_dir": head_dir, "policy": load_policy(policy_dir)}


@pytest.fixture(scope="module")
def engine(world):
    """Exact-mode debug engine: full-vocabulary top-k, fp32 log-probs, q rows and hidden states captured."""
    vocab = world["policy"].config.vocab_size
    eng = make_engine(world, topk=vocab, logprob_dtype="float32", capture_q=True, capture_hidden=True)
    yield eng
    close_engine(eng)
