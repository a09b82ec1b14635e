"""The samples generators of our controllers (upstream: trainer/ppo_utils/samples_generator.py).

- `OrderedSamplesGenerator`: under `--train.full_determinism_enable`, an RL step's requests are numbered
  in dispatch order and admitted to each engine while it is paused, and the step's samples are put back in
  that order (`rollout_order`); otherwise upstream's, unchanged.
- `GrowMTPSamplesGenerator`: that, carrying each sample's record into its Experience.info, and timing
  the rollout. Evaluation's rollouts (`generate_eval_samples`) draft at the depth the last training rollout
  chose and never reach the depth controller: their acceptance is evaluation's own (`eval_metrics`).
"""

from __future__ import annotations

import itertools
import time

import ray
from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

from .. import reproducibility
from ..core.metrics import acceptance_summary
from .depth_controller import DepthController
from .keys import RECORD_KEY, RECORD_SECONDS_KEY, accepted_counts
from .rollout_order import ORDER_KEY, NumberedEngines


class OrderedSamplesGenerator(SamplesGenerator):
    """Upstream's samples generator; with full determinism, reproducible rollouts (module docstring)."""

    last_rollout_s: float = 0.0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ordered = bool(getattr(self.args.train, "full_determinism_enable", False))
        self.held = self.ordered and reproducibility.ingredient("ordered_scheduling")
        self._numbers = itertools.count()

    def generate_samples(self, **generate_kwargs):
        began = time.perf_counter()
        result = super().generate_samples(**generate_kwargs)
        self.last_rollout_s = time.perf_counter() - began
        return result

    def _dispatch_prompts_to_vllm(self, prompts, labels, *, images=None, **generate_kwargs):
        if not self.ordered:
            return super()._dispatch_prompts_to_vllm(prompts, labels, images=images, **generate_kwargs)
        engines = self.vllm_engines
        if self.held:
            ray.get([engine.growmtp_hold.remote() for engine in engines])
        numbered = NumberedEngines(engines, self.args.train.seed, self._numbers)
        self.vllm_engines = numbered.handles
        try:
            refs = super()._dispatch_prompts_to_vllm(prompts, labels, images=images, **generate_kwargs)
        finally:
            self.vllm_engines = engines
        if self.held:
            ray.get([engine.growmtp_release.remote(count) for engine, count in zip(engines, numbered.requests)])
        return refs

    def _generate_vllm(self, *args, **kwargs):
        experiences, prompts_consumed, exhausted = super()._generate_vllm(*args, **kwargs)
        if self.ordered:  # upstream collects them as they finish
            experiences.sort(key=lambda experience: experience.growmtp_order)
        return experiences, prompts_consumed, exhausted

    def _process_response_into_experience(self, response, **generate_kwargs):
        experience = super()._process_response_into_experience(response, **generate_kwargs)
        if ORDER_KEY in response:
            experience.growmtp_order = tuple(response[ORDER_KEY])
        return experience


class GrowMTPSamplesGenerator(OrderedSamplesGenerator):
    """Carries each sample's record into its Experience.info; under `--growmtp_depth auto`, sets the depth of
    each vLLM call first (`depth_controller`; inside the rollout's time)."""

    evaluating: bool = False  # inside generate_eval_samples
    eval_metrics: dict[str, float] = {}  # the last evaluation's acceptance (`eval_growmtp/*`)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        auto = getattr(self.args.growmtp, "depth", "fixed") == "auto"
        self.depth_controller = DepthController(self.vllm_engines, self.args) if auto else None

    def generate_eval_samples(self, **generate_kwargs):
        """Upstream's evaluation rollouts, kept apart from the depth controller: it neither chooses their depth
        nor learns from their acceptance or their engine steps (read and dropped here). Their acceptance, at the
        depth they drafted, is `eval_metrics`."""
        self.evaluating = True
        try:
            experiences = super().generate_eval_samples(**generate_kwargs)
        finally:
            self.evaluating = False
            if self.depth_controller is not None:
                self.depth_controller.drop_engine_steps()
        summary = acceptance_summary(accepted_counts(experiences), self.depth)
        self.eval_metrics = {**summary.as_dict("eval_growmtp/"), "eval_growmtp/depth": float(self.depth)}
        return experiences

    def _generate_vllm(self, *args, **kwargs):
        if self.depth_controller is None or self.evaluating:
            return super()._generate_vllm(*args, **kwargs)
        self.depth_controller.before_rollout()
        experiences, prompts_consumed, exhausted = super()._generate_vllm(*args, **kwargs)
        self.depth_controller.after_rollout(experiences)
        return experiences, prompts_consumed, exhausted

    @property
    def depth(self) -> int:
        """The depth the last rollout drafted at."""
        return self.depth_controller.depth if self.depth_controller is not None else int(self.args.growmtp.k)

    def generate_samples(self, **generate_kwargs):
        self.record_s = 0.0  # the rollout actors' seconds on this rollout's records (drain, collect, pack)
        return super().generate_samples(**generate_kwargs)

    def _process_response_into_experience(self, response, **generate_kwargs):
        self.record_s += response.pop(RECORD_SECONDS_KEY, 0.0)
        experience = super()._process_response_into_experience(response, **generate_kwargs)
        experience.info[RECORD_KEY] = [response[RECORD_KEY]]  # a PackedRecord
        return experience
