"""The head's LR schedule across a checkpoint (`head_step/head_optimizer.HeadLR`): a checkpoint holds it as plain
data only, and a resumed run follows its own flags (peak LR, warm-up, floor, update schedule, length) with
the completed RL steps carried over. On torch's own optimizer and LambdaLR, as DeepSpeed saves and loads them."""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR

from openrlhf_growmtp.core.schedule import HeadLRSchedule
from openrlhf_growmtp.trainer.head_step.head_optimizer import HeadLR, HeadOptimizer

HEAD = 1  # the head's param group (the strategy appends it after the policy's)


def run(peak: float, schedule: HeadLRSchedule, per_rl_step: bool = True):
    """A policy group and a head group in one optimizer, upstream's lambda (a function) and the head's."""
    policy, head = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW([{"params": policy.parameters(), "lr": 1e-3}, {"params": head.parameters(),
                                                                                 "lr": peak}])
    multiplier = HeadLR(schedule, per_rl_step, peak)
    return optimizer, LambdaLR(optimizer, [lambda step: 1.0, multiplier]), multiplier


def saved(scheduler) -> bytes:
    buffer = io.BytesIO()
    torch.save(scheduler.state_dict(), buffer)
    return buffer.getvalue()


def owner(optimizer, scheduler) -> HeadOptimizer:
    """The head group's owner as far as `resumed` reads it (its optimizer, scheduler and group)."""
    head_optimizer = HeadOptimizer.__new__(HeadOptimizer)
    head_optimizer.optimizer, head_optimizer.scheduler, head_optimizer.group = optimizer, scheduler, HEAD
    return head_optimizer


def test_a_checkpoint_holds_the_head_schedule_as_plain_data():
    _, scheduler, multiplier = run(3e-4, HeadLRSchedule(total_steps=20))
    multiplier.rl_steps = 4
    blob = saved(scheduler)
    # weights_only unpickles plain containers, numbers and strings only: loading it runs no code of ours
    state = torch.load(io.BytesIO(blob), weights_only=True)
    assert b"openrlhf_growmtp" not in blob
    assert state["lr_lambdas"][HEAD] == {"rl_steps": 4, "settings": multiplier.described()}


def test_a_resumed_run_follows_its_own_head_schedule_and_keeps_the_completed_rl_steps():
    old_optimizer, old_scheduler, old = run(3e-4, HeadLRSchedule(total_steps=20, warmup_steps=10, min_lr_ratio=0.1))
    old.rl_steps = 4
    checkpoint = (old_optimizer.state_dict(), torch.load(io.BytesIO(saved(old_scheduler)), weights_only=True))
    flags = HeadLRSchedule(total_steps=40, warmup_steps=2, min_lr_ratio=0.5)
    optimizer, scheduler, multiplier = run(1e-4, flags)
    optimizer.load_state_dict(checkpoint[0])  # as DeepSpeed loads a checkpoint: the saved LRs come back ...
    scheduler.load_state_dict(checkpoint[1])
    assert scheduler.base_lrs[HEAD] == 3e-4
    changed = owner(optimizer, scheduler).resumed()
    assert multiplier.schedule is flags and multiplier.rl_steps == 4  # ... and the run's flags win
    # RL step 4 of the new schedule: past its warm-up, cosine from 1e-4 towards its floor 5e-5 over 37 steps
    assert optimizer.param_groups[HEAD]["lr"] == pytest.approx(1e-4 * (0.5 + 0.25 * (1 + math.cos(math.pi * 2 / 37))),
                                                               rel=1e-12)
    assert scheduler.base_lrs[HEAD] == optimizer.param_groups[HEAD]["initial_lr"] == 1e-4
    assert changed == ["--growmtp_head_lr: 0.0003 -> 0.0001", "--growmtp_head_warmup_steps: 10 -> 2",
                       "--growmtp_head_min_lr_ratio: 0.1 -> 0.5",
                       "total steps (--train.num_episodes and the batch sizes): 20 -> 40"]
    assert torch.load(io.BytesIO(saved(scheduler)), weights_only=True)["lr_lambdas"][HEAD]["settings"] == \
        multiplier.described()  # the next checkpoint records the schedule the run now follows


def test_an_unchanged_resume_reports_nothing_and_an_older_checkpoints_schedule_object_is_dropped():
    optimizer, scheduler, multiplier = run(3e-4, HeadLRSchedule(total_steps=20))
    state = scheduler.state_dict()
    state["lr_lambdas"][HEAD] = {"schedule": HeadLRSchedule(total_steps=5), "per_rl_step": False, "rl_steps": 3}
    scheduler.load_state_dict(state)  # the layout checkpoints had before: the schedule object itself
    assert owner(optimizer, scheduler).resumed() == []
    assert multiplier.schedule.total_steps == 20 and multiplier.per_rl_step and multiplier.rl_steps == 3
    assert b"openrlhf_growmtp" not in saved(scheduler)
