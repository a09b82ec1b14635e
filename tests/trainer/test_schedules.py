"""Which records the head updates on at a micro-batch (`trainer/schedules.py`)."""

from __future__ import annotations

from openrlhf_growmtp.trainer.head_step.schedules import FirstWindow, OwnRecords


class Upstream:
    """The two answers a schedule asks upstream's trainer for (`upstream_actor.UpstreamActorTrainer`)."""

    def __init__(self, window: int, steps: int = 1):
        self.window, self.steps = window, steps

    def first_window(self) -> int:
        return self.window

    def optimizer_steps_per_epoch(self) -> int:
        return self.steps


def test_rl_step_spreads_every_record_once_in_order_over_the_first_window_only():
    schedule = FirstWindow(Upstream(window=3), num_records=7, joint=False)
    shares = [schedule.due([9, 9], epoch=0, step=step) for step in range(3)]
    assert [i for share in shares for i in share] == list(range(7)) and all(shares)
    assert schedule.due([9], epoch=0, step=3) is None and schedule.due([9], epoch=1, step=0) is None
    assert [schedule.done(0, step) for step in range(3)] == [False, False, True] and schedule.head_steps_per_epoch == 1


def test_a_first_window_longer_than_the_records_still_updates_at_every_micro_batch_of_it():
    # the ranks' head updates run in lockstep: an empty share is an update on no records, not no update
    schedule = FirstWindow(Upstream(window=4), num_records=2, joint=False)
    assert [schedule.due([], 0, step) for step in range(4)] == [[], [0], [], [1]]


def test_joint_mode_takes_every_record_at_the_first_micro_batch():
    schedule = FirstWindow(Upstream(window=3), num_records=5, joint=True)
    assert schedule.due([], 0, 0) == list(range(5)) and schedule.due([], 0, 1) is None
    assert schedule.done(0, 2) and not schedule.done(0, 0)


def test_policy_step_takes_each_micro_batchs_own_records_in_every_epoch():
    schedule = OwnRecords(Upstream(window=2, steps=3))
    assert schedule.due([4, 1], epoch=2, step=5) == [4, 1] and schedule.due([], 0, 0) == []
    assert schedule.head_steps_per_epoch == 3 and not schedule.done(0, 0)
