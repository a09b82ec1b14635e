"""The head's part of one RL step on a policy rank (`HeadRLStep`): its head updates and head steps.

The actor-side trainer (`ppo_actor.GrowMTPActorTrainer`) makes one `HeadRLStep` per RL step before the
policy's micro-batches, enters `micro_batch` around each of them, registers `before_policy_backward` at
the strategy's seam (`strategy.GrowMTPStrategy.before_policy_backward`), and reads `metrics` after them.

Two collaborators are chosen once, when the RL step starts:
- the schedule (`schedules.py`): which records are due at a micro-batch. `rl_step` (the paper's, the
  default): every record once, spread over the first accumulation window; `policy_step`, or one policy
  step per RL step (where the two are one schedule): each micro-batch's own samples' records;
- the hidden states' source (`hidden_states.py`): where the policy's training forward runs the rollout
  policy over exactly the records' tokens, that forward's own (the micro-batch's records then update
  between its forward and its backward); otherwise one forward of the rollout policy of the head's own,
  before the policy's first step.
The head group steps with the optimizer step of each window the head updated in, if every update there
was finite on every rank (`head_optimizer.HeadWindows`).
"""

from __future__ import annotations

import contextlib
import logging

import torch

from ..core.lockstep import Lockstep
from ..core.records import SequenceRecord
from . import head_optimizer
from .args import policy_steps_per_rl_step
from .head_update import HeadUpdateConfig, HeadUpdateTotals, head_alpha_on, update_head
from .hidden_states import OwnForward, TrainingForward, training_forward_mismatch
from .schedules import FirstWindow, OwnRecords
from .strategy import head_of
from .upstream_actor import UpstreamActorTrainer

logger = logging.getLogger("growmtp")


