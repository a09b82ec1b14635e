"""The policy actor and its actor-side PPO trainer (upstream: trainer/ray/ppo_actor.py).

One RL step on each policy rank: `ppo_train` takes the step's records out of the replay buffer (an index
into them stays in each sample's Experience.info), hands them to the RL step's `HeadRLStep` (`head_step/`),
starts it and registers its `before_policy_backward` at the strategy's seam; upstream's `ppo_train` then runs
the policy's micro-batches (mini-batches, epochs, dynamic batching as configured), each inside the head RL
step's `micro_batch`; then `broadcast_to_vllm` sends the policy's weights by upstream's path and the head's
through Ray. The policy actor's checkpoints carry a head snapshot (weights, Adam state, LR) beside upstream's.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer, PolicyModelActor
from openrlhf.utils.distributed_util import torch_dist_barrier_and_cuda_sync

from .. import cpu_support, device_memory, reproducibility
from ..core.draft_vocab import check_drafted_over
from ..core.lockstep import Lockstep
from ..core.records import RecordError, SequenceRecord
from ..core.validation import decode_record
from . import installer
from .draft_vocab_sync import actor_draft_vocab
from .engine_sync import loaded_all, nonfinite_head, send_to_engines
from .head_step.deepspeed_patches import head_lr, head_optimizer_state
from .head_step.head_rl_step import HeadRLStep, HeadRLStepConfig
from .keys import RECORD_INDEX_KEY, RECORD_KEY
from .negative_advantage_loss import NegativeAdvantageWeightedLoss
from .resume import ACTOR_DIR, SNAPSHOT_FILE, publish_latest
from .strategy import gathered_head_state, head_of, without_head

logger = logging.getLogger("growmtp")

SYNC_THROUGH_RAY = "ray"  # --vllm.sync_backend value: the policy's weights through Ray, not an NCCL group
ALPHA_1_STATE = "growmtp_alpha_1"  # in the checkpoint's client states: GrowMTPActorTrainer.alpha_1


class ActorTrainer(ActorPPOTrainer):
    """Upstream's actor-side PPO trainer with what any run of this CLI may add to it: the
    negative-advantage weight (`--growmtp_neg_adv_weight`), the step's memory per training device
    (`growmtp/mem_trainer_*`), and, without CUDA (no NCCL) or under `--vllm.sync_backend ray`, the policy's
    weights sent to the engines through Ray. With CUDA and weight 1 it trains as upstream's."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        weight = getattr(getattr(self.args, "growmtp", None), "neg_adv_weight", 1.0)
        if weight != 1.0:
            self.actor_loss_fn = NegativeAdvantageWeightedLoss(self.actor_loss_fn, weight)

    def ppo_train(self, kl_ctl: float):
        status = super().ppo_train(kl_ctl)
        status.update(self._memory_metrics())
        return status

    def _memory_metrics(self) -> dict[str, float]:
        """The largest peak (since the rank started) and in-use memory of any training rank's device, in GiB."""
        reading = device_memory.reading()
        values = torch.tensor([reading["peak_gib"], reading["used_gib"]], dtype=torch.float64,
                              device=next(self.actor.model.parameters()).device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        return {"growmtp/mem_trainer_peak_gib": float(values[0]), "growmtp/mem_trainer_used_gib": float(values[1])}

    def _init_vllm_sync_group(self, backend: str):
        if not self._sync_through_ray():
            super()._init_vllm_sync_group(backend)

    def _sync_through_ray(self) -> bool:
        """Weights go to the engines through Ray's object store: always without CUDA (no NCCL), and on a GPU
        under `--vllm.sync_backend ray` (the fallback for upstream's NCCL group)."""
        return cpu_support.needed() or getattr(self.args.vllm, "sync_backend", "nccl") == SYNC_THROUGH_RAY

    def broadcast_to_vllm(self):
        if not self._sync_through_ray():
            return super().broadcast_to_vllm()
        params = dict(self.actor.model.module.named_parameters())
        with deepspeed.zero.GatheredParameters(list(params.values())):
            state = {name: p.detach().cpu().clone() for name, p in params.items()} if dist.get_rank() == 0 else None
        expected = None if state is None else len(state)
        send_to_engines(self.vllm_engines, "growmtp_load_target", state,
                        lambda loaded: None if loaded == expected else f"loaded {loaded} of {expected} tensors")
        torch_dist_barrier_and_cuda_sync()


class GrowMTPActorTrainer(ActorTrainer):
    """The actor-side trainer of a GrowMTP run: the head's part of each RL step (`HeadRLStep`), and the
    head's sync into the engines.

    Each sample's record rides in its Experience.info through upstream's shuffling, mini-batches, epochs
    and dynamic batching, as an index into the RL step's records (`_take_records`).
    """

    head_rl_step: HeadRLStep | None = None
    # the realised acceptance rate at the first draft position of the last RL step's rollouts (the engine's
    # counts, over every rank's records): the hybrid objective's λ follows it; 0 before the first rollout
    alpha_1: float = 0.0
    head_sync_s: float = 0.0  # the last head sync's seconds (reported with the next RL step's metrics)
    head_changed: bool = True  # the head stepped since the engines last received it (a resumed head counts)

    def ppo_train(self, kl_ctl: float):
        began = time.perf_counter()
        records = self._take_records()
        took_records_s = time.perf_counter() - began
        head = head_of(self.actor.model.module)
        if head is None:  # a frozen head drafts in the engines only
            return super().ppo_train(kl_ctl)
        check_drafted_over(records, head.draft_vocab)
        cfg = HeadRLStepConfig.from_args(self.args, self.alpha_1, next(self.actor.model.parameters()).device,
                                         self.micro_train_batch_size)
        step = self.head_rl_step = HeadRLStep(self, head, self.strategy.head_optimizer, records, cfg)
        try:
            step.start()
            with self.strategy.before_policy_backward(step.before_policy_backward):
                status = super().ppo_train(kl_ctl)
        finally:
            self.head_rl_step = None
        began = time.perf_counter()
        metrics = step.metrics()
        self.head_changed = self.head_changed or metrics["head_steps"] > 0  # every rank counts the same steps
        status.update({f"growmtp/{key}": value for key, value in metrics.items()})
        hybrid = cfg.update.loss_config.hybrid_lambda
        if hybrid is not None:
            status["growmtp/hybrid_lambda"] = hybrid
        self.alpha_1 = realised_alpha_1(records, step.lockstep)
        status.update({"growmtp/time/take_records_s": took_records_s,
                       "growmtp/time/head_metrics_s": time.perf_counter() - began,
                       "growmtp/time/head_sync_s": self.head_sync_s})  # the previous step's sync
        return status

    def training_step(self, experience, kl_ctl, step, loss_batch_info=None):
        indices = experience.info.pop(RECORD_INDEX_KEY, None)
        if self.head_rl_step is None:
            return super().training_step(experience, kl_ctl, step, loss_batch_info)
        indices = [] if indices is None else [int(i) for i in indices]
        with self.head_rl_step.micro_batch(indices, experience.attention_mask, step):
            return super().training_step(experience, kl_ctl, step, loss_batch_info)

    def _take_records(self) -> list[SequenceRecord]:
        return take_records(self.replay_buffer.items, Lockstep(distributed=True))

    def broadcast_to_vllm(self):
        hf_model = self.actor.model.module
        with without_head(hf_model):  # the policy's weights only, by upstream's path or through Ray
            super().broadcast_to_vllm()
        head = head_of(hf_model)
        if head is not None and self.head_changed:  # a head that did not step is the engines' already
            began = time.perf_counter()
            state = gathered_head_state(head)  # rank 0's; None elsewhere
            send_to_engines(self.vllm_engines, "growmtp_load_head", state, loaded_all(state or {}),
                            refuse=nonfinite_head)
            torch_dist_barrier_and_cuda_sync()
            self.head_sync_s, self.head_changed = time.perf_counter() - began, False


def take_records(items, lockstep: Lockstep) -> list[SequenceRecord]:
    """The RL step's records out of its samples' `info` (`items`: the replay buffer's), decoded and checked
    (`validation.decode_record`) before any loss. A record that does not decode or check stops every rank at once
    (`lockstep`: the data-parallel ranks), the one that holds it naming its request."""
    # Records must leave `info` before upstream's training step turns every info list into a tensor; an int index
    # into the returned list stays, and training_step takes it out of its micro-batch.
    records, error = [], ""
    for item in items:
        packed = item.info.pop(RECORD_KEY, None)  # a PackedRecord (keys.py)
        if packed is not None and not error:
            item.info[RECORD_INDEX_KEY] = len(records)
            request = packed.request
            name = f"request {request!r}" if request is not None else f"record {len(records)} of this rank"
            try:
                records.append(decode_record(packed.blob, name))
            except RecordError as err:
                error = f"GrowMTP: a record of this RL step refused before any loss: {err}"
    if not lockstep.every(not error):
        raise RecordError(error or "GrowMTP: a record of this RL step was refused on another data-parallel rank (its "
                                   "log names the request)")
    return records


def realised_alpha_1(records: list[SequenceRecord], lockstep: Lockstep) -> float:
    """The share of every rank's cycles whose first draft was accepted (0 without cycles)."""
    accepted, cycles = lockstep.total([sum(int((rec.accepted >= 1).sum()) for rec in records),
                                       sum(rec.num_cycles for rec in records)])
    return accepted / cycles if cycles else 0.0


class PolicyActor(PolicyModelActor.__ray_actor_class__):
    """Upstream's policy actor building `trainer_cls` as its actor-side trainer."""

    trainer_cls: type = ActorTrainer

    def _setup_distributed(self, strategy):
        super()._setup_distributed(strategy)  # upstream's enable_full_determinism runs here, with the flag
        if strategy.args.train.full_determinism_enable:
            reproducibility.apply_torch_ingredients()

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
            self.trainer.alpha_1 = float(self.checkpoint_states.get(ALPHA_1_STATE, 0.0))
            changed = strategy.head_optimizer.resumed()  # the head's LR schedule is this run's flags'
            if changed and dist.get_rank() == 0:
                logger.warning("GrowMTP: resumed with this run's head LR schedule, not the checkpoint's (the "
                               "completed RL steps carry over): %s", "; ".join(changed))
            # an audit trail of what resume restored, next to what the checkpoint saved (SNAPSHOT_FILE)
            self._write_snapshot(Path(strategy.args.ckpt.path) / ACTOR_DIR / f"resumed_{SNAPSHOT_FILE}")

    def save_checkpoint(self, tag, client_states=None, metric_value=None, metric_key=None):
        """Upstream's checkpoint, then the head snapshot beside it, then `latest` naming it (the strategy holds
        DeepSpeed's back): a save cut short anywhere leaves `latest` naming the tag it named before. Upstream
        rotates before it saves, so that tag may be gone (`--ckpt.max_num 1`, or evicted by its eval metric or
        `--ckpt.max_mem`); the startup check then refuses the resume, listing the checkpoints left."""
        client_states = {**(client_states or {}), ALPHA_1_STATE: self.trainer.alpha_1}
        super().save_checkpoint(tag, client_states, metric_value, metric_key)
        if head_of(self.actor.model.module) is not None and not self.disable_ds_ckpt:
            actor_dir = Path(self.strategy.args.ckpt.path) / ACTOR_DIR
            self._write_snapshot(actor_dir / tag / SNAPSHOT_FILE)
            if dist.get_rank() == 0:
                publish_latest(actor_dir, tag)
            torch_dist_barrier_and_cuda_sync()

    def _write_snapshot(self, path: Path) -> None:
        snapshot = self.growmtp_head_snapshot()
        if snapshot["rank"] == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(path.name + ".partial")  # never a half-written snapshot under its name
            torch.save(snapshot, partial)
            os.replace(partial, path)

    def growmtp_set_draft_vocab(self, ids: list[int], tag: str) -> None:
        """The draft vocabulary the rollout this RL step trains on was drafted over: the head's q from now on."""
        head = head_of(self.actor.model.module)
        if head is not None:
            head.draft_vocab = actor_draft_vocab(ids, tag, head.config.vocab_size)

    def growmtp_head_snapshot(self) -> dict:
        """Gathered head weights (rank 0), this rank's head Adam moments, the head LR and the last realised α_1
        (tests, debugging)."""
        engine = self.actor.model
        return {"weights": gathered_head_state(head_of(engine.module)),
                "adam": head_optimizer_state(engine), "lr": head_lr(engine),
                "alpha_1": self.trainer.alpha_1, "rank": dist.get_rank()}
