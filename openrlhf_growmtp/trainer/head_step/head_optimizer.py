"""The head's optimizer step, at run time: `HeadOptimizer` owns the state of the head's accumulation windows
and answers, in every optimizer step of the shared ZeRO optimizer, whether that step steps the head group.

Where the head steps: the policy's optimizer step at the end of an accumulation window (upstream's
`engine.step()`) calls DeepSpeed's `_optimizer_step` once per group or sub-group; for the head's, the hold
that `deepspeed_patches.install` put there asks `HeadOptimizer.steps_head`, which is True only in the window
where the head's latest update ran and was finite on every rank (`updated`). `HeadRLStep.update` opens
windows (`open_window`) and reports each update (`updated`); `start_rl_step` and `end_rl_step` bracket an
RL step (its LR, its count of head steps). The patches themselves are `deepspeed_patches.py`'s.
"""

from __future__ import annotations

from typing import Callable

import torch

from ...core.schedule import HeadLRSchedule
from . import deepspeed_patches
from .deepspeed_patches import head_group_index, zero_optimizer


class HeadLR:
    """The head group's LR multiplier (its LambdaLR lambda): the schedule at the RL step (`per_rl_step`), or at
    the policy's optimizer step; `peak_lr`, the head group's base LR.

    LambdaLR saves a callable's `__dict__` with the scheduler's state and updates it from a checkpoint. That
    dict holds plain data only: `rl_steps`, the completed RL steps, which a resume carries over, and
    `settings`, what the schedule was, which a resume compares with this run's (`resumed`). The schedule
    itself lives in slots, outside it: no object of ours is pickled into a checkpoint, and a resumed run
    follows its own flags, never the checkpoint's.
    """

    __slots__ = ("schedule", "per_rl_step", "peak_lr", "__dict__")

    def __init__(self, schedule: HeadLRSchedule, per_rl_step: bool, peak_lr: float):
        self.schedule, self.per_rl_step, self.peak_lr = schedule, per_rl_step, float(peak_lr)
        self.rl_steps = 0  # completed RL steps
        self.settings = self.described()

    def __call__(self, policy_steps: int) -> float:
        return self.schedule(self.rl_steps if self.per_rl_step else policy_steps)

    def described(self) -> dict:
        """This schedule as plain data, named by the flags that set it."""
        return {"--growmtp_head_lr": self.peak_lr, "--growmtp_head_warmup_steps": self.schedule.warmup_steps,
                "--growmtp_head_min_lr_ratio": self.schedule.min_lr_ratio,
                "--growmtp_head_update": "rl_step" if self.per_rl_step else "policy_step",
                "total steps (--train.num_episodes and the batch sizes)": self.schedule.total_steps}

    def resumed(self) -> list[str]:
        """After a checkpoint's state was loaded: the settings it was saved with that differ from this run's,
        as "name: saved -> now" (this run's are kept), and only plain data left to save again."""
        saved = vars(self).get("settings") or {}
        steps = int(vars(self).get("rl_steps", 0))
        now = self.described()
        vars(self).clear()  # a checkpoint of an older layout may have put more here
        self.rl_steps, self.settings = steps, now
        return [f"{name}: {saved[name]} -> {value}" for name, value in now.items()
                if name in saved and saved[name] != value]


