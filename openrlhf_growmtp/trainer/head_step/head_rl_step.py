"""The head's part of one RL step on a policy rank (`HeadRLStep`): its head updates and head steps.

The actor-side trainer (`ppo_actor.GrowMTPActorTrainer`) makes one `HeadRLStep` per RL step and `start`s it
before the policy's micro-batches, enters `micro_batch` around each of them, registers
`before_policy_backward` at the strategy's seam (`strategy.GrowMTPStrategy.before_policy_backward`), and
reads `metrics` after them. Its settings are read once, from the run's arguments (`HeadRLStepConfig`).

Two collaborators are chosen in `start`, which runs the collectives that choice needs:
- the schedule (`schedules.py`): which records are due at a micro-batch. `rl_step` (the paper's, the
  default): every record once, spread over the first accumulation window; `policy_step`, or one policy
  step per RL step (where the two are one schedule): each micro-batch's own samples' records;
- the hidden states' source (`hidden_states.py`): where the policy's training forward runs the rollout
  policy over exactly the records' tokens, that forward's own (the micro-batch's records then update
  between its forward and its backward); otherwise one forward of the rollout policy of the head's own,
  in `start`. Both sources answer the same calls.
The head group steps with the optimizer step of each window the head updated in, if every update there
was finite on every rank (`head_optimizer.HeadOptimizer`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

import torch

from ...core.head_loss import HeadLossConfig
from ...core.lockstep import Lockstep
from ...core.objectives import HYBRID, hybrid_lambda
from ...core.reconstruction import chunk_cycles_for
from ...core.records import SequenceRecord
from ..args import policy_steps_per_rl_step
from .deepspeed_patches import gathered_parameters
from .head_optimizer import HeadOptimizer
from .head_update import HeadUpdateConfig, HeadUpdateTotals, head_alpha_on, update_head
from .hidden_states import HiddenStateSource, OwnForward, TrainingForward, training_forward_mismatch
from .schedules import FirstWindow, OwnRecords
from .upstream_actor import UpstreamActorTrainer

logger = logging.getLogger("growmtp")


@dataclass(frozen=True)
class HeadRLStepConfig:
    """What the head's part of an RL step is set to, read once from the run's arguments (`from_args`)."""

    update: HeadUpdateConfig
    policy_steps: int  # the policy's optimizer steps per RL step
    per_policy_step: bool  # --growmtp_head_update policy_step
    log_lag: bool  # --growmtp_log_lag
    dynamic_batching: bool  # upstream's --train.dynamic_batch_enable

    @classmethod
    def from_args(cls, args, alpha_1: float, device: torch.device, micro_batch_size: int) -> HeadRLStepConfig:
        """`alpha_1`: the last RL step's realised first-draft acceptance (the hybrid objective's λ follows it);
        `device`: the policy's (the default chunk); `micro_batch_size`: upstream's micro-batch."""
        g, a = args.growmtp, args
        joint = g.mode == "joint"
        loss_config = HeadLossConfig(objective=g.loss, vgm=g.vgm,
                                     chunk_cycles=None if joint else g.chunk_cycles or chunk_cycles_for(device),
                                     teacher_forcing=g.teacher_forcing, alpha_estimate=g.alpha_estimate,
                                     hybrid_lambda=hybrid_lambda(alpha_1) if g.loss == HYBRID else None,
                                     max_depth=int(g.k) if getattr(g, "committed_loss", False) else None)
        update = HeadUpdateConfig(loss_config=loss_config, joint=joint, hidden_batch_size=max(1, micro_batch_size))
        policy_steps = policy_steps_per_rl_step(a.rollout.batch_size, a.rollout.n_samples_per_prompt,
                                                a.train.batch_size, a.train.max_epochs)
        return cls(update, policy_steps, per_policy_step=g.head_update == "policy_step", log_lag=bool(g.log_lag),
                   dynamic_batching=bool(a.train.dynamic_batch_enable))


class HeadRLStep:
    """The head's part of one RL step (module docstring). `trainer`: upstream's actor-side PPO trainer;
    `optimizer`: the head group's run-time owner (`GrowMTPStrategy.head_optimizer`)."""

    def __init__(self, trainer, head, optimizer: HeadOptimizer, records: list[SequenceRecord],
                 cfg: HeadRLStepConfig):
        self.upstream = UpstreamActorTrainer(trainer)
        self.engine, self.head, self.optimizer = self.upstream.engine, head, optimizer
        self.records, self.cfg = records, cfg
        self.lockstep = Lockstep(distributed=True, backward=optimizer.backward, gathered=gathered_parameters)
        self.schedule: FirstWindow | OwnRecords | None = None  # chosen in start()
        self.hidden_states: HiddenStateSource | None = None  # chosen in start()
        self.cycles, self.lr = 0, 0.0
        self.cycles_per_head_step: float | None = None  # once upstream laid the step's windows out
        self.totals, self.epoch, self.micro_batches, self.head_epochs = HeadUpdateTotals(), 0, 0, set()
        # the head's own seconds in this RL step outside its updates: start, and around the policy's micro-batches
        self.overhead_s = 0.0

    def start(self) -> None:
        """Before the policy's first micro-batch: the RL step's LR, its schedule and its hidden states' source,
        agreed with the other ranks (and, for a forward of its own, that forward)."""
        cfg, began = self.cfg, time.perf_counter()
        self.lr = self.optimizer.start_rl_step()
        own_records = cfg.policy_steps > 1 and cfg.per_policy_step and not cfg.update.joint
        from_forward = not own_records and self._from_training_forward()
        if own_records or from_forward:
            self.schedule = OwnRecords(self.upstream)
        else:
            self.schedule = FirstWindow(self.upstream, len(self.records), cfg.update.joint)
        backbone = self.engine.module.model
        if from_forward:
            self.hidden_states = TrainingForward(backbone)
        else:
            self.hidden_states = OwnForward(backbone, self.records, cfg.update.hidden_batch_size, cfg.update.joint,
                                            self.lockstep, keep=cfg.log_lag)
        self.hidden_states.start()
        self.cycles = self.lockstep.total([sum(rec.num_cycles for rec in self.records)])[0]
        self.overhead_s += time.perf_counter() - began

    def _from_training_forward(self) -> bool:
        """Whether every rank reads H_p from the policy's own training forward this step (module docstring);
        joint mode (the head's loss reaches the backbone through a forward of its own), the lag probe (it
        reads H_p again after the step) and async training (both forwards read the policy being trained)
        never do."""
        cfg = self.cfg
        reason = ("joint mode" if cfg.update.joint else "the lag probe" if cfg.log_lag
                  else f"{cfg.policy_steps} policy steps per RL step" if cfg.policy_steps != 1
                  else "dynamic batching" if cfg.dynamic_batching
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
        began, updated_before = time.perf_counter(), self.totals.seconds
        if step == 0 and self.micro_batches:
            self.epoch += 1
        self.micro_batches += 1
        due = self.schedule.due(indices, self.epoch, step)  # None: no head update here
        with self.hidden_states.micro_batch(due, attention_mask, self.update):
            body_began, updated_at_body = time.perf_counter(), self.totals.seconds
            yield  # upstream's training step (before_policy_backward counts its own part)
            body_s, updated_in_body = time.perf_counter() - body_began, self.totals.seconds - updated_at_body
        if self.schedule.done(self.epoch, step):
            self.hidden_states.release()
        updates_outside_body = self.totals.seconds - updated_before - updated_in_body
        self.overhead_s += time.perf_counter() - began - body_s - updates_outside_body

    def before_policy_backward(self) -> None:
        """Between the micro-batch's policy forward and its backward (where H_p from that forward update)."""
        began, updating = time.perf_counter(), self.totals.seconds
        self.hidden_states.before_policy_backward()
        self.overhead_s += time.perf_counter() - began - (self.totals.seconds - updating)

    def metrics(self) -> dict[str, float]:
        """The RL step's head metrics (after the policy's micro-batches); counts this RL step done."""
        head_steps = self.optimizer.end_rl_step()
        metrics = self.totals.metrics()
        metrics.update(head_steps=float(head_steps), head_epochs=float(len(self.head_epochs)), head_lr=self.lr)
        metrics["time/head_overhead_s"] = self.overhead_s
        metrics.update(self.hidden_states.metrics())
        if not self.totals.finite:
            logger.warning("GrowMTP: the head loss was not finite in an optimizer step of this RL step; that "
                           "step's head update is skipped (the policy update is unaffected)")
        elif not self.optimizer.gradient_finite:
            metrics["head_finite"] = 0.0
            logger.warning("GrowMTP: the head's gradient was not finite (on some rank) in an optimizer step of this "
                           "RL step, its loss was; that head step is skipped, the head and its Adam state are left "
                           "as they were (the policy update is unaffected)")
        elif self.cfg.log_lag:
            # the updated head on the records of the policy it was trained for (see head_alpha_on)
            device = next(self.head.parameters()).device
            hiddens = [h.to(device) for h in self.hidden_states.of_records(range(len(self.records)))]
            with torch.random.fork_rng(devices=[]):
                metrics.update(head_alpha_on(self.head, self.records, hiddens, self.cfg.update, self.lockstep))
        return metrics

    # ---- one head update -----------------------------------------------------------------------------------
    def update(self, due: list[int], hiddens: list[torch.Tensor]) -> None:
        """The head update of these records in the current accumulation window. The head's optimizer step is
        that window's (the policy's) optimizer step: it steps the head group only if every update the window
        made was finite on every rank (`HeadOptimizer.updated`, `HeadOptimizer.steps_head`)."""
        if self.optimizer.open_window():
            self.lr = self.optimizer.lr()
        if not self.optimizer.finite:  # every rank agreed on it: all skip alike
            return
        if self.cycles_per_head_step is None:
            self.cycles_per_head_step = self.cycles / self.schedule.head_steps_per_epoch
        device = next(self.head.parameters()).device
        # The head update draws no random numbers, but upstream's data order must not depend on that.
        with torch.random.fork_rng(devices=[]):
            totals = update_head(self.head, [self.records[i] for i in due], [h.to(device) for h in hiddens],
                                 self.cfg.update, self.lockstep, self.engine.gradient_accumulation_steps(),
                                 self.cycles_per_head_step)
        self.optimizer.updated(totals.finite)
        self.head_epochs.add(self.epoch)
        self.totals.add(totals, first_visit=self.epoch == 0)
