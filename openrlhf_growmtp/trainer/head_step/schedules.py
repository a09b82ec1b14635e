"""Which records the head updates on at a micro-batch of an RL step (`--growmtp_head_update`).

A schedule answers `due(indices, epoch, step)` for the micro-batch `step` of an epoch, whose samples'
records are `indices`: the records to update on, or None for no head update there. Every rank gets an
answer at every micro-batch alike (an empty list is still an update: the ranks' head updates run in
lockstep, `core/lockstep.py`). Window sizes come from upstream's trainer when asked, not when the
schedule is made: with dynamic batching upstream lays the RL step's windows out as its step begins.
"""

from __future__ import annotations


class FirstWindow:
    """`rl_step` (the paper's schedule): every record once, in order, spread over the micro-batches of the
    RL step's first accumulation window, so one head step; in joint mode all of them at its first
    micro-batch (their hidden states share the backbone's graphs, which one backward consumes)."""

    head_steps_per_epoch = 1

    def __init__(self, upstream, num_records: int, joint: bool):
        self.upstream, self.num_records, self.joint = upstream, num_records, joint

    def due(self, indices: list[int], epoch: int, step: int) -> list[int] | None:
        window = self.upstream.first_window()
        if epoch or step >= window or (self.joint and step):
            return None
        shares = 1 if self.joint else window
        return list(range(step * self.num_records // shares, (step + 1) * self.num_records // shares))

    def done(self, epoch: int, step: int) -> bool:
        """Whether no record is due after this micro-batch."""
        return epoch == 0 and step == self.upstream.first_window() - 1


class OwnRecords:
    """`policy_step`, or one policy step per RL step: each micro-batch's own samples' records, in every
    epoch, so a head step with every policy step."""

    def __init__(self, upstream):
        self.upstream = upstream

    @property
    def head_steps_per_epoch(self) -> int:
        return self.upstream.optimizer_steps_per_epoch()

    def due(self, indices: list[int], epoch: int, step: int) -> list[int]:
        return indices

    def done(self, epoch: int, step: int) -> bool:
        return False
