"""The head's param group inside DeepSpeed's ZeRO-3 optimizer, next to the policy's (deepspeed 0.19.6).

The head is a submodule of the model DeepSpeed wraps, so ZeRO-3 partitions and reduces it with the
policy; these functions keep it from touching the policy's update:
- gradient-norm clipping per group (the policy's clip norm is exactly upstream's),
- a gradient buffer that every accumulation window starts from zero (the head backpropagates first
  in each micro-batch),
- a skipped head step (non-finite head loss) that leaves the head's parameters as they are.
The DeepSpeed internals used here are listed in `installer.CONTRACT` and checked at start-up.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

HEAD_GROUP = "growmtp_head"  # the optimizer param group's name


class HeadGroupError(RuntimeError):
    """The optimizer is not the ZeRO-3 optimizer with a head group that these functions expect."""

def _zero3_optimizer(engine):
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    optimizer = engine.optimizer
    if not isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        raise HeadGroupError(f"GrowMTP head training needs the ZeRO-3 optimizer, found {type(optimizer)}")
    return optimizer


def head_group_index(optimizer) -> int:
    names = [group.get("name") for group in optimizer.param_groups]
    if HEAD_GROUP not in names:
        raise HeadGroupError(f"no {HEAD_GROUP!r} param group in the optimizer (groups: {names})")
    return names.index(HEAD_GROUP)


def attach_head_optimizer(engine, scheduler, lr_multiplier: Callable[[int], float]) -> None:
    """Give the head group its own LR schedule and keep its gradients out of the policy's clipping.

    DeepSpeed clips with one norm over all groups; here the policy's sub-groups are clipped with the
    norm of the policy's gradients alone (exactly upstream's, since the head group contributes zero to it)
    and the head's sub-groups with the head's own norm.
    """
    optimizer = _zero3_optimizer(engine)
    group = head_group_index(optimizer)
    head_subgroups = {sub for sub, grp in optimizer.sub_group_to_group_id.items() if grp == group}

    norms = {}
    original_norms = optimizer._get_norm_groups
    original_clip = optimizer.unscale_and_clip_grads

    def norm_groups_without_head():
        per_subgroup = original_norms()
        head = [n for sub, n in enumerate(per_subgroup) if sub in head_subgroups]
        norms["head"] = torch.linalg.vector_norm(torch.stack(head)) if head else None
        return [torch.zeros_like(n) if sub in head_subgroups else n for sub, n in enumerate(per_subgroup)]

    def clip_per_group(sub_group_id, total_norm):
        if sub_group_id in head_subgroups:
            total_norm = norms["head"]
        return original_clip(sub_group_id, total_norm)

    optimizer._get_norm_groups = norm_groups_without_head
    optimizer.unscale_and_clip_grads = clip_per_group

    # LambdaLR keeps one multiplier per group; the head's replaces upstream's for its group only.
    scheduler.lr_lambdas[group] = lr_multiplier
    base = scheduler.base_lrs[group]
    optimizer.param_groups[group]["lr"] = base * lr_multiplier(scheduler.last_epoch)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


def open_head_window(engine) -> bool:
    """Before a micro-batch's head backwards; True when they open a new accumulation window.

    First closes the previous backward as a micro-step, as the engine's own forward would (the head runs no
    engine forward). ZeRO-3 then copies (instead of adding) gradients while `micro_step_id` is 0, the
    window's first backward, and leaves stale values in the buffer for parameters that backward does not
    reach; so a window the head's backwards open starts from a zeroed buffer, and every later backward
    in it (head or policy) adds onto zeros.
    """
    optimizer = _zero3_optimizer(engine)
    optimizer.clear_backward_seen_flag()
    if optimizer.micro_step_id != 0:
        return False
    optimizer.grad_partitions_flat_buffer.zero_()
    return True


def head_backward(engine) -> Callable[[torch.Tensor], None]:
    """DeepSpeed's engine backward for one head chunk, after closing the previous backward as a micro-step
    (the next backward accumulates instead of overwriting; the policy's next forward closes this one)."""
    optimizer = _zero3_optimizer(engine)

    def backward(loss: torch.Tensor) -> None:
        optimizer.clear_backward_seen_flag()
        engine.backward(loss)

    return backward


@contextlib.contextmanager
def head_step_skipped(engine, scheduler):
    """Optimizer steps inside run with the head group's LR at zero: head parameters stay as they are.

    The scheduler's own step (inside engine.step) still sets the next LR; it is kept when it ran.
    """
    optimizer = _zero3_optimizer(engine)
    index = head_group_index(optimizer)
    group, lr, epoch = optimizer.param_groups[index], optimizer.param_groups[index]["lr"], scheduler.last_epoch
    group["lr"] = 0.0
    try:
        yield
    finally:
        if scheduler.last_epoch == epoch:
            group["lr"] = lr


def head_optimizer_state(engine) -> dict[str, torch.Tensor]:
    """This rank's partition of the head group's Adam moments (for checkpoint tests)."""
    optimizer = _zero3_optimizer(engine)
    group = head_group_index(optimizer)
    out = {}
    for sub, grp in sorted(optimizer.sub_group_to_group_id.items()):
        if grp != group:
            continue
        state = optimizer.optimizer.state[optimizer.fp32_partitioned_groups_flat[sub]]
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{sub}.{key}"] = state[key].detach().cpu().clone()
    return out
