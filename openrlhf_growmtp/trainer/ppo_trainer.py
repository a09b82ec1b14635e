"""The controllers (upstream: trainer/ppo_trainer.py).

- `OrderedPPOTrainer`: a plain (K = 0) run's: upstream's, with the samples generator that makes rollouts
  reproducible under `--train.full_determinism_enable`, and the per-step times and memory a GrowMTP run logs
  too (`StepMetrics`), so that the two arms of a comparison log the same rollout and step metrics;
- `GrowMTPPPOTrainer`: a GrowMTP run's, with GrowMTP's samples generator and the per-step GrowMTP metrics
  (console line, upstream's loggers, `<ckpt.path>/growmtp_metrics.jsonl`), and each evaluation's acceptance
  (`eval_growmtp/*`: upstream's eval loggers, `<ckpt.path>/growmtp_eval_metrics.jsonl`). `GrowMTPStepMetrics`
  is shared with the async controller's training actor (`ppo_trainer_async`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import ray
import transformers
from openrlhf.trainer.ppo_trainer import PPOTrainer

from ..core.metrics import acceptance_summary
from .draft_vocab_sync import DraftVocabRanking
from .keys import accepted_counts, packed_records
from .samples_generator import GrowMTPSamplesGenerator, OrderedSamplesGenerator

logger = logging.getLogger("growmtp")

METRICS_FILE = "growmtp_metrics.jsonl"
EVAL_METRICS_FILE = "growmtp_eval_metrics.jsonl"  # one row per evaluation: its acceptance (eval_growmtp/*)
SUPERSEDED_FILE = "growmtp_metrics.superseded.jsonl"  # rows of steps a resumed run logs again (superseded(...))
# Below this share of the policy's mass in the recorded top-k the update's α may differ from the true one by
# more than the differences between objectives (docs/from_scratch.md).
TRUSTED_TOPK_MASS = 0.99


class StepMetrics:
    """What any run of this launcher adds to the upstream class that runs its RL steps (the synchronous
    controller, or the async mode's training actor): the step's times, the engines' memory, and the report
    (console line, `<ckpt.path>/growmtp_metrics.jsonl`; upstream's loggers get the same keys). Mixed in
    before upstream's class, whose `train_step` it wraps."""

    def _init_step_metrics(self, args) -> None:
        self.metrics_path = Path(args.ckpt.path) / METRICS_FILE
        self.eval_metrics_path = Path(args.ckpt.path) / EVAL_METRICS_FILE
        self._warned_topk_mass = False

    def init_checkpoint_states(self):
        """Upstream's; the metrics rows of steps after the one the run starts from move aside first (a run cut
        short between logging a step and saving its checkpoint logged it; the resumed run logs it again)."""
        states = super().init_checkpoint_states()
        step = int(states.get("global_step", 0))
        for path in (self.metrics_path, self.eval_metrics_path):  # the steps' rows and the evaluations'
            moved = set_aside_rows_after(path, step)
            if moved:
                logger.warning("GrowMTP: %d row(s) of %s are of steps after step %d, where this run starts; moved "
                               "to %s", moved, path, step, superseded(path).name)
        return states

    def train_step(self, rollout_samples, global_step):
        rollout = self._rollout_metrics(rollout_samples)
        rollout.update(self._engine_memory())  # after the rollout, before the engines may sleep again
        ranking = getattr(self, "draft_vocab_ranking", None)
        if ranking is not None:
            rollout.update(ranking.before_step(rollout_samples))
        began = time.perf_counter()
        status, next_step = super().train_step(rollout_samples, global_step)
        rollout["growmtp/train_step_s"] = time.perf_counter() - began
        if ranking is not None:  # after the step's weight sync: the next rollout's vocabulary
            ranking.after_step(rollout_samples)
        generator = getattr(self, "samples_generator", None)
        if generator is not None:  # synchronous: the rollout ran just before this step (async: alongside it)
            rollout["growmtp/rollout_s"] = generator.last_rollout_s
            rollout["growmtp/step_s"] = rollout["growmtp/rollout_s"] + rollout["growmtp/train_step_s"]
        rollout.update(self._after_sync())
        status.update(rollout)
        self._report(next_step, status)
        return status, next_step

    def _rollout_metrics(self, samples) -> dict[str, float]:
        return {}

    def _after_sync(self) -> dict[str, float]:
        return {}

    def _engine_memory(self) -> dict[str, float]:
        """The largest peak and in-use memory over every rank of every engine (`device_memory`), in GiB."""
        ranks = [rank for engine in ray.get([e.growmtp_memory.remote() for e in self.vllm_engines or []])
                 for rank in engine]
        if not ranks:
            return {}
        return {"growmtp/mem_engine_peak_gib": max(r["peak_gib"] for r in ranks),
                "growmtp/mem_engine_used_gib": max(r["used_gib"] for r in ranks),
                "growmtp/mem_engine_total_gib": max(r["total_gib"] for r in ranks)}

    def _report(self, step: int, status: dict) -> None:
        row = self._row(step, status)
        logger.warning("GrowMTP step %d (autoregressive): rollout=%.2fs train=%.2fs step=%.2fs", step,
                       row.get("growmtp/rollout_s", 0.0), row.get("growmtp/train_step_s", 0.0),
                       row.get("growmtp/step_s", 0.0))

    def _row(self, step: int, status: dict) -> dict:
        """The step's row of growmtp_metrics.jsonl, appended."""
        row = {"step": step, **{key: value for key, value in status.items()
                                if key.startswith(("growmtp/", "rollout/", "timing/"))
                                or key in ("policy_loss", "reward", "actor_grad_norm", "actor_lr")}}
        self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row, default=float) + "\n")
        return row


