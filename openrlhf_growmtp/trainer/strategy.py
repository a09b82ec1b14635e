"""GrowMTP's strategy: upstream's DeepSpeed strategy plus the draft head (upstream: utils/deepspeed).

The head becomes a submodule (`mtp_head`) of the policy's HF model when the strategy prepares the
actor for training, right before DeepSpeed wraps it: ZeRO-3 then partitions it with the rest of the
model, and it gets its own optimizer param group and LR schedule. Attaching it there, and not when the
Actor is built, also keeps upstream's `gradient_checkpointing_enable` (called between the two) from
reaching the head's decoder layer: a checkpointed layer drops the KV cache the head's prefix pass fills.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Callable

import deepspeed
import torch
import torch.distributed as dist
from openrlhf.models import Actor
from openrlhf.utils.deepspeed import DeepspeedStrategy
from openrlhf.utils.distributed_util import torch_dist_barrier_and_cuda_sync

from ..core.checkpoint import HEAD_CONFIG, export_head, load_head, read_head_config
from ..core.schedule import HeadLRSchedule
from ..core.whole_dir import written_whole
from .args import policy_steps_per_rl_step, resolve_head_lr
from .head_step.deepspeed_patches import HEAD_GROUP
from .head_step.head_optimizer import HeadLR, HeadOptimizer, attach_head_optimizer

HEAD_ATTR = "mtp_head"  # the head's name inside the HF model DeepSpeed wraps
HEAD_EXPORT_DIR = "growmtp_head"  # next to an HF export


def head_of(hf_model):
    return getattr(hf_model, HEAD_ATTR, None)


@contextlib.contextmanager
def without_head(hf_model):
    """Hide the head from module traversal (HF export, upstream's weight broadcast) for the duration."""
    head = hf_model._modules.pop(HEAD_ATTR, None)
    try:
        yield head
    finally:
        if head is not None:
            hf_model._modules[HEAD_ATTR] = head


def gathered_head_state(head) -> dict[str, torch.Tensor] | None:
    """Core-named head parameters, gathered from ZeRO-3 partitions; on rank 0 only (None elsewhere)."""
    params = dict(head.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        if dist.get_rank() != 0:
            return None
        return {name: p.detach().float().cpu().clone() for name, p in params.items()}


def trained_head_dir(args) -> str | None:
    """The head directory the trainer starts its head from; None when the trainer holds no head
    (GrowMTP off, or a frozen head that only drafts in the engines)."""
    g = getattr(args, "growmtp", None)
    if g is None or not g.k or g.mode == "frozen":
        return None
    return g.head_dir


class GrowMTPStrategy(DeepspeedStrategy):
    """Upstream's strategy plus the head: attached before DeepSpeed wraps the actor, its own param group
    and LR schedule, an HF export without it (the head goes to its own directory), and a seam between the
    policy's forward and its backward (`before_policy_backward`). `head_optimizer`: the head group's
    run-time owner, once the actor's optimizer is built."""

    _before_policy_backward: Callable[[], None] | None = None
    head_optimizer: HeadOptimizer | None = None

    @contextlib.contextmanager
    def before_policy_backward(self, hook: Callable[[], None]):
        """While open, `hook()` runs before every backward of the policy. Upstream's training step computes
        its loss and backpropagates it in one method; its strategy's `backward` is the one call between."""
        self._before_policy_backward = hook
        try:
            yield
        finally:
            self._before_policy_backward = None

    def backward(self, loss, model, _optimizer, **kwargs):
        if self._before_policy_backward is not None and isinstance(model, Actor):
            self._before_policy_backward()
        return super().backward(loss, model, _optimizer, **kwargs)

    def _ds_init_train_model(self, model, cfg):
        head_dir = trained_head_dir(self.args)
        if isinstance(model, Actor) and head_dir is not None and head_of(model.model) is None:
            _attach_head(model.model, head_dir)
        wrapped, optimizer, scheduler = super()._ds_init_train_model(model, cfg)
        engine = wrapped.model if isinstance(wrapped, Actor) else wrapped
        if head_of(engine.module) is not None:
            multiplier = head_lr_multiplier(self.args, cfg["scheduler_steps"])
            self.head_optimizer = attach_head_optimizer(engine, scheduler, multiplier)
        return wrapped, optimizer, scheduler

    def _get_model_parameters(self, model, *, optim=None, weight_decay=0.0):
        raw_model, groups = super()._get_model_parameters(model, optim=optim, weight_decay=weight_decay)
        head = head_of(raw_model)
        if head is None:
            return raw_model, groups
        if (optim or self.optim) == "muon":
            raise ValueError("GrowMTP's head group needs the Adam path; --actor.optim muon is not supported")
        head_ids = {id(p) for p in head.parameters()}
        for group in groups:
            group["params"] = [p for p in group["params"] if id(p) not in head_ids]
        groups = [group for group in groups if group["params"]]
        groups.append({"params": list(head.parameters()), "weight_decay": 0.0,
                       "lr": resolve_head_lr(vars(self.args.growmtp)), "name": HEAD_GROUP})
        return raw_model, groups

    def save_ckpt(self, model, save_dir, tag=None, *args, save_latest=True, **kwargs):
        """Upstream's DeepSpeed checkpoint; with a head, `latest` is left to the policy actor, which names the tag
        only once the head snapshot is beside it (`resume.publish_latest`)."""
        held = head_of(model.module) is not None
        return super().save_ckpt(model, save_dir, tag, *args, save_latest=save_latest and not held, **kwargs)

    def save_model(self, model, tokenizer, output_dir, **kwargs) -> None:
        """Upstream's HF export without the head, plus the head as a standalone directory the engine loads,
        written whole (`core.whole_dir`): both into a temporary sibling of output_dir, a manifest of every file
        (written last, it ties the head to its policy), then renamed over the older export. A write that fails,
        a full disk's included, leaves the older export as it was."""
        hf_model = self._unwrap_model(model)
        g = getattr(self.args, "growmtp", None)
        with written_whole(output_dir, write=self.is_rank_0()) as staging:  # rank 0 writes; the others gather
            with without_head(hf_model) as head:
                super().save_model(model, tokenizer, str(staging), **kwargs)
            if head is not None:
                params = list(head.parameters())
                with deepspeed.zero.GatheredParameters(params):
                    if self.is_rank_0():
                        head.config.growmtp_trained_k = g.k  # the evaluation CLI's default depth
                        export_head(head, staging / HEAD_EXPORT_DIR)
            elif g is not None and g.k and g.mode == "frozen" and self.is_rank_0():
                # a frozen head drafted unchanged all run: the export carries it, as a trained run's does
                _export_frozen_head(g.head_dir, staging / HEAD_EXPORT_DIR, g.k)
        torch_dist_barrier_and_cuda_sync()


def head_lr_multiplier(args, policy_steps: int) -> HeadLR:
    """The head's LR schedule over the run (`policy_steps`: upstream's scheduler steps, the policy's optimizer
    steps): per RL step under `--growmtp_head_update rl_step`; per policy step otherwise, where
    --growmtp_head_warmup_steps (in RL steps) spans that many policy steps per RL step."""
    g, a = args.growmtp, args
    peak = resolve_head_lr(vars(g))
    per_rl_step = max(1, policy_steps_per_rl_step(a.rollout.batch_size, a.rollout.n_samples_per_prompt,
                                                  a.train.batch_size, a.train.max_epochs))
    if g.head_update == "rl_step":
        schedule = HeadLRSchedule(total_steps=max(1, int(policy_steps) // per_rl_step),
                                  warmup_steps=g.head_warmup_steps, min_lr_ratio=g.head_min_lr_ratio)
        return HeadLR(schedule, per_rl_step=True, peak_lr=peak)
    schedule = HeadLRSchedule(total_steps=max(1, int(policy_steps)), warmup_steps=g.head_warmup_steps * per_rl_step,
                              min_lr_ratio=g.head_min_lr_ratio)
    return HeadLR(schedule, per_rl_step=False, peak_lr=peak)


def _export_frozen_head(head_dir: str, out_dir: Path, k: int) -> None:
    read_head_config(head_dir)  # a head directory, or a clear error
    shutil.copytree(head_dir, out_dir, dirs_exist_ok=True)
    config = out_dir / HEAD_CONFIG
    config.write_text(json.dumps({**json.loads(config.read_text()), "growmtp_trained_k": k}, indent=2,
                                 sort_keys=True) + "\n")


def _attach_head(hf_model, head_dir: str) -> None:
    """Build the head from `head_dir` on the backbone's own embedding and lm_head (never copies)."""
    dtype = next(hf_model.parameters()).dtype
    # NOTE: building the head's layers draws from torch's global RNG, which upstream's data order
    # depends on (the replay-buffer shuffle); without fork_rng, detached runs drift from upstream's.
    with torch.random.fork_rng(devices=[]):
        head = load_head(head_dir, hf_model.get_input_embeddings(), hf_model.get_output_embeddings(), dtype=dtype)
    hf_model.add_module(HEAD_ATTR, head)


def get_strategy(args):
    """Upstream's `get_strategy`, returning our subclass (it adds methods only, no state)."""
    from openrlhf.utils.utils import get_strategy as upstream_get_strategy

    strategy = upstream_get_strategy(args)
    strategy.__class__ = GrowMTPStrategy
    return strategy
