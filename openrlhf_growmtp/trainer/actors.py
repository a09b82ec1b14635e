"""GrowMTP's subclasses of OpenRLHF's strategy, actor, trainers and rollout actor.

Data flow of one RL step (see DESIGN.md):
rollout actor (vLLM drafts with the head, records captured per request) -> response["growmtp_record"]
-> samples generator puts it in Experience.info -> Ray, replay buffer -> policy actor pops the records
before upstream's training step -> `train_draft_head` accumulates head gradients -> upstream's policy
backward and the single optimizer step -> weights and head sync to every engine.

Rebinding upstream names to these classes happens only in `installer`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections import defaultdict
from pathlib import Path

import deepspeed
import ray
import torch
import torch.distributed as dist

from openrlhf.models import Actor
from openrlhf.trainer.ppo_trainer import PPOTrainer
from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator
from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer, PolicyModelActor
from openrlhf.trainer.ray.vllm_engine import RolloutRayActor
from openrlhf.utils.deepspeed import DeepspeedStrategy
from openrlhf.utils.distributed_util import torch_dist_barrier_and_cuda_sync

from .. import cpu_support
from ..core.checkpoint import export_head, load_head
from ..core.metrics import acceptance_summary
from ..core.records import SequenceRecord
from ..core.schedule import HeadLRSchedule
from . import installer
from .args import resolve_head_lr
from .head_update import HeadUpdateConfig, update_head

logger = logging.getLogger("growmtp")

HEAD_ATTR = "mtp_head"  # the head's name inside the HF model DeepSpeed wraps
HEAD_EXPORT_DIR = "growmtp_head"  # next to an HF export
RECORD_KEY = "growmtp_record"  # packed SequenceRecord, per sample, in response dicts and Experience.info
ACCEPTED_KEY = "growmtp_accepted"  # per-cycle accepted counts, per sample (rollout metrics)
METRICS_FILE = "growmtp_metrics.jsonl"
SNAPSHOT_FILE = "growmtp_head_snapshot.pt"  # head weights, rank-0 head Adam moments and head LR


def _head_of(hf_model):
    return getattr(hf_model, HEAD_ATTR, None)


@contextlib.contextmanager
def without_head(hf_model):
    """Hide the head from module traversal (HF export, upstream's weight broadcast) for the duration."""
    head = hf_model._modules.pop(HEAD_ATTR, None)
    try:
        yield head
    finally:
        if head is not None:
            hf_model._modules[HEAD_ATTR] = head


def gathered_head_state(head) -> dict[str, torch.Tensor] | None:
    """Core-named head parameters, gathered from ZeRO-3 partitions; on rank 0 only (None elsewhere)."""
    params = dict(head.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        if dist.get_rank() != 0:
            return None
        return {name: p.detach().float().cpu().clone() for name, p in params.items()}


# ---- strategy ------------------------------------------------------------------------------------------
class GrowMTPStrategy(DeepspeedStrategy):
    """Upstream's strategy plus the head's own param group and LR schedule."""

    def _get_model_parameters(self, model, *, optim=None, weight_decay=0.0):
        raw_model, groups = super()._get_model_parameters(model, optim=optim, weight_decay=weight_decay)
        head = _head_of(raw_model)
        if head is None:
            return raw_model, groups
        if (optim or self.optim) == "muon":
            raise ValueError("GrowMTP's head group needs the Adam path; --actor.optim muon is not supported")
        head_ids = {id(p) for p in head.parameters()}
        for group in groups:
            group["params"] = [p for p in group["params"] if id(p) not in head_ids]
        groups = [group for group in groups if group["params"]]
        g = vars(self.args.growmtp)
        groups.append({"params": list(head.parameters()), "weight_decay": 0.0, "lr": resolve_head_lr(g),
                       "name": installer.HEAD_GROUP})
        return raw_model, groups

    def _ds_init_train_model(self, model, cfg):
        wrapped, optimizer, scheduler = super()._ds_init_train_model(model, cfg)
        engine = wrapped.model if isinstance(wrapped, Actor) else wrapped
        if _head_of(engine.module) is not None:
            g = self.args.growmtp
            schedule = HeadLRSchedule(total_steps=max(1, int(cfg["scheduler_steps"])),
                                      warmup_steps=g.warmup_steps, min_lr_ratio=g.min_lr_ratio)
            installer.attach_head_optimizer(engine, scheduler, schedule)
        return wrapped, optimizer, scheduler

    def save_model(self, model, tokenizer, output_dir, **kwargs) -> None:
        """Upstream's HF export without the head, plus the head as a standalone directory the engine loads."""
        hf_model = self._unwrap_model(model)
        with without_head(hf_model) as head:
            super().save_model(model, tokenizer, output_dir, **kwargs)
        if head is not None:
            params = list(head.parameters())
            with deepspeed.zero.GatheredParameters(params):
                if self.is_rank_0():
                    head.config.growmtp_trained_k = self.args.growmtp.k  # the evaluation CLI's default depth
                    export_head(head, Path(output_dir) / HEAD_EXPORT_DIR)
            torch_dist_barrier_and_cuda_sync()


def get_strategy(args):
    """Upstream's `get_strategy`, returning our subclass (it adds methods only, no state)."""
    from openrlhf.utils.utils import get_strategy as upstream_get_strategy

    strategy = upstream_get_strategy(args)
    strategy.__class__ = GrowMTPStrategy
    return strategy


# ---- the policy model and its trainer ------------------------------------------------------------------
class GrowMTPActor(Actor):
    """Upstream's Actor; the one built right after `attach_next(head_dir)` gets the head as a submodule."""

    _pending_head_dir: str | None = None

    @classmethod
    def attach_next(cls, head_dir: str | None) -> None:
        cls._pending_head_dir = head_dir

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        head_dir, GrowMTPActor._pending_head_dir = GrowMTPActor._pending_head_dir, None
        if head_dir is None:
            return
        hf_model = self.model
        dtype = next(hf_model.parameters()).dtype
        # The head binds the backbone's embedding and lm_head (never copies); ZeRO-3 partitions it with
        # the rest of the model because it is a submodule of what DeepSpeed wraps.
        # NOTE: building the head's layers draws from torch's global RNG, which upstream's data order
        # depends on (the replay-buffer shuffle); without fork_rng, detached runs drift from upstream's.
        with torch.random.fork_rng(devices=[]):
            head = load_head(head_dir, hf_model.get_input_embeddings(), hf_model.get_output_embeddings(),
                             dtype=dtype)
        hf_model.add_module(HEAD_ATTR, head)


class NegativeAdvantageWeightedLoss(torch.nn.Module):
    """Upstream's policy loss with the terms of negative-advantage tokens weighted by `weight`.

    Every branch of the PPO loss (clipped, dual-clipped, IS-corrected) is positively homogeneous in the
    advantage: scaling A by w > 0 scales that token's loss by w and changes no min/max/clip decision.
    So weighting the negative branch is exactly scaling negative advantages before upstream's loss.
    """

    def __init__(self, loss_fn: torch.nn.Module, weight: float):
        super().__init__()
        if not weight > 0:
            raise ValueError(f"the negative-advantage weight must be > 0, got {weight}")
        self.loss_fn, self.weight = loss_fn, weight

    def forward(self, log_probs, old_log_probs, advantages, *args, **kwargs):
        weighted = torch.where(advantages < 0, advantages * self.weight, advantages)
        return self.loss_fn(log_probs, old_log_probs, weighted, *args, **kwargs)


class BaseActorTrainer(ActorPPOTrainer):
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
            from vllm_patches.capture import dump_blob

            blob = ray.put(dump_blob(state))
            ray.get([getattr(engine, method).remote(blob) for engine in self.vllm_engines])
        torch_dist_barrier_and_cuda_sync()


class GrowMTPActorTrainer(BaseActorTrainer):
    """Upstream's actor-side PPO trainer plus the head update and the head sync."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._records: list[SequenceRecord] | None = None
        self._head_metrics: dict[str, float] = {}
        self._skip_head_step = False

    # ---- one RL step ----------------------------------------------------------------------------------
    def ppo_train(self, kl_ctl: float):
        # Records must leave `info` before upstream's training step turns every info list into a tensor.
        records = []
        for item in self.replay_buffer.items:
            item.info.pop(ACCEPTED_KEY, None)
            blob = item.info.pop(RECORD_KEY, None)
            if blob is not None:
                records.append(SequenceRecord.unpack(blob))
        head = _head_of(self.actor.model.module)
        self._records = records if head is not None else None
        self._head_metrics = {}
        try:
            status = super().ppo_train(kl_ctl)
        finally:
            self._records, self._skip_head_step = None, False
        status.update({f"growmtp/{key}": value for key, value in self._head_metrics.items()})
        return status

    def training_step(self, experience, kl_ctl, step, loss_batch_info=None):
        if self._records is not None:
            records, self._records = self._records, None
            self._head_metrics = self.train_draft_head(records)
        if not self._skip_head_step:
            return super().training_step(experience, kl_ctl, step, loss_batch_info)
        with installer.head_step_skipped(self.actor.model, self.actor_scheduler):
            return super().training_step(experience, kl_ctl, step, loss_batch_info)

    def train_draft_head(self, records: list[SequenceRecord]) -> dict[str, float]:
        """Accumulate the head loss of this RL step's records (this rank's share) into the head's gradients."""
        engine = self.actor.model
        hf_model = engine.module
        g = self.args.growmtp
        cfg = HeadUpdateConfig(kind=g.loss, vgm=g.vgm, chunk_cycles=g.chunk_cycles,
                               teacher_forcing=g.teacher_forcing, joint=g.mode == "joint",
                               hidden_batch_size=max(1, self.micro_train_batch_size))
        installer.begin_head_window(engine)
        metrics = update_head(_head_of(hf_model), hf_model.model, records, cfg,
                              backward=installer.head_backward(engine),
                              gradient_accumulation=engine.gradient_accumulation_steps())
        if not metrics["head_finite"]:
            logger.warning("GrowMTP: the head loss is not finite this step; the head update is skipped "
                           "(the policy update is unaffected)")
            self._skip_head_step = True
        optimizer = engine.optimizer
        metrics["head_lr"] = optimizer.param_groups[installer.head_group_index(optimizer)]["lr"]
        return metrics

    # ---- weight sync --------------------------------------------------------------------------------
    def broadcast_to_vllm(self):
        hf_model = self.actor.model.module
        with without_head(hf_model):  # the policy's weights only, by upstream's path or through Ray
            super().broadcast_to_vllm()
        head = _head_of(hf_model)
        if head is not None:
            self._send_to_engines("growmtp_load_head", gathered_head_state(head))


class BasePolicyActor(PolicyModelActor.__ray_actor_class__):
    """Upstream's policy actor building `trainer_cls` (and `actor_cls`, when set) instead of upstream's."""

    trainer_cls: type = BaseActorTrainer
    actor_cls: type | None = None

    def init_model_from_pretrained(self, strategy, pretrain, max_steps=None, vllm_engines=None):
        upstream = super().init_model_from_pretrained
        installer.install_worker(upstream.__func__.__globals__, self.trainer_cls, self.actor_cls)
        upstream(strategy, pretrain, max_steps, vllm_engines)


class GrowMTPPolicyActor(BasePolicyActor):
    trainer_cls = GrowMTPActorTrainer
    actor_cls = GrowMTPActor

    def init_model_from_pretrained(self, strategy, pretrain, max_steps=None, vllm_engines=None):
        g = strategy.args.growmtp
        GrowMTPActor.attach_next(g.head_dir if g.mode != "frozen" else None)
        super().init_model_from_pretrained(strategy, pretrain, max_steps, vllm_engines)
        if self.checkpoint_states and _head_of(self.actor.model.module) is not None:
            # an audit trail of what resume restored, next to what the checkpoint saved (SNAPSHOT_FILE)
            self._write_snapshot(Path(strategy.args.ckpt.path) / "_actor" / f"resumed_{SNAPSHOT_FILE}")

    def save_checkpoint(self, tag, client_states=None, metric_value=None, metric_key=None):
        super().save_checkpoint(tag, client_states, metric_value, metric_key)
        if _head_of(self.actor.model.module) is not None and not self.disable_ds_ckpt:
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
        return {"weights": gathered_head_state(_head_of(engine.module)),
                "adam": installer.head_optimizer_state(engine),
                "lr": optimizer.param_groups[installer.head_group_index(optimizer)]["lr"],
                "rank": dist.get_rank()}


# ---- rollouts ------------------------------------------------------------------------------------------
class RaySyncRolloutActor(RolloutRayActor.__ray_actor_class__):
    """Upstream's vLLM rollout actor with GrowMTP's worker extension (a subclass of upstream's), so that it
    can also load the policy's weights sent through Ray (`BaseActorTrainer` on CPU). fp32 on CPU."""

    async def __init__(self, *args, **kwargs):
        from vllm_patches.engine import WORKER_EXTENSION

        if cpu_support.activate():
            kwargs["dtype"] = "float32"
        kwargs["worker_extension_cls"] = WORKER_EXTENSION
        await super().__init__(*args, **kwargs)

    async def growmtp_load_target(self, blob: bytes) -> int:
        loaded = (await self.llm.collective_rpc("growmtp_load_target_weights", args=(blob,)))[0]
        await self.llm.reset_prefix_cache()
        return loaded


class GrowMTPRolloutActor(RaySyncRolloutActor):
    """Upstream's vLLM rollout actor with speculative decoding by the GrowMTP head and record capture.

    `make_rollout_actor(options)` returns the configured Ray actor class the installer rebinds.
    """

    growmtp: dict = {}

    async def __init__(self, *args, **kwargs):
        from vllm_patches.engine import check_speculative_config, speculative_config

        g = self.growmtp
        # The capture hooks target the V1 model runner (vLLM picks V2 where Triton works).
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        config = speculative_config(g["head_dir"], g["k"])
        check_speculative_config(config)
        kwargs["speculative_config"] = config
        await super().__init__(*args, **kwargs)
        await self.llm.collective_rpc("growmtp_configure_capture", args=(True, g["topk"], "bfloat16", False, False))
        self._finished: dict[tuple, list] = defaultdict(list)  # committed tokens -> finished RequestOutputs
        self._entries: dict[str, list[dict]] = defaultdict(list)  # request id -> drained capture entries

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        from vllm_patches.engine import check_sampling_params

        check_sampling_params(sampling_params, capture=True)
        output = await super().generate(prompt_token_ids, sampling_params, multi_modal_data)
        key = tuple(output.prompt_token_ids) + tuple(output.outputs[0].token_ids)
        self._finished[key].append((output, float(sampling_params.temperature)))
        return output

    async def generate_responses(self, *args, **kwargs):
        responses = await super().generate_responses(*args, **kwargs)
        await self._drain()
        for response in responses:
            record = self._record_for(response)
            response[RECORD_KEY] = record.pack()
            response[ACCEPTED_KEY] = record.accepted.tolist()
        return responses

    async def _drain(self) -> None:
        from vllm_patches.capture import load_blob
        from vllm_patches.engine import entries_by_request

        blob = (await self.llm.collective_rpc("growmtp_drain_records"))[0]
        for request_id, entry in entries_by_request(load_blob(blob)).items():
            self._entries[request_id].append(entry)

    def _record_for(self, response) -> SequenceRecord:
        from vllm_patches.engine import join_records

        key = tuple(response["observation_tokens"])
        if not self._finished.get(key):
            raise RuntimeError("GrowMTP: a response has no matching vLLM output (multi-turn executors and "
                               "responses edited after generation are not supported)")
        output, temperature = self._finished[key].pop(0)
        if not self._finished[key]:
            del self._finished[key]
        parts = self._entries.pop(output.request_id, [])
        entry = {name: torch.cat([p[name] for p in parts]) for name in parts[0]} if parts else {}
        return join_records([output], {output.request_id: entry}, [temperature], self.growmtp["k"])[0]

    async def growmtp_load_head(self, blob: bytes) -> list[str]:
        return (await self.llm.collective_rpc("growmtp_load_head_weights", args=(blob,)))[0]

    async def growmtp_head_state(self) -> dict[str, torch.Tensor]:
        from vllm_patches.capture import load_blob

        return load_blob((await self.llm.collective_rpc("growmtp_head_state"))[0])


def make_rollout_actor(options: dict):
    """A Ray actor class of GrowMTPRolloutActor carrying this run's options (k, head_dir, topk)."""
    configured = type("GrowMTPRolloutActor", (GrowMTPRolloutActor,), {"growmtp": dict(options)})
    return ray.remote(configured)


class GrowMTPSamplesGenerator(SamplesGenerator):
    """Carries each sample's record into its Experience.info, and times the rollout."""

    last_rollout_s: float = 0.0

    def generate_samples(self, **generate_kwargs):
        began = time.perf_counter()
        result = super().generate_samples(**generate_kwargs)
        self.last_rollout_s = time.perf_counter() - began
        return result

    def _process_response_into_experience(self, response, **generate_kwargs):
        experience = super()._process_response_into_experience(response, **generate_kwargs)
        experience.info[RECORD_KEY] = [response[RECORD_KEY]]
        experience.info[ACCEPTED_KEY] = [response[ACCEPTED_KEY]]
        return experience


@ray.remote
class GrowMTPPPOTrainer(PPOTrainer.__ray_actor_class__):
    """Upstream's controller with GrowMTP's samples generator and per-step GrowMTP metrics."""

    def __init__(self, pretrain, strategy, *args, **kwargs):
        super().__init__(pretrain, strategy, *args, **kwargs)
        self.samples_generator = GrowMTPSamplesGenerator(
            strategy=strategy, prompts_dataloader=self.prompts_dataloader, eval_dataloader=self.eval_dataloader,
            tokenizer=self.tokenizer, vllm_engines=self.vllm_engines)
        self.metrics_path = Path(strategy.args.ckpt.path) / METRICS_FILE

    def train_step(self, rollout_samples, global_step):
        rollout = self._rollout_metrics(rollout_samples)
        began = time.perf_counter()
        status, next_step = super().train_step(rollout_samples, global_step)
        rollout["growmtp/rollout_s"] = self.samples_generator.last_rollout_s
        rollout["growmtp/train_step_s"] = time.perf_counter() - began
        rollout["growmtp/step_s"] = rollout["growmtp/rollout_s"] + rollout["growmtp/train_step_s"]
        if self.args.growmtp.check_sync and self.args.growmtp.mode != "frozen":
            rollout.update(self._check_head_sync())
        status.update(rollout)
        self._report(next_step, status)
        return status, next_step

    def _check_head_sync(self) -> dict[str, float]:
        """Max |engine - trainer| over the head parameters every engine exposes (after this step's sync)."""
        snapshots = ray.get(self.actor_model_group.async_run_method(method_name="growmtp_head_snapshot"))
        trainer = next(s["weights"] for s in snapshots if s["weights"] is not None)
        worst, compared = 0.0, 0
        for state in ray.get([engine.growmtp_head_state.remote() for engine in self.vllm_engines]):
            for name, tensor in state.items():
                worst = max(worst, float((tensor.float() - trainer[name]).abs().max()))
                compared += 1
        return {"growmtp/head_sync_max_diff": worst, "growmtp/head_sync_params": float(compared)}

    def _rollout_metrics(self, samples) -> dict[str, float]:
        k = self.args.growmtp.k
        accepted = [torch.tensor(acc, dtype=torch.long) for s in samples for acc in s.info.get(ACCEPTED_KEY, [])]
        summary = acceptance_summary(torch.cat(accepted) if accepted else torch.zeros(0, dtype=torch.long), k)
        record_bytes = sum(len(blob) for s in samples for blob in s.info.get(RECORD_KEY, []))
        generated = float(sum(s.response_length.sum().item() for s in samples))
        metrics = summary.as_dict("growmtp/")
        metrics["growmtp/record_bytes_per_token"] = record_bytes / max(generated, 1.0)
        return metrics

    def _report(self, step: int, status: dict) -> None:
        row = {"step": step, **{key: value for key, value in status.items()
                                if key.startswith(("growmtp/", "rollout/", "timing/"))
                                or key in ("policy_loss", "reward", "actor_grad_norm", "actor_lr")}}
        alpha = [row[key] for key in sorted(row) if key.startswith("growmtp/alpha_")]
        logger.warning(
            "GrowMTP step %d: tau=%.3f alpha=[%s] cycles=%d head_loss=%.4f head_lr=%.2e rollout=%.2fs "
            "head_update=%.2fs step=%.2fs record_bytes/token=%.0f", step, row.get("growmtp/tau", 0.0),
            " ".join(f"{a:.2f}" for a in alpha), row.get("growmtp/cycles", 0), row.get("growmtp/head_loss", 0.0),
            row.get("growmtp/head_lr", 0.0), row.get("growmtp/rollout_s", 0.0), row.get("growmtp/head_update_s", 0.0),
            row.get("growmtp/step_s", 0.0), row.get("growmtp/record_bytes_per_token", 0.0))
        self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row, default=float) + "\n")