class GrowMTPStepMetrics(StepMetrics):
    """What a GrowMTP run adds: τ and α from the step's rollouts, the records checked against vLLM's own
    counters, the head's sync check, and GrowMTP's console line."""

    def _after_sync(self) -> dict[str, float]:
        if self.args.growmtp.check_sync and self.args.growmtp.mode != "frozen":
            return self._check_head_sync()
        return {}

    def _warn_topk_mass(self, mass: float | None) -> None:
        """Once per run: the recorded top-k holds too little of the policy's mass for α to be trusted."""
        if mass is None or mass >= TRUSTED_TOPK_MASS or self._warned_topk_mass:
            return
        self._warned_topk_mass = True
        logger.warning("GrowMTP: the recorded top-%d holds %.3f of the policy's mass (below %.2f): the head update's "
                       "alpha is off by up to %.3f (growmtp/alpha_gap_k shows by how much); raise --growmtp_topk "
                       "(4x the top-k cut the measured alpha bias by 2-4x for 4x the record bytes; README)",
                       self.args.growmtp.topk, mass, TRUSTED_TOPK_MASS, 1.0 - mass)

    def _check_head_sync(self) -> dict[str, float]:
        """Max |engine - trainer| over the head parameters every rank of every engine exposes (after this
        step's sync); `head_sync_params` counts them, summed over engines and ranks."""
        from vllm_patches.transport import dump_blob

        snapshots = ray.get(self.actor_model_group.async_run_method(method_name="growmtp_head_snapshot"))
        blob = dump_blob(next(s["weights"] for s in snapshots if s["weights"] is not None))
        ranks = [rank for engine in ray.get([e.growmtp_head_sync_diff.remote(blob) for e in self.vllm_engines])
                 for rank in engine]
        return {"growmtp/head_sync_max_diff": max(r["max_diff"] for r in ranks),
                "growmtp/head_sync_params": float(sum(r["params"] for r in ranks))}

    def _rollout_metrics(self, samples) -> dict[str, float]:
        generator = getattr(self, "samples_generator", None)
        depth = generator.depth if generator is not None else self.args.growmtp.k  # drafted at (auto: per rollout)
        records, accepted = packed_records(samples), accepted_counts(samples)
        summary = acceptance_summary(accepted, depth)
        record_bytes = sum(len(record.blob) for record in records)
        generated = float(sum(s.response_length.sum().item() for s in samples))
        metrics = summary.as_dict("growmtp/")
        # the share of generated tokens that came out of drafting cycles (records come only from those)
        metrics["growmtp/drafted_share"] = float((accepted + 1).sum()) / max(generated, 1.0) if depth else 0.0
        if getattr(generator, "depth_controller", None) is not None:
            metrics.update(generator.depth_controller.metrics())
        metrics["growmtp/record_bytes_per_token"] = record_bytes / max(generated, 1.0)
        if generator is not None:
            metrics["growmtp/time/record_rollout_s"] = generator.record_s
        metrics["growmtp/dropped_cycles"] = float(sum(record.dropped for record in records))
        checked = [record.checked for record in records]
        metrics["growmtp/records"] = float(len(checked))
        metrics["growmtp/records_checked"] = float(sum(bool(flag) for flag in checked))
        if metrics["growmtp/records_checked"] < len(checked):  # settings.spec_engine_kwargs asks vLLM for them
            logger.warning("GrowMTP: %d of %d records of this step were not compared with vLLM's per-request counts "
                           "(vLLM returned none with their outputs)", len(checked) - metrics["growmtp/records_checked"],
                           len(checked))
        return metrics

    def _report(self, step: int, status: dict) -> None:
        self._warn_topk_mass(status.get("growmtp/head_topk_mass"))
        row = self._row(step, status)
        depth = int(row.get("growmtp/depth", self.args.growmtp.k))  # the engine's alpha_1..alpha_depth
        alpha = [row.get(f"growmtp/alpha_{k}", 0.0) for k in range(1, depth + 1)]
        logger.warning(
            "GrowMTP step %d: tau=%.3f depth=%d alpha=[%s] cycles=%d head_loss=%.4f head_lr=%.2e rollout=%.2fs "
            "head_update=%.2fs step=%.2fs record_bytes/token=%.0f", step, row.get("growmtp/tau", 0.0), depth,
            " ".join(f"{a:.2f}" for a in alpha), row.get("growmtp/cycles", 0), row.get("growmtp/head_loss", 0.0),
            row.get("growmtp/head_lr", 0.0), row.get("growmtp/rollout_s", 0.0), row.get("growmtp/head_update_s", 0.0),
            row.get("growmtp/step_s", 0.0), row.get("growmtp/record_bytes_per_token", 0.0))


