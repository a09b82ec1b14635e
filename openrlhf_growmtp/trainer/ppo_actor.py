"""The policy actor and its actor-side PPO trainer (upstream: trainer/ray/ppo_actor.py).

One RL step on each policy rank: `ppo_train` unpacks the step's records, leaving an index in each
sample's Experience.info, and reads their hidden states from the rollout policy; upstream's `ppo_train`
then runs the policy's micro-batches (mini-batches, epochs, dynamic batching as configured), and before
each one's policy backward `train_draft_head` accumulates the head's gradients on that micro-batch's
records, so every policy optimizer step also steps the head's group; then `broadcast_to_vllm` sends the
policy's weights by upstream's path and the head's through Ray.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import deepspeed
import ray
import torch
import torch.distributed as dist
from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer, PolicyModelActor
from openrlhf.utils.distributed_util import torch_dist_barrier_and_cuda_sync

from .. import cpu_support
from ..core.records import SequenceRecord
from . import head_group, installer
from .args import policy_steps_per_rl_step
from .head_update import (HeadStepTotals, HeadUpdateConfig, all_ranks, head_alpha_on, rows_per_sample,
                          step_hidden_states, total_cycles, update_head)
from .keys import ACCEPTED_KEY, DROPPED_KEY, RECORD_INDEX_KEY, RECORD_KEY
from .loss import NegativeAdvantageWeightedLoss
from .strategy import gathered_head_state, head_of, without_head

logger = logging.getLogger("growmtp")

SNAPSHOT_FILE = "growmtp_head_snapshot.pt"  # head weights, rank-0 head Adam moments and head LR


class ActorTrainer(ActorPPOTrainer):
    """Upstream's actor-side PPO trainer with what any run of this CLI may add to it: the
    negative-advantage weight (`--growmtp_neg_adv_weight`), and, without CUDA (no NCCL), the policy's
    weights sent to the engines through Ray. With CUDA and weight 1 it is upstream's, unchanged."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        weight = getattr(getattr(self.args, "growmtp", None), "neg_adv_weight", 1.0)
        if weight != 1.0:
            self.actor_loss_fn = NegativeAdvantageWeightedLoss(self.actor_loss_fn, weight)

    def _init_vllm_sync_group(self, backend: str):
        if cpu_support.needed():
            return
        super()._init_vllm_sync_group(backend)

    def broadcast_to_vllm(self):
        if not cpu_support.needed():
            return super().broadcast_to_vllm()
        params = dict(self.actor.model.module.named_parameters())
        with deepspeed.zero.GatheredParameters(list(params.values())):
            state = {name: p.detach().cpu().clone() for name, p in params.items()} if dist.get_rank() == 0 else None
        self._send_to_engines("growmtp_load_target", state)

    def _send_to_engines(self, method: str, state: dict[str, torch.Tensor] | None) -> None:
        """Rank 0 sends `state` to every engine's `method` (RaySyncRolloutActor); all ranks meet after."""
        if state is not None:
            from vllm_patches.transport import dump_blob

            blob = ray.put(dump_blob(state))
            ray.get([getattr(engine, method).remote(blob) for engine in self.vllm_engines])
        torch_dist_barrier_and_cuda_sync()


@dataclass
class _HeadStep:
    """What the head needs through one RL step: its records, their hidden states, running totals."""

    records: list[SequenceRecord]
    hiddens: list[torch.Tensor]  # H_p [T, H] per record, from the rollout policy (read before any policy step)
    cfg: HeadUpdateConfig
    cycles: float  # this RL step's cycles on every rank
    from_forward: bool = False  # hiddens empty: each micro-batch's policy forward gives its records' H_p
    totals: HeadStepTotals = field(default_factory=HeadStepTotals)  # first epoch (each record's first visit)
    seconds: float = 0.0  # head work in every epoch
    cycles_per_step: float | None = None  # set at the first micro-batch (dynamic batching plans its steps then)
    whole: bool = False  # the head runs once over every record (one optimizer step per RL step, or joint mode)
    optimizer_steps: int = 0
    lr: float = 0.0  # the head's LR in the last optimizer step
    epoch: int = 0
    calls: int = 0
    window_finite: bool = True


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


