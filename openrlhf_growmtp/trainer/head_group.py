"""The head's param group inside DeepSpeed's ZeRO-2 or ZeRO-3 optimizer, next to the policy's (deepspeed 0.19.6).

The head is a submodule of the model DeepSpeed wraps, so ZeRO partitions and reduces it with the policy;
these functions keep it from touching the policy's update:
- gradient-norm clipping per group (the policy's clip norm is exactly upstream's),
- accumulation windows that the head's backwards may open (they run before each micro-batch's policy
  forward, so they close the previous backward as the engine's forward would, and ZeRO-3's buffer is
  zeroed where they open a window),
- a skipped head step (non-finite head loss) that leaves the head's parameters as they are.
ZeRO-2 (`DeepSpeedZeroOptimizer`, `partition_gradients`) and ZeRO-3 (`DeepSpeedZeroOptimizer_Stage3`)
differ in where gradients accumulate and how norms are grouped; each function handles both. The
DeepSpeed internals used here are listed in `installer.CONTRACT` and checked at start-up.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

HEAD_GROUP = "growmtp_head"  # the optimizer param group's name
_WINDOW_ATTR = "_growmtp_head_window"  # on the engine: its global step when the head's backwards last ran


class HeadGroupError(RuntimeError):
    """The optimizer is not a ZeRO-2/3 optimizer with the head group that these functions expect."""


def _zero_optimizer(engine):
    """The engine's ZeRO optimizer and its stage (2 or 3)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    optimizer = engine.optimizer
    if isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        return optimizer, 3
    if isinstance(optimizer, DeepSpeedZeroOptimizer) and optimizer.partition_gradients:
        return optimizer, 2
    raise HeadGroupError(f"GrowMTP head training needs DeepSpeed's ZeRO-2 or ZeRO-3 optimizer, found {type(optimizer)}")


def head_group_index(optimizer) -> int:
    names = [group.get("name") for group in optimizer.param_groups]
    if HEAD_GROUP not in names:
        raise HeadGroupError(f"no {HEAD_GROUP!r} param group in the optimizer (groups: {names})")
    return names.index(HEAD_GROUP)


def attach_head_optimizer(engine, scheduler, lr_multiplier: Callable[[int], float]) -> None:
    """Give the head group its own LR schedule and keep its gradients out of the policy's clipping.

    DeepSpeed clips with one norm over all groups; here the policy's groups are clipped with the norm of
    the policy's gradients alone (exactly upstream's) and the head's with the head's own norm.
    """
    optimizer, stage = _zero_optimizer(engine)
    group = head_group_index(optimizer)
    (_clip_per_group_zero3 if stage == 3 else _clip_per_group_zero2)(optimizer, group)
    # LambdaLR keeps one multiplier per group; the head's replaces upstream's for its group only.
    scheduler.lr_lambdas[group] = lr_multiplier
    base = scheduler.base_lrs[group]
    optimizer.param_groups[group]["lr"] = base * lr_multiplier(scheduler.last_epoch)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


def _clip_per_group_zero3(optimizer, group: int) -> None:
    # ZeRO-3 computes one norm per sub-group and clips sub-group by sub-group: the head's sub-groups count
    # zero towards the policy's norm (which is then upstream's) and are clipped with their own.
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


def _clip_per_group_zero2(optimizer, group: int) -> None:
    # ZeRO-2 computes the global norm in one call over `bit16_groups` and clips each group's flat fp32
    # gradient with it. The head's group is the last one (strategy appends it), so the policy's norm is
    # that same call over the groups before it: upstream's groups, bit for bit.
    if group != len(optimizer.bit16_groups) - 1:
        raise HeadGroupError(f"the head's group must be the optimizer's last (it is {group} of "
                             f"{len(optimizer.bit16_groups)})")
    norms = {}
    original_norm = optimizer.scaled_global_norm
    original_clip = optimizer.unscale_and_clip_grads

    def norm_without_head(norm_type=2):
        # the head's group norm as DeepSpeed computes each group's (reduced over the data-parallel ranks)
        params = optimizer.params_in_partition[group]
        if optimizer.cpu_offload:
            norms["head"] = optimizer.complete_grad_norm_calculation_for_cpu_offload(params)
        else:
            norms["head"] = optimizer.get_grad_norm_direct(optimizer.averaged_gradients[group], params)
        groups = optimizer.bit16_groups
        optimizer.bit16_groups = groups[:group]
        try:
            return original_norm(norm_type)
        finally:
            optimizer.bit16_groups = groups

    def clip_per_group(grad_groups_flat, total_norm):
        if grad_groups_flat and grad_groups_flat[0] is optimizer.single_partition_of_fp32_groups[group].grad:
            total_norm = norms["head"]
        return original_clip(grad_groups_flat, total_norm)

    optimizer.scaled_global_norm = norm_without_head
    optimizer.unscale_and_clip_grads = clip_per_group