def superseded(path: Path) -> Path:
    """Where the set-aside rows of the metrics file `path` go: growmtp_metrics.jsonl's to SUPERSEDED_FILE."""
    return path.with_name(f"{path.stem}.superseded{path.suffix}")


def set_aside_rows_after(path: Path, step: int) -> int:
    """Move the rows of `path` (a metrics file) of steps after `step`, and any row cut short, to `superseded(path)`
    (appended: nothing lost); `path` is rewritten atomically. Returns how many rows moved."""
    if not path.is_file():
        return 0
    kept, later = [], []
    for line in path.read_text().splitlines(keepends=True):
        try:
            (later if json.loads(line)["step"] > step else kept).append(line)
        except (ValueError, KeyError, TypeError):  # a row cut short by the crash the run resumes from
            later.append(line if line.endswith("\n") else line + "\n")
    if later:
        with superseded(path).open("a") as f:
            f.writelines(later)
        partial = path.with_name(path.name + ".partial")
        partial.write_text("".join(kept))
        os.replace(partial, path)
    return len(later)


class _OrderedController(StepMetrics, PPOTrainer.__ray_actor_class__):
    """Upstream's controller generating with `samples_generator_cls`, logging the step's times and memory."""

    samples_generator_cls = OrderedSamplesGenerator

    def __init__(self, pretrain, strategy, *args, **kwargs):
        seed_data_order(strategy.args)  # before upstream builds its prompt dataloader
        super().__init__(pretrain, strategy, *args, **kwargs)
        self.samples_generator = self.samples_generator_cls(
            strategy=strategy, prompts_dataloader=self.prompts_dataloader, eval_dataloader=self.eval_dataloader,
            tokenizer=self.tokenizer, vllm_engines=self.vllm_engines)
        self._init_step_metrics(strategy.args)


def seed_data_order(args) -> None:
    """Under full determinism, seed this (the controller's) process: upstream's prompt dataloader shuffles
    with the global RNG here (no sampler outside torch.distributed), which nothing else seeds."""
    if getattr(args.train, "full_determinism_enable", False):
        transformers.set_seed(args.train.seed)


class _GrowMTPController(GrowMTPStepMetrics, _OrderedController):
    """Upstream's controller with GrowMTP's samples generator and per-step GrowMTP metrics."""

    samples_generator_cls = GrowMTPSamplesGenerator

    def __init__(self, pretrain, strategy, *args, **kwargs):
        super().__init__(pretrain, strategy, *args, **kwargs)
        self.draft_vocab_ranking = None
        if getattr(strategy.args.growmtp, "draft_vocab", None):  # before the first rollout: the prompt set's ranking
            self.draft_vocab_ranking = DraftVocabRanking(strategy.args, self.prompts_dataloader.dataset.prompts,
                                                         self.tokenizer, self.vllm_engines, self.actor_model_group)

    def evaluate(self, global_step, **generate_kwargs):
        """Upstream's evaluation, plus the acceptance of its rollouts (`eval_growmtp/*`, at the depth they drafted)
        in the returned logs, upstream's eval loggers and EVAL_METRICS_FILE. It is evaluation's alone: the depth
        controller never reads it (`GrowMTPSamplesGenerator.generate_eval_samples`)."""
        logs = super().evaluate(global_step, **generate_kwargs)
        acceptance = dict(self.samples_generator.eval_metrics)
        for tracker in (self.wandb_logger, self.tensorboard_logger):
            if tracker:
                tracker.log_eval(global_step, acceptance)
        path = self.eval_metrics_path
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps({"step": global_step, **acceptance}) + "\n")
        logger.warning("GrowMTP evaluation at step %d: tau=%.3f depth=%d cycles=%d", global_step,
                       acceptance["eval_growmtp/tau"], int(acceptance["eval_growmtp/depth"]),
                       int(acceptance["eval_growmtp/cycles"]))
        return {**logs, **acceptance}


OrderedPPOTrainer = ray.remote(_OrderedController)
GrowMTPPPOTrainer = ray.remote(_GrowMTPController)
