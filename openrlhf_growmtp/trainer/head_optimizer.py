"""The head's param group inside DeepSpeed's ZeRO-2 or ZeRO-3 optimizer, next to the policy's (deepspeed 0.19.6).

The head is a submodule of the model DeepSpeed wraps, so ZeRO partitions and reduces it with the policy
and one optimizer steps both; these functions keep the head from touching the policy's update, and the
policy's steps from moving the head:
- gradient-norm clipping per group (the policy's clip norm is exactly upstream's),
- the head group steps only in an accumulation window where the head's update ran and was finite
  (`head_updated`); in every other step of the shared optimizer the head's parameters and its Adam state
  stay exactly as they are,
- accumulation windows that the head's backwards may open (they run before a micro-batch's policy
  backward, so they close the previous backward as the engine's forward would, and ZeRO-3's buffer is
  zeroed where they open a window).
ZeRO-2 (`DeepSpeedZeroOptimizer`, `partition_gradients`) and ZeRO-3 (`DeepSpeedZeroOptimizer_Stage3`)
differ in where gradients accumulate and how norms are grouped; each function handles both. The
DeepSpeed internals used here are listed in `contract.CONTRACT` and checked at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..core.schedule import HeadLRSchedule

HEAD_GROUP = "growmtp_head"  # the optimizer param group's name
_WINDOW_ATTR = "_growmtp_head_window"  # on the engine: its global step when the head's backwards last ran
_UPDATED_ATTR = "_growmtp_head_updated"  # on the engine: its global step when the head's update last completed


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
    """Give the head group its own LR schedule, keep its gradients out of the policy's clipping, and hold it
    still in the optimizer steps without a head update (`head_updated`).

    DeepSpeed clips with one norm over all groups; here the policy's groups are clipped with the norm of
    the policy's gradients alone (exactly upstream's) and the head's with the head's own norm.
    """
    optimizer, stage = _zero_optimizer(engine)
    group = head_group_index(optimizer)
    if stage == 3:
        _clip_per_group_zero3(optimizer, _head_step_indices(optimizer, stage, group))
    else:
        _clip_per_group_zero2(optimizer, group)
    _hold_head_between_updates(engine, optimizer, _head_step_indices(optimizer, stage, group))
    # LambdaLR keeps one multiplier per group; the head's replaces upstream's for its group only.
    scheduler.lr_lambdas[group] = lr_multiplier
    refresh_head_lr(engine, scheduler)


def refresh_head_lr(engine, scheduler) -> float:
    """Set the head group's LR from its multiplier now (as the scheduler's next step would); returns it."""
    optimizer, _ = _zero_optimizer(engine)
    group = head_group_index(optimizer)
    lr = scheduler.base_lrs[group] * scheduler.lr_lambdas[group](scheduler.last_epoch)
    optimizer.param_groups[group]["lr"] = lr
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]
    return lr


def _head_step_indices(optimizer, stage: int, group: int) -> list[int]:
    """What `_optimizer_step` is called with for the head's parameters: ZeRO-3's sub-groups, ZeRO-2's group."""
    if stage == 3:
        return sorted(sub for sub, grp in optimizer.sub_group_to_group_id.items() if grp == group)
    return [group]


def _hold_head_between_updates(engine, optimizer, head_indices: list[int]) -> None:
    # The optimizer steps one group (ZeRO-2) or sub-group (ZeRO-3) at a time through `_optimizer_step`,
    # then copies each fp32 partition back to the model's parameters: a skipped step leaves the fp32
    # partition, the Adam moments and step count, and so the parameters, bit for bit as they were.
    original = optimizer._optimizer_step

    def step(index: int):
        if index in head_indices and getattr(engine, _UPDATED_ATTR, None) != engine.global_steps:
            return None
        return original(index)

    optimizer._optimizer_step = step


def head_updated(engine, finite: bool) -> None:
    """The head's latest update in the current accumulation window: finite on every rank (the window's
    optimizer step then steps the head group too, unless a later update of the window is not) or not."""
    setattr(engine, _UPDATED_ATTR, engine.global_steps if finite else None)


class HeadWindows:
    """The accumulation windows one RL step's head updates run in: `enter` before each update (True where it
    opens a window), `updated` after it; `finite` says whether every update of the open window was finite
    on every rank (its optimizer step then steps the head); `close` at the RL step's end gives the head
    steps taken, one per window with a finite update."""

    def __init__(self, engine):
        self.engine, self.finite, self.head_steps, self._stepping = engine, True, 0, False

    def enter(self) -> bool:
        if not open_head_window(self.engine):
            return False
        self._count()
        self.finite = True
        return True

    def updated(self, finite: bool) -> None:
        self.finite = self._stepping = finite
        head_updated(self.engine, finite)

    def close(self) -> int:
        self._count()
        return self.head_steps

    def _count(self) -> None:
        """The window the head last updated in has closed: its optimizer step stepped the head if finite."""
        self.head_steps += self._stepping
        self._stepping = False


@dataclass
class HeadLR:
    """The head group's LR multiplier (its LambdaLR lambda): the schedule at the RL step (`per_rl_step`), or at
    the policy's optimizer step. LambdaLR saves and restores its fields with the scheduler's state, so the
    count of completed RL steps survives a resume."""

    schedule: HeadLRSchedule
    per_rl_step: bool
    rl_steps: int = 0  # completed RL steps

    def __call__(self, policy_steps: int) -> float:
        return self.schedule(self.rl_steps if self.per_rl_step else policy_steps)


def head_lr(engine) -> float:
    optimizer, _ = _zero_optimizer(engine)
    return optimizer.param_groups[head_group_index(optimizer)]["lr"]


def start_rl_step(engine, scheduler) -> float:
    """Before an RL step's head update: its LR, set on the head group now."""
    return refresh_head_lr(engine, scheduler)


def end_rl_step(engine, scheduler) -> None:
    """After an RL step: the next one's LR follows (per RL step), whether or not its update was finite."""
    multiplier = scheduler.lr_lambdas[head_group_index(_zero_optimizer(engine)[0])]
    multiplier.rl_steps += 1
    refresh_head_lr(engine, scheduler)


def _clip_per_group_zero3(optimizer, head_subgroups: list[int]) -> None:
    # ZeRO-3 computes one norm per sub-group and clips sub-group by sub-group: the head's sub-groups count
    # zero towards the policy's norm (which is then upstream's) and are clipped with their own.
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


def head_optimizer_state(engine) -> dict[str, torch.Tensor]:
    """This rank's partition of the head group's Adam state: moments and step count (checkpoint snapshots)."""
    optimizer, stage = _zero_optimizer(engine)
    flats = optimizer.fp32_partitioned_groups_flat if stage == 3 else optimizer.single_partition_of_fp32_groups
    partitions = {i: flats[i] for i in _head_step_indices(optimizer, stage, head_group_index(optimizer))}
    out = {}
    for sub, flat in partitions.items():
        state = optimizer.optimizer.state[flat]  # empty until the head's first step
        for key in ("exp_avg", "exp_avg_sq", "step"):
            if key in state:
                out[f"{sub}.{key}"] = torch.as_tensor(state[key]).detach().cpu().clone()
    return out
