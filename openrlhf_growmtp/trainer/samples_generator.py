"""The samples generator of a GrowMTP run (upstream: trainer/ppo_utils/samples_generator.py)."""

from __future__ import annotations

import time

from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

from .keys import ACCEPTED_KEY, DROPPED_KEY, RECORD_KEY


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
        experience.info[DROPPED_KEY] = [response[DROPPED_KEY]]
        return experience