class HeadRLStep:
    """The head's part of one RL step (module docstring). `trainer`: upstream's actor-side PPO trainer."""

    def __init__(self, trainer, records: list[SequenceRecord], cfg: HeadUpdateConfig):
        self.upstream = upstream = UpstreamActorTrainer(trainer)
        self.records, self.cfg, a = records, cfg, upstream.args
        self.engine = upstream.engine
        self.head = head_of(self.engine.module)
        self.lockstep = Lockstep(distributed=True, backward=head_optimizer.head_backward(self.engine))
        self.windows = head_optimizer.HeadWindows(self.engine)
        self.lr = head_optimizer.start_rl_step(self.engine, upstream.scheduler)
        policy_steps = policy_steps_per_rl_step(a.rollout.batch_size, a.rollout.n_samples_per_prompt,
                                                a.train.batch_size, a.train.max_epochs)
        own_records = policy_steps > 1 and a.growmtp.head_update == "policy_step" and not cfg.joint
        from_forward = not own_records and self._from_training_forward(policy_steps)
        if own_records or from_forward:
            self.schedule = OwnRecords(upstream)
        else:
            self.schedule = FirstWindow(upstream, len(records), cfg.joint)
        if from_forward:
            self.hidden_states = TrainingForward(self.engine.module.model)
        else:
            self.hidden_states = OwnForward(self.engine.module.model, records, cfg.hidden_batch_size, cfg.joint,
                                            self.lockstep, keep=bool(a.growmtp.log_lag))
        self.cycles = self.lockstep.total([sum(rec.num_cycles for rec in records)])[0]
        self.cycles_per_head_step: float | None = None  # once upstream laid the step's windows out
        self.totals, self.epoch, self.micro_batches, self.head_epochs = HeadUpdateTotals(), 0, 0, set()
        self._after_forward: tuple[list[int], torch.Tensor] | None = None

    def _from_training_forward(self, policy_steps: int) -> bool:
        """Whether every rank reads H_p from the policy's own training forward this step (module docstring);
        joint mode (the head's loss reaches the backbone through a forward of its own), the lag probe (it
        reads H_p again after the step) and async training (both forwards read the policy being trained)
        never do."""
        a = self.upstream.args
        reason = ("joint mode" if self.cfg.joint else "the lag probe" if a.growmtp.log_lag
                  else f"{policy_steps} policy steps per RL step" if policy_steps != 1
                  else "dynamic batching" if a.train.dynamic_batch_enable
                  else "ring attention" if self.upstream.ring_attention
                  else "no records" if not self.records
                  else training_forward_mismatch(self.upstream.replay_items, self.records))
        agreed = self.lockstep.every(reason is None)
        if reason is not None and reason.startswith("a sample"):
            logger.warning("GrowMTP: the head reads H_p from a policy forward of its own this step (%s)", reason)
        elif not agreed:
            logger.info("GrowMTP: the head reads H_p from a policy forward of its own this step (%s)",
                        reason or "another rank")
        return agreed

    # ---- the points upstream's RL step calls -------------------------------------------------------------
    @contextlib.contextmanager
    def micro_batch(self, indices: list[int], attention_mask: torch.Tensor, step: int):
        """Around upstream's training step of one micro-batch (`step`: its index in the epoch): the records
        due there update as soon as their hidden states are ready."""
        if step == 0 and self.micro_batches:
            self.epoch += 1
        self.micro_batches += 1
        due = self.schedule.due(indices, self.epoch, step)  # None: no head update here
        if due is not None and self.hidden_states.ready_before_forward:
            self.update(due, self.hidden_states.of_records(due))
        elif due is not None:  # from this micro-batch's own forward, before its backward
            self._after_forward = (due, attention_mask)
        with self.hidden_states.watching(self._after_forward is not None):
            yield
        if self.schedule.done(self.epoch, step):
            self.hidden_states.release()

    def before_policy_backward(self) -> None:
        """Between the micro-batch's policy forward and its backward: the update from that forward's H_p."""
        if self._after_forward is not None:
            due, attention_mask = self._after_forward
            self._after_forward = None
            self.update(due, self.hidden_states.of_forward(attention_mask))

    def metrics(self) -> dict[str, float]:
        """The RL step's head metrics (after the policy's micro-batches); counts this RL step done."""
        head_steps = self.windows.close()
        head_optimizer.end_rl_step(self.engine, self.upstream.scheduler)
        metrics = self.totals.metrics()
        metrics.update(head_steps=float(head_steps), head_epochs=float(len(self.head_epochs)), head_lr=self.lr,
                       head_hidden_from_forward=float(isinstance(self.hidden_states, TrainingForward)))
        if not self.totals.finite:
            logger.warning("GrowMTP: the head loss was not finite in an optimizer step of this RL step; that "
                           "step's head update is skipped (the policy update is unaffected)")
        elif self.upstream.args.growmtp.log_lag:
            # the updated head on the records of the policy it was trained for (see head_alpha_on)
            device = next(self.head.parameters()).device
            hiddens = [h.to(device) for h in self.hidden_states.of_records(range(len(self.records)))]
            with torch.random.fork_rng(devices=[]):
                metrics.update(head_alpha_on(self.head, self.records, hiddens, self.cfg, self.lockstep))
        return metrics

    # ---- one head update -----------------------------------------------------------------------------------
    def update(self, due: list[int], hiddens: list[torch.Tensor]) -> None:
        """The head update of these records in the current accumulation window; the window's optimizer step
        steps the head only if every update the window made was finite on every rank."""
        if self.windows.enter():
            self.lr = head_optimizer.head_lr(self.engine)
        if not self.windows.finite:  # every rank agreed on it: all skip alike
            return
        if self.cycles_per_head_step is None:
            self.cycles_per_head_step = self.cycles / self.schedule.head_steps_per_epoch
        device = next(self.head.parameters()).device
        # The head update draws no random numbers, but upstream's data order must not depend on that.
        with torch.random.fork_rng(devices=[]):
            totals = update_head(self.head, [self.records[i] for i in due], [h.to(device) for h in hiddens],
                                 self.cfg, self.lockstep, self.engine.gradient_accumulation_steps(),
                                 self.cycles_per_head_step)
        self.windows.updated(totals.finite)
        self.head_epochs.add(self.epoch)
        self.totals.add(totals, first_visit=self.epoch == 0)