class GrowMTPActorTrainer(ActorTrainer):
    """The actor-side trainer of a GrowMTP run: the head update in the policy's steps, and the head sync.

    Each sample's record rides in its Experience.info through upstream's shuffling, mini-batches, epochs
    and dynamic batching (as an index into the step's records). The head trains in every micro-batch on
    that micro-batch's records, before the policy's backward, in the same accumulation window: each
    policy optimizer step also takes one head step, on the records of its samples. The hidden states are
    the rollout policy's, read once before the first policy step (the policy moves after it).
    """

    _step: _HeadStep | None = None

    def ppo_train(self, kl_ctl: float):
        hf_model = self.actor.model.module
        head = head_of(hf_model)
        records = self._take_records()
        if head is None:  # a frozen head drafts in the engines only
            return super().ppo_train(kl_ctl)
        cfg, a = self._head_update_config(), self.args
        policy_steps = policy_steps_per_rl_step(a.rollout.batch_size, a.rollout.n_samples_per_prompt,
                                                a.train.batch_size, a.train.max_epochs)
        from_forward = self._hidden_states_from_training_forward(records, cfg, policy_steps)
        hiddens = []
        if not from_forward:
            with torch.random.fork_rng(devices=[]):  # upstream's RNG stream (its data order) untouched
                hiddens = step_hidden_states(hf_model.model, records, cfg)
            if not cfg.joint and policy_steps > 1:
                # kept through the policy's steps: off the accelerator until their micro-batch comes
                hiddens = [h.to("cpu") for h in hiddens]
        self._step = _HeadStep(records, hiddens, cfg, total_cycles(records), from_forward=from_forward)
        try:
            status = super().ppo_train(kl_ctl)
        finally:
            step, self._step = self._step, None
        metrics = step.totals.metrics()
        metrics.update(head_update_s=step.seconds, head_steps=float(step.optimizer_steps),
                       head_epochs=step.epoch + 1.0, head_lr=step.lr, head_hidden_from_forward=float(step.from_forward))
        if not step.totals.finite:
            logger.warning("GrowMTP: the head loss was not finite in an optimizer step of this RL step; that "
                           "step's head update is skipped (the policy update is unaffected)")
        elif self.args.growmtp.log_lag:
            # the updated head on the records of the policy it was trained for (see head_alpha_on)
            device = next(head.parameters()).device
            with torch.random.fork_rng(devices=[]):
                metrics.update(head_alpha_on(head, records, [h.to(device) for h in step.hiddens], cfg))
        status.update({f"growmtp/{key}": value for key, value in metrics.items()})
        return status

    def training_step(self, experience, kl_ctl, step, loss_batch_info=None):
        indices = experience.info.pop(RECORD_INDEX_KEY, None)
        if self._step is None:
            return super().training_step(experience, kl_ctl, step, loss_batch_info)
        if step == 0 and self._step.calls:
            self._step.epoch += 1
        self._step.calls += 1
        indices = [] if indices is None else [int(i) for i in indices]
        with contextlib.ExitStack() as stack:
            if self._step.from_forward:
                stack.enter_context(self._head_update_before_backward(indices, experience.attention_mask, stack))
            else:
                self.train_draft_head(indices)
                self._skip_head_step_unless_finite(stack)
            return super().training_step(experience, kl_ctl, step, loss_batch_info)

    def _skip_head_step_unless_finite(self, stack: contextlib.ExitStack) -> None:
        if not self._step.window_finite:  # keeps the head where it is through this window's optimizer step
            stack.enter_context(head_group.head_step_skipped(self.actor.model, self.actor_scheduler))

    def _hidden_states_from_training_forward(self, records: list[SequenceRecord], cfg: HeadUpdateConfig,
                                             policy_steps: int) -> bool:
        """Whether this RL step's head update reads H_p from the policy's own training forward instead of a
        forward of its own. Only where that forward is the rollout policy's over exactly the records'
        tokens: one policy optimizer step per RL step (every micro-batch runs the pre-update weights),
        every sample whole on its rank (no ring attention) and carrying a record of its own tokens; not
        in joint mode (the head's loss then reaches the backbone through its own forward), and not with
        the lag probe (which reads H_p again after the step). Under async training neither this nor the
        head's own forward is exactly the rollout policy's: both read the policy being trained. Every
        rank must agree: their head calls have to match under ZeRO-3."""
        reason = self._why_not_from_training_forward(records, cfg, policy_steps)
        agreed = all_ranks(reason is None)
        if reason is not None and reason.startswith("a sample"):
            logger.warning("GrowMTP: the head reads H_p from a policy forward of its own this step (%s)", reason)
        elif not agreed:
            logger.info("GrowMTP: the head reads H_p from a policy forward of its own this step (%s)",
                        reason or "another rank")
        return agreed

    def _why_not_from_training_forward(self, records: list[SequenceRecord], cfg: HeadUpdateConfig,
                                       policy_steps: int) -> str | None:
        a = self.args
        if cfg.joint:
            return "joint mode"
        if a.growmtp.log_lag:
            return "the lag probe"
        if policy_steps != 1:
            return f"{policy_steps} policy steps per RL step"
        if a.train.dynamic_batch_enable:
            return "dynamic batching"
        if self.strategy.ring_attn_group is not None:
            return "ring attention"
        if not records:
            return "no records"
        for item in self.replay_buffer.items:
            why = _record_mismatch(item, records)
            if why:
                return f"a sample whose tokens are not its record's: {why}"
        return None

    @contextlib.contextmanager
    def _head_update_before_backward(self, indices: list[int], attention_mask: torch.Tensor,
                                     stack: contextlib.ExitStack):
        """Within upstream's training step: keep the backbone's final hidden states of the policy's forward
        (detached), and run this micro-batch's head update on them when the policy's backward is called,
        before it (in the same accumulation window, as `train_draft_head` always runs)."""
        captured: list[torch.Tensor] = []
        backbone = self.actor.model.module.model
        hook = backbone.register_forward_hook(
            lambda module, args, output: captured.append(output.last_hidden_state.detach()))
        strategy = self.strategy

        def backward(*args, **kwargs):
            del strategy.backward  # upstream's again, for this call and the next micro-batch
            hook.remove()
            if len(captured) != 1:
                raise RuntimeError(f"GrowMTP: expected one policy forward before the backward, saw {len(captured)}")
            self.train_draft_head(indices, rows_per_sample(captured.pop(), attention_mask))
            self._skip_head_step_unless_finite(stack)
            return strategy.backward(*args, **kwargs)

        strategy.backward = backward
        try:
            yield
        finally:
            hook.remove()
            strategy.__dict__.pop("backward", None)

    def _take_records(self) -> list[SequenceRecord]:
        # Records must leave `info` before upstream's training step turns every info list into a tensor; an
        # int index into the returned list stays, and training_step takes it out of its micro-batch.
        records = []
        for item in self.replay_buffer.items:
            item.info.pop(ACCEPTED_KEY, None)
            item.info.pop(DROPPED_KEY, None)
            blob = item.info.pop(RECORD_KEY, None)
            if blob is not None:
                item.info[RECORD_INDEX_KEY] = len(records)
                records.append(SequenceRecord.unpack(blob))
        return records

    def _head_update_config(self) -> HeadUpdateConfig:
        g = self.args.growmtp
        return HeadUpdateConfig(kind=g.loss, vgm=g.vgm, chunk_cycles=g.chunk_cycles,
                                teacher_forcing=g.teacher_forcing, joint=g.mode == "joint",
                                hidden_batch_size=max(1, self.micro_train_batch_size))

    def _optimizer_steps_per_epoch(self) -> int:
        buffer = self.replay_buffer
        if self.args.train.dynamic_batch_enable:
            return max(1, sum(buffer.dynamic_optimizer_step))
        micro_batches = len(buffer) // buffer.sample_batch_size  # upstream's DataLoader drops the last partial one
        return max(1, math.ceil(micro_batches / self.strategy.accumulated_gradient))

    def train_draft_head(self, indices: list[int], hiddens: list[torch.Tensor] | None = None) -> None:
        """Accumulate the head loss of this micro-batch's records (`indices` into the step's records) into the
        head's gradients, before the policy's backward, in the same accumulation window.

        The optimizer step that closes the window also steps the head's group. Each step's head gradient
        is its cycles' summed loss over the RL step's mean cycles per optimizer step: exactly the mean loss
        when one optimizer step takes every record. Then (upstream's default layout) every record runs at
        the step's first micro-batch, in fewer and larger chunks; so does joint mode, whose one backbone
        graph needs it (args refuse joint with more than one policy step). `hiddens`: the micro-batch's
        samples' H_p from the policy's own forward (`_hidden_states_from_training_forward`); then each
        micro-batch runs its own records.
        """
        step, engine = self._step, self.actor.model
        if head_group.open_head_window(engine):
            step.optimizer_steps += 1
            step.window_finite = True
            step.lr = engine.optimizer.param_groups[head_group.head_group_index(engine.optimizer)]["lr"]
        if step.cycles_per_step is None:
            steps_per_epoch = self._optimizer_steps_per_epoch()
            step.cycles_per_step = step.cycles / steps_per_epoch
            # (not under optimizer offload: DeepSpeed moves a parameter's gradient to the host at the window's
            # last backward that reaches it, so there the head makes a backward in every micro-batch)
            step.whole = step.cfg.joint or (steps_per_epoch == 1 and self.max_epochs == 1 and not step.from_forward
                                            and not self.args.ds.adam_offload)
        if step.whole:  # one optimizer step takes every record: all of them at its first micro-batch
            if step.calls > 1:
                return
            indices = list(range(len(step.records)))
        if not step.window_finite:  # every rank agreed on it: all skip alike
            return
        device = next(head_of(engine.module).parameters()).device
        hiddens = [(step.hiddens[i] if hiddens is None else hiddens[n]).to(device) for n, i in enumerate(indices)]
        # The head update draws no random numbers, but upstream's data order must not depend on that.
        with torch.random.fork_rng(devices=[]):
            totals = update_head(head_of(engine.module), engine.module.model, [step.records[i] for i in indices],
                                 step.cfg, backward=head_group.head_backward(engine),
                                 gradient_accumulation=engine.gradient_accumulation_steps(), hiddens=hiddens,
                                 cycles_per_step=step.cycles_per_step)
        step.window_finite = totals.finite
        step.seconds += totals.seconds
        if step.whole and not self.args.growmtp.log_lag:
            step.hiddens = []  # used up: not held through the policy's micro-batches
        if step.epoch == 0:
            step.totals.add(totals)
        else:
            step.totals.finite = step.totals.finite and totals.finite

    def broadcast_to_vllm(self):
        hf_model = self.actor.model.module
        with without_head(hf_model):  # the policy's weights only, by upstream's path or through Ray
            super().broadcast_to_vllm()
        head = head_of(hf_model)
        if head is not None:
            self._send_to_engines("growmtp_load_head", gathered_head_state(head))


