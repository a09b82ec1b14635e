"""One RL step of the head's training on a policy rank: which records, where their hidden states come from,
when the head updates (`--growmtp_head_update`), its optimizer-step bookkeeping and its metrics.

The actor-side trainer (`ppo_actor.GrowMTPActorTrainer`) makes one `HeadStep` per RL step before the
policy's micro-batches (`ppo_train`), enters `micro_batch` around each of them (`training_step`), and reads
`metrics` after them. Upstream's strategy backward calls `before_policy_backward` (`strategy.py`).

When, and on which records, the head updates:
- `rl_step` (the paper's schedule, the default): one head step per RL step, on every record of the step,
  in the step's first accumulation window: the records are spread over that window's micro-batches, each
  share updated before its micro-batch's policy forward (so the head's first backward opens the window and
  its last is the window's last micro-batch, where DeepSpeed's offloaded optimizers take a gradient). The
  head group is held still in the optimizer's other steps (`head_optimizer`).
- `policy_step`: a head step with every policy step, on the records of that window's samples, each
  micro-batch's records before its policy forward.
- with one policy step per RL step the two are one schedule. Where the policy's training forward then runs
  the rollout policy over exactly the records' tokens, each micro-batch's records update between its
  forward and its backward, from that forward's hidden states: no forward of the head's own.
Otherwise the hidden states come from one forward of the rollout policy before the policy's first step.
"""

from __future__ import annotations

import contextlib
import logging
import math

import torch

from ..core.lockstep import Lockstep
from ..core.records import SequenceRecord
from . import head_optimizer
from .args import policy_steps_per_rl_step
from .head_update import HeadStepTotals, HeadUpdateConfig, head_alpha_on, update_head
from .hidden_states import TrainingForwardHiddens, step_hidden_states
from .keys import RECORD_INDEX_KEY
from .strategy import head_of

logger = logging.getLogger("growmtp")

# Which records a micro-batch's head update takes, and where their hidden states come from:
FIRST_WINDOW = "every record, spread over the first accumulation window"  # rl_step
OWN_RECORDS = "each micro-batch's own samples' records"  # policy_step with several policy steps per RL step
FROM_FORWARD = "each micro-batch's own records, from its training forward"  # one policy step per RL step


