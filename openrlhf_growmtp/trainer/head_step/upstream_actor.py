"""What the head's RL step reads from upstream's actor-side trainer (`ActorPPOTrainer`), by name.

Every attribute read here is listed in `contract.TRAINER_CONTRACT` and checked when an RL step starts,
so a renamed attribute upstream fails there, naming itself, not in the middle of a step.
"""

from __future__ import annotations

import math

from ..contract import check_trainer_contract


class UpstreamActorTrainer:
    """Named accessors into one live `ActorPPOTrainer` (or a subclass)."""

    def __init__(self, trainer):
        check_trainer_contract(trainer)
        self._trainer = trainer

    @property
    def args(self):
        return self._trainer.args

    @property
    def engine(self):
        """The DeepSpeed engine wrapping the policy's HF model (the head is its submodule)."""
        return self._trainer.actor.model

    @property
    def replay_items(self) -> list:
        """This rank's samples of the RL step (upstream's Experience objects), in their order."""
        return self._trainer.replay_buffer.items

    @property
    def ring_attention(self) -> bool:
        return self._trainer.strategy.ring_attn_group is not None

    def micro_batches_per_epoch(self) -> int:
        buffer = self._trainer.replay_buffer
        return max(1, len(buffer.items) // buffer.sample_batch_size)  # upstream's DataLoader drops a partial one

    def first_window(self) -> int:
        """Micro-batches in the RL step's first accumulation window."""
        if self.args.train.dynamic_batch_enable:
            return self._trainer.replay_buffer.dynamic_optimizer_step.index(True) + 1
        return min(self._trainer.strategy.accumulated_gradient, self.micro_batches_per_epoch())

    def optimizer_steps_per_epoch(self) -> int:
        if self.args.train.dynamic_batch_enable:
            return max(1, sum(self._trainer.replay_buffer.dynamic_optimizer_step))
        return max(1, math.ceil(self.micro_batches_per_epoch() / self._trainer.strategy.accumulated_gradient))