class PolicyActor(PolicyModelActor.__ray_actor_class__):
    """Upstream's policy actor building `trainer_cls` as its actor-side trainer."""

    trainer_cls: type = ActorTrainer

    def init_model_from_pretrained(self, strategy, pretrain, max_steps=None, vllm_engines=None):
        upstream = super().init_model_from_pretrained
        installer.install_worker(upstream.__func__.__globals__, self.trainer_cls)
        upstream(strategy, pretrain, max_steps, vllm_engines)


class GrowMTPPolicyActor(PolicyActor):
    """The policy actor of a GrowMTP run: its checkpoints carry a head snapshot (weights, Adam, LR)."""

    trainer_cls = GrowMTPActorTrainer

    def init_model_from_pretrained(self, strategy, pretrain, max_steps=None, vllm_engines=None):
        super().init_model_from_pretrained(strategy, pretrain, max_steps, vllm_engines)
        if self.checkpoint_states and head_of(self.actor.model.module) is not None:
            # an audit trail of what resume restored, next to what the checkpoint saved (SNAPSHOT_FILE)
            self._write_snapshot(Path(strategy.args.ckpt.path) / "_actor" / f"resumed_{SNAPSHOT_FILE}")

    def save_checkpoint(self, tag, client_states=None, metric_value=None, metric_key=None):
        super().save_checkpoint(tag, client_states, metric_value, metric_key)
        if head_of(self.actor.model.module) is not None and not self.disable_ds_ckpt:
            self._write_snapshot(Path(self.strategy.args.ckpt.path) / "_actor" / tag / SNAPSHOT_FILE)

    def _write_snapshot(self, path: Path) -> None:
        snapshot = self.growmtp_head_snapshot()
        if snapshot["rank"] == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(snapshot, path)

    def growmtp_head_snapshot(self) -> dict:
        """Gathered head weights (rank 0), this rank's head Adam moments and the head LR (tests, debugging)."""
        engine = self.actor.model
        optimizer = engine.optimizer
        return {"weights": gathered_head_state(head_of(engine.module)),
                "adam": head_group.head_optimizer_state(engine),
                "lr": optimizer.param_groups[head_group.head_group_index(optimizer)]["lr"],
                "rank": dist.get_rank()}