def open_head_window(engine) -> bool:
    """Before a micro-batch's head backwards; True when they open a new accumulation window (the engine
    has stepped since the head's last backward, or there was none).

    First closes the previous backward as a micro-step, as the engine's own forward would (the head runs
    no engine forward). A window's first backward (micro-step 0) copies instead of adding, per parameter,
    in ZeRO-3's gradient buffer and in ZeRO-2's host accumulation buffers under offload; parameters that
    backward does not reach keep the previous window's values there, which later backwards would add to.
    So a window the head's backwards open starts from zeroed buffers, and every later backward in it
    (head or policy) adds onto zeros. ZeRO-2 without offload starts each window afresh by itself.
    """
    optimizer, stage = _zero_optimizer(engine)
    optimizer.clear_backward_seen_flag()
    if getattr(engine, _WINDOW_ATTR, None) == engine.global_steps:
        return False
    setattr(engine, _WINDOW_ATTR, engine.global_steps)
    if stage == 3:
        optimizer.grad_partitions_flat_buffer.zero_()
    elif optimizer.cpu_offload:
        for buffer in optimizer.accumulated_grads_in_cpu.values():
            buffer.zero_()
    return True


def head_backward(engine) -> Callable[[torch.Tensor], None]:
    """DeepSpeed's engine backward for one head chunk.

    It first closes the previous backward as a micro-step (the next backward accumulates instead of
    overwriting; the policy's next forward closes this one). DeepSpeed counts micro-steps by the engine's
    step() calls, so a head backward in a window's last micro-batch runs at its boundary. ZeRO-3, and
    ZeRO-2 under offload, move each parameter's accumulated gradient to the optimizer at the boundary
    backward that reaches it: the head's there, the policy's at the policy's backward after it. ZeRO-2
    without offload instead gathers every group's gradients at the end of the boundary backward, which
    would leave the policy's last backward out of the step: there the head's backward is held off the
    boundary, and the policy's backward after it is the boundary.
    """
    optimizer, stage = _zero_optimizer(engine)
    hold_off_boundary = stage == 2 and not optimizer.cpu_offload and engine.managed_gradient_accumulation()

    def backward(loss: torch.Tensor) -> None:
        optimizer.clear_backward_seen_flag()
        if not hold_off_boundary:
            engine.backward(loss)
            return
        saved = engine._is_gradient_accumulation_boundary  # None: DeepSpeed's own count decides
        engine.set_gradient_accumulation_boundary(False)
        try:
            engine.backward(loss)
        finally:
            engine._is_gradient_accumulation_boundary = saved

    return backward


@contextlib.contextmanager
def head_step_skipped(engine, scheduler):
    """Optimizer steps inside run with the head group's LR at zero: head parameters stay as they are.

    The scheduler's own step (inside engine.step) still sets the next LR; it is kept when it ran.
    """
    optimizer, _ = _zero_optimizer(engine)
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
    optimizer, stage = _zero_optimizer(engine)
    group = head_group_index(optimizer)
    if stage == 3:
        partitions = {sub: optimizer.fp32_partitioned_groups_flat[sub]
                      for sub, grp in sorted(optimizer.sub_group_to_group_id.items()) if grp == group}
    else:
        partitions = {group: optimizer.single_partition_of_fp32_groups[group]}
    out = {}
    for sub, flat in partitions.items():
        state = optimizer.optimizer.state[flat]
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{sub}.{key}"] = state[key].detach().cpu().clone()
    return out