class HeadStep:
    """The head's part of one RL step (module docstring). `trainer`: upstream's actor-side PPO trainer."""

    def __init__(self, trainer, records: list[SequenceRecord], cfg: HeadUpdateConfig):
        a = trainer.args
        self.trainer, self.records, self.cfg = trainer, records, cfg
        self.engine = trainer.actor.model
        self.head = head_of(self.engine.module)
        self.lockstep = Lockstep(distributed=True, backward=head_optimizer.head_backward(self.engine))
        self.policy_steps = policy_steps_per_rl_step(a.rollout.batch_size, a.rollout.n_samples_per_prompt,
                                                     a.train.batch_size, a.train.max_epochs)
        self.lr = head_optimizer.start_rl_step(self.engine, trainer.actor_scheduler)
        self.totals, self.seconds, self.head_steps = HeadStepTotals(), 0.0, 0
        self.epoch, self.micro_batches, self.head_epochs = 0, 0, set()  # the policy's epoch; those the head ran in
        self.finite, self._window_updated = True, False
        self.layout = self._layout()
        self.hiddens: list[torch.Tensor] = []
        self.forward = TrainingForwardHiddens(self.engine.module.model) if self.layout == FROM_FORWARD else None
        if self.layout != FROM_FORWARD:
            with torch.random.fork_rng(devices=[]):  # upstream's RNG stream (its data order) untouched
                self.hiddens = step_hidden_states(self.engine.module.model, records, cfg.hidden_batch_size,
                                                  grad=cfg.joint, lockstep=self.lockstep)
            if not cfg.joint:  # off the accelerator until their micro-batch comes
                self.hiddens = [h.to("cpu") for h in self.hiddens]
        self.cycles = self.lockstep.total([sum(rec.num_cycles for rec in records)])[0]
        self.cycles_per_step: float | None = None
        self._indices: list[int] = []
        self._mask: torch.Tensor | None = None

    # ---- where the hidden states come from, and when the head updates -----------------------------------
    def _layout(self) -> str:
        a = self.trainer.args
        if self.policy_steps > 1 and a.growmtp.head_update == "policy_step" and not self.cfg.joint:
            return OWN_RECORDS
        reason = self._why_not_from_training_forward()
        agreed = self.lockstep.every(reason is None)
        if reason is not None and reason.startswith("a sample"):
            logger.warning("GrowMTP: the head reads H_p from a policy forward of its own this step (%s)", reason)
        elif not agreed:
            logger.info("GrowMTP: the head reads H_p from a policy forward of its own this step (%s)",
                        reason or "another rank")
        return FROM_FORWARD if agreed else FIRST_WINDOW

    def _why_not_from_training_forward(self) -> str | None:
        """Why this RL step's head update cannot read H_p from the policy's own training forward: only where
        that forward is the rollout policy's over exactly the records' tokens (one policy step per RL step,
        every sample whole on its rank, each with a record of its own tokens), not in joint mode (the head's
        loss then reaches the backbone through a forward of its own) and not with the lag probe (which
        reads H_p again after the step). Under async training neither forward is exactly the rollout
        policy's: both read the policy being trained."""
        trainer, a = self.trainer, self.trainer.args
        if self.cfg.joint:
            return "joint mode"
        if a.growmtp.log_lag:
            return "the lag probe"
        if self.policy_steps != 1:
            return f"{self.policy_steps} policy steps per RL step"
        if a.train.dynamic_batch_enable:
            return "dynamic batching"
        if trainer.strategy.ring_attn_group is not None:
            return "ring attention"
        if not self.records:
            return "no records"
        for item in trainer.replay_buffer.items:
            why = _record_mismatch(item, self.records)
            if why:
                return f"a sample whose tokens are not its record's: {why}"
        return None

    # ---- the points upstream's RL step calls -------------------------------------------------------------
    @contextlib.contextmanager
    def micro_batch(self, indices: list[int], attention_mask: torch.Tensor, step: int):
        """Around upstream's training step of one micro-batch (`step`: its index in the epoch)."""
        if step == 0 and self.micro_batches:
            self.epoch += 1
        self.micro_batches += 1
        if self.layout == FROM_FORWARD:
            self._indices, self._mask = indices, attention_mask
            self.forward.watch()
        elif self.layout == OWN_RECORDS:
            self._update(indices, [self.hiddens[i] for i in indices])
        elif self.epoch == 0 and step < self._first_window() and (step == 0 or not self.cfg.joint):
            share = self._share(step)
            self._update(share, [self.hiddens[i] for i in share])
            if step == self._first_window() - 1 and not self.trainer.args.growmtp.log_lag:
                self.hiddens = []  # used up: not held through the policy's other micro-batches
        try:
            yield
        finally:
            if self.forward is not None:
                self.forward.stop()

    def before_policy_backward(self) -> None:
        """Between the micro-batch's policy forward and its backward: the update from that forward's H_p."""
        if self.layout == FROM_FORWARD:
            self._update(self._indices, self.forward.per_sample(self._mask))

    def metrics(self) -> dict[str, float]:
        """The RL step's head metrics (after the policy's micro-batches); counts this RL step done."""
        self._count_window()
        head_optimizer.end_rl_step(self.engine, self.trainer.actor_scheduler)
        metrics = self.totals.metrics()
        metrics.update(head_update_s=self.seconds, head_steps=float(self.head_steps),
                       head_epochs=float(len(self.head_epochs)),
                       head_lr=self.lr, head_hidden_from_forward=float(self.layout == FROM_FORWARD))
        if not self.totals.finite:
            logger.warning("GrowMTP: the head loss was not finite in an optimizer step of this RL step; that "
                           "step's head update is skipped (the policy update is unaffected)")
        elif self.trainer.args.growmtp.log_lag:
            # the updated head on the records of the policy it was trained for (see head_alpha_on)
            device = next(self.head.parameters()).device
            with torch.random.fork_rng(devices=[]):
                metrics.update(head_alpha_on(self.head, self.records, [h.to(device) for h in self.hiddens], self.cfg,
                                             self.lockstep))
        return metrics

    # ---- one head update -----------------------------------------------------------------------------------
    def _first_window(self) -> int:
        """Micro-batches in the RL step's first accumulation window."""
        trainer = self.trainer
        if trainer.args.train.dynamic_batch_enable:
            return trainer.replay_buffer.dynamic_optimizer_step.index(True) + 1
        return min(trainer.strategy.accumulated_gradient, self._micro_batches_per_epoch())

    def _share(self, step: int) -> list[int]:
        """The records micro-batch `step` of the first window updates on: an equal share, in order. In joint
        mode all of them at once, at the first: their hidden states share the backbone's graphs, which one
        backward consumes (args refuse joint mode with an offloaded optimizer)."""
        count, window = len(self.records), 1 if self.cfg.joint else self._first_window()
        return list(range(step * count // window, (step + 1) * count // window))

    def _update(self, indices: list[int], hiddens: list[torch.Tensor]) -> None:
        """The head update of these records in the current accumulation window. The window's optimizer step
        steps the head only if every update the window made was finite on every rank (`head_optimizer`)."""
        if head_optimizer.open_head_window(self.engine):
            self._count_window()
            self.finite = True
            self.lr = head_optimizer.head_lr(self.engine)
        if not self.finite:  # every rank agreed on it: all skip alike
            return
        if self.cycles_per_step is None:
            steps = self._optimizer_steps_per_epoch() if self.layout == OWN_RECORDS else 1
            self.cycles_per_step = self.cycles / steps
        device = next(self.head.parameters()).device
        # The head update draws no random numbers, but upstream's data order must not depend on that.
        with torch.random.fork_rng(devices=[]):
            totals = update_head(self.head, [self.records[i] for i in indices], [h.to(device) for h in hiddens],
                                 self.cfg, self.lockstep, self.engine.gradient_accumulation_steps(),
                                 self.cycles_per_step)
        self.finite = self._window_updated = totals.finite
        head_optimizer.head_updated(self.engine, totals.finite)
        self.seconds += totals.seconds
        self.head_epochs.add(self.epoch)
        if self.epoch == 0:
            self.totals.add(totals)
        else:
            self.totals.finite = self.totals.finite and totals.finite

    def _count_window(self) -> None:
        """The window the head last updated in has closed (or the RL step is over): count its head step."""
        self.head_steps += self._window_updated
        self._window_updated = False

    def _micro_batches_per_epoch(self) -> int:
        buffer = self.trainer.replay_buffer
        return max(1, len(buffer) // buffer.sample_batch_size)  # upstream's DataLoader drops a partial one

    def _optimizer_steps_per_epoch(self) -> int:
        trainer = self.trainer
        if trainer.args.train.dynamic_batch_enable:
            return max(1, sum(trainer.replay_buffer.dynamic_optimizer_step))
        return max(1, math.ceil(self._micro_batches_per_epoch() / trainer.strategy.accumulated_gradient))


def _record_mismatch(item, records: list[SequenceRecord]) -> str | None:
    """Why a replay-buffer sample's valid tokens are not exactly its record's (None: they are)."""
    index = item.info.get(RECORD_INDEX_KEY)
    if index is None:
        return "no record"
    tokens = item.sequences.reshape(-1)[item.attention_mask.reshape(-1).bool()].cpu()
    recorded = records[int(index)].token_ids.cpu()
    if tokens.shape != recorded.shape:
        return f"{tokens.shape[0]} valid tokens, {recorded.shape[0]} recorded"
    if not torch.equal(tokens, recorded):
        return f"first difference at position {int((tokens != recorded).nonzero()[0])}"
    return None
