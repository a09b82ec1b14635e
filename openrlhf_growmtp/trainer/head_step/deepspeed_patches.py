"""The head's param group inside DeepSpeed's ZeRO-2 or ZeRO-3 optimizer (deepspeed 0.19.6): found, patched once
when the strategy builds the optimizer, and read (LR, Adam state).

The head is a submodule of the model DeepSpeed wraps, so ZeRO partitions and reduces it with the policy
and one optimizer steps both. The patches, installed once and never touched again:
- gradient-norm clipping per group (the policy's clip norm is exactly upstream's);
- the head group held still: the optimizer steps it only where the run-time owner of the head's
  accumulation windows says so (`head_optimizer.HeadOptimizer.steps_head`), told whether the head's
  gradient is finite; in every other step of the shared optimizer the head's parameters and its Adam
  state stay exactly as they are.
ZeRO-2 (`DeepSpeedZeroOptimizer`, `partition_gradients`) and ZeRO-3 (`DeepSpeedZeroOptimizer_Stage3`)
differ in where gradients accumulate and how norms are grouped; each function handles both. The
DeepSpeed internals used here and in `head_optimizer.py` are listed in `contract.CONTRACT` (methods) and
`contract.ATTRIBUTES` (instance attributes), and checked at start-up.
"""

from __future__ import annotations

from typing import Callable

import torch

HEAD_GROUP = "growmtp_head"  # the optimizer param group's name


class HeadGroupError(RuntimeError):
    """The optimizer is not a ZeRO-2/3 optimizer with the head group that these functions expect."""


def zero_optimizer(engine):
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


def head_step_indices(optimizer, stage: int, group: int) -> list[int]:
    """What `_optimizer_step` is called with for the head's parameters: ZeRO-3's sub-groups, ZeRO-2's group."""
    if stage == 3:
        return sorted(sub for sub, grp in optimizer.sub_group_to_group_id.items() if grp == group)
    return [group]


def install(engine, steps_head: Callable[[bool], bool]) -> None:
    """Keep the head's gradients out of the policy's clipping, and hold the head group still in every
    optimizer step where `steps_head(gradient_finite)` is False.

    DeepSpeed clips with one norm over all groups; here the policy's groups are clipped with the norm of
    the policy's gradients alone (exactly upstream's) and the head's with the head's own norm. DeepSpeed
    reports a non-finite norm as -1 (and clips bf16 gradients with it as if finite); the head's norm, reduced
    over the ranks, also says whether the head's gradient is finite on every rank.
    """
    optimizer, stage = zero_optimizer(engine)
    group = head_group_index(optimizer)
    indices = head_step_indices(optimizer, stage, group)
    norms = {"head_finite": True}  # the head's gradient norm in the optimizer step now running
    if stage == 3:
        _clip_per_group_zero3(optimizer, indices, norms)
    else:
        _clip_per_group_zero2(optimizer, group, norms)
    _hold_head(optimizer, indices, lambda: steps_head(norms["head_finite"]))


def _finite_norms(norms: list[torch.Tensor]) -> bool:
    """Whether DeepSpeed's group norms are all finite (it writes -1 for an infinite or NaN one)."""
    return all(bool(torch.isfinite(n)) and float(n) >= 0 for n in norms)


def _hold_head(optimizer, head_indices: list[int], steps_head: Callable[[], bool]) -> None:
    # The optimizer steps one group (ZeRO-2) or sub-group (ZeRO-3) at a time through `_optimizer_step`,
    # then copies each fp32 partition back to the model's parameters: a skipped step leaves the fp32
    # partition, the Adam moments and step count, and so the parameters, bit for bit as they were.
    original = optimizer._optimizer_step

    def step(index: int):
        if index in head_indices and not steps_head():
            return None
        return original(index)

    optimizer._optimizer_step = step


def _clip_per_group_zero3(optimizer, head_subgroups: list[int], norms: dict) -> None:
    # ZeRO-3 computes one norm per sub-group and clips sub-group by sub-group: the head's sub-groups count
    # zero towards the policy's norm (which is then upstream's) and are clipped with their own.
    original_norms = optimizer._get_norm_groups
    original_clip = optimizer.unscale_and_clip_grads

    def norm_groups_without_head():
        per_subgroup = original_norms()
        head = [n for sub, n in enumerate(per_subgroup) if sub in head_subgroups]
        norms["head"] = torch.linalg.vector_norm(torch.stack(head)) if head else None
        norms["head_finite"] = _finite_norms(head)
        return [torch.zeros_like(n) if sub in head_subgroups else n for sub, n in enumerate(per_subgroup)]

    def clip_per_group(sub_group_id, total_norm):
        if sub_group_id in head_subgroups:
            total_norm = norms["head"]
        return original_clip(sub_group_id, total_norm)

    optimizer._get_norm_groups = norm_groups_without_head
    optimizer.unscale_and_clip_grads = clip_per_group


def _clip_per_group_zero2(optimizer, group: int, norms: dict) -> None:
    # ZeRO-2 computes the global norm in one call over `bit16_groups` and clips each group's flat fp32
    # gradient with it. The head's group is the last one (strategy appends it), so the policy's norm is
    # that same call over the groups before it: upstream's groups, bit for bit.
    if group != len(optimizer.bit16_groups) - 1:
        raise HeadGroupError(f"the head's group must be the optimizer's last (it is {group} of "
                             f"{len(optimizer.bit16_groups)})")
    original_norm = optimizer.scaled_global_norm
    original_clip = optimizer.unscale_and_clip_grads

    def norm_without_head(norm_type=2):
        # the head's group norm as DeepSpeed computes each group's (reduced over the data-parallel ranks)
        params = optimizer.params_in_partition[group]
        if optimizer.cpu_offload:
            norms["head"] = optimizer.complete_grad_norm_calculation_for_cpu_offload(params)
        else:
            norms["head"] = optimizer.get_grad_norm_direct(optimizer.averaged_gradients[group], params)
        norms["head_finite"] = _finite_norms([norms["head"]])
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


def gathered_parameters(params):
    """A context inside which ZeRO-3's partitioned `params` are whole (DeepSpeed's gather, a collective every
    rank enters); a no-op for parameters ZeRO-3 did not partition. The core's `Lockstep.gathered`."""
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(params))


def head_lr(engine) -> float:
    """The head group's LR now."""
    optimizer, _ = zero_optimizer(engine)
    return optimizer.param_groups[head_group_index(optimizer)]["lr"]


def head_optimizer_state(engine) -> dict[str, torch.Tensor]:
    """This rank's partition of the head group's Adam state: moments and step count (checkpoint snapshots)."""
    optimizer, stage = zero_optimizer(engine)
    flats = optimizer.fp32_partitioned_groups_flat if stage == 3 else optimizer.single_partition_of_fp32_groups
    partitions = {i: flats[i] for i in head_step_indices(optimizer, stage, head_group_index(optimizer))}
    out = {}
    for sub, flat in partitions.items():
        state = optimizer.optimizer.state[flat]  # empty until the head's first step
        for key in ("exp_avg", "exp_avg_sq", "step"):
            if key in state:
                out[f"{sub}.{key}"] = torch.as_tensor(state[key]).detach().cpu().clone()
    return out