class HeadOptimizer:
    """The head group of one engine's ZeRO optimizer, with its own LR schedule (`attach_head_optimizer`
    makes it) and the state of the windows the head's updates run in (module docstring).

    Across the run: `_opened_at`, the engine's global step of the window the head's backwards last ran
    in, and `_updated_at`, that of the window whose latest head update was finite (None: not finite).
    Per RL step: `finite` (every update of the open window was finite on every rank), `gradient_finite`
    (every head step it would take had a finite gradient) and the head steps taken, one per window with a
    finite update and a finite gradient.
    """

    def __init__(self, engine, scheduler):
        self.engine, self.scheduler = engine, scheduler
        self.optimizer, self.stage = zero_optimizer(engine)
        self.group = head_group_index(self.optimizer)
        self._opened_at: int | None = None
        self._updated_at: int | None = None
        self.finite, self.head_steps, self._stepping = True, 0, False
        self.gradient_finite = True
        self._hold_off_boundary = False

    # ---- the optimizer step ---------------------------------------------------------------------------------
    def steps_head(self, gradient_finite: bool) -> bool:
        """Whether the optimizer step now running steps the head group: the head's latest update ran in
        this window and was finite on every rank, and the head's gradient (reduced over the ranks) is finite.
        A finite loss can still give a non-finite gradient; that step is skipped like a non-finite loss's.
        Asked by the hold `deepspeed_patches.install` put on DeepSpeed's `_optimizer_step`."""
        if self._updated_at != self.engine.global_steps:
            return False
        if not gradient_finite:
            self.gradient_finite = self._stepping = False
        return gradient_finite

    # ---- one RL step -----------------------------------------------------------------------------------------
    def start_rl_step(self) -> float:
        """Before an RL step's head updates: its counts start afresh and its LR is set on the head group now."""
        self.finite, self.head_steps, self._stepping, self.gradient_finite = True, 0, False, True
        self._hold_off_boundary = (self.stage == 2 and not self.optimizer.cpu_offload
                                   and self.engine.managed_gradient_accumulation())
        return self.refresh_lr()

    def open_window(self) -> bool:
        """Before a micro-batch's head backwards; True when they open a new accumulation window (the engine
        has stepped since the head's last backward, or there was none).

        First closes the previous backward as a micro-step, as the engine's own forward would (the head runs
        no engine forward). A window's first backward (micro-step 0) copies instead of adding, per parameter,
        in ZeRO-3's gradient buffer and in ZeRO-2's host accumulation buffers under offload; parameters that
        backward does not reach keep the previous window's values there, which later backwards would add to.
        So a window the head's backwards open starts from zeroed buffers, and every later backward in it
        (head or policy) adds onto zeros. ZeRO-2 without offload starts each window afresh by itself.
        """
        self.optimizer.clear_backward_seen_flag()
        if self._opened_at == self.engine.global_steps:
            return False
        self._opened_at = self.engine.global_steps
        if self.stage == 3:
            self.optimizer.grad_partitions_flat_buffer.zero_()
        elif self.optimizer.cpu_offload:
            for buffer in self.optimizer.accumulated_grads_in_cpu.values():
                buffer.zero_()
        self._count()
        self.finite = True
        return True

    def backward(self, loss: torch.Tensor) -> None:
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
        self.optimizer.clear_backward_seen_flag()
        if not self._hold_off_boundary:
            self.engine.backward(loss)
            return
        saved = self.engine._is_gradient_accumulation_boundary  # None: DeepSpeed's own count decides
        self.engine.set_gradient_accumulation_boundary(False)
        try:
            self.engine.backward(loss)
        finally:
            self.engine._is_gradient_accumulation_boundary = saved

    def updated(self, finite: bool) -> None:
        """The head's latest update in the open window: finite on every rank (the window's optimizer step then
        steps the head group, unless a later update of the window is not) or not."""
        self.finite = self._stepping = finite
        self._updated_at = self.engine.global_steps if finite else None

    def end_rl_step(self) -> int:
        """After an RL step: the head steps it took; the next RL step's LR follows (per RL step), whether or
        not its update was finite."""
        self._count()
        self.scheduler.lr_lambdas[self.group].rl_steps += 1
        self.refresh_lr()
        return self.head_steps

    def _count(self) -> None:
        """The window the head last updated in has closed: its optimizer step stepped the head if finite."""
        self.head_steps += self._stepping
        self._stepping = False

    # ---- the LR ----------------------------------------------------------------------------------------------
    def resumed(self) -> list[str]:
        """After a resume loaded the optimizer's and scheduler's state: the head's LR follows this run's flags
        (peak LR, warm-up, floor, update schedule, length), the completed RL steps carry over. Returns what
        differs from the checkpoint's settings (`HeadLR.resumed`)."""
        multiplier: HeadLR = self.scheduler.lr_lambdas[self.group]
        # both hold the checkpoint's peak LR after a load: the base the schedule multiplies, and its record
        self.scheduler.base_lrs[self.group] = multiplier.peak_lr
        self.optimizer.param_groups[self.group]["initial_lr"] = multiplier.peak_lr
        changes = multiplier.resumed()
        self.refresh_lr()
        return changes

    def lr(self) -> float:
        return self.optimizer.param_groups[self.group]["lr"]

    def refresh_lr(self) -> float:
        """Set the head group's LR from its multiplier now (as the scheduler's next step would); returns it."""
        scheduler = self.scheduler
        lr = scheduler.base_lrs[self.group] * scheduler.lr_lambdas[self.group](scheduler.last_epoch)
        self.optimizer.param_groups[self.group]["lr"] = lr
        scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]
        return lr


def attach_head_optimizer(engine, scheduler, lr_multiplier: Callable[[int], float]) -> HeadOptimizer:
    """Give the head group its own LR schedule, keep its gradients out of the policy's clipping, and hold it
    still in the optimizer steps without a head update (`deepspeed_patches.install`)."""
    head_optimizer = HeadOptimizer(engine, scheduler)
    deepspeed_patches.install(engine, head_optimizer.steps_head)
    # LambdaLR keeps one multiplier per group; the head's replaces upstream's for its group only.
    scheduler.lr_lambdas[head_optimizer.group] = lr_multiplier
    head_optimizer.refresh_lr()
    return head_optimizer
