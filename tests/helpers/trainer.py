"""Helpers for the OpenRLHF integration tests: parsed arguments for a one-rank step, a free port."""

from __future__ import annotations

import socket

from openrlhf_growmtp import cpu_support

cpu_support.activate()  # before openrlhf.models is imported anywhere (flash_attn shim, torch.cuda no-ops)

from openrlhf_growmtp.trainer.args import parse_train_args  # noqa: E402

K, TOPK = 3, 8


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def train_args(policy_dir, tmp_path, *extra: str):
    """Hierarchized upstream args for a one-rank ZeRO-3 GRPO step on the tiny policy."""
    from openrlhf.utils.config import hierarchize

    ns = parse_train_args([
        "--actor.model_name_or_path", str(policy_dir), "--ds.zero_stage", "3", "--ds.attn_implementation", "sdpa",
        "--ds.param_dtype", "bf16", "--train.batch_size", "4", "--train.micro_batch_size", "2",
        "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "2", "--algo.advantage.estimator",
        "group_norm", "--algo.kl.init_coef", "0", "--actor.adam.lr", "1e-3", "--actor.lr_warmup_ratio", "0",
        "--vllm.num_engines", "1",
        "--ckpt.path", str(tmp_path / "ckpt"), "--train.seed", "1", *extra])
    args = hierarchize(ns)
    # what upstream's __main__ fills in after parsing (parse_train_args stops before it)
    args.actor.eps_clip_low_high = (args.actor.eps_clip, args.actor.eps_clip)
    args.algo.advantage.is_correction_threshold.insert(0, 0.0)
    return args
