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


def prepared_actor(args, policy_dir, ours: bool = True):
    """(strategy, actor, optimizer, scheduler) as PolicyModelActor builds them: our strategy (the head attached
    where `args.growmtp.head_dir` names one) or upstream's, the tiny policy prepared by DeepSpeed on this rank."""
    from openrlhf.models import Actor
    from openrlhf.utils import get_strategy

    from openrlhf_growmtp.trainer import strategy as growmtp_strategy

    strategy = growmtp_strategy.get_strategy(args) if ours else get_strategy(args)
    strategy.setup_distributed()
    actor = Actor(str(policy_dir), attn_implementation="sdpa", param_dtype="bf16",
                  ds_config=strategy.get_ds_train_config(), packing_samples=args.ds.packing_samples)
    if args.actor.gradient_checkpointing_enable:  # where upstream enables it: after the Actor, before prepare
        actor.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": args.actor.gradient_checkpointing_reentrant})
    cfg = dict(optim="adam", muon=vars(args.actor.muon), adam=vars(args.actor.adam),
               lr_scheduler=args.actor.lr_scheduler, lr_warmup_ratio=args.actor.lr_warmup_ratio,
               min_lr_ratio=args.actor.min_lr_ratio, max_norm=args.actor.max_norm, scheduler_steps=10)
    actor, optimizer, scheduler = strategy.prepare((actor, cfg))
    return strategy, actor, optimizer, scheduler
