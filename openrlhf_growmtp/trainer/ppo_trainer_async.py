"""The async controller of a GrowMTP run (upstream: trainer/ppo_trainer_async.py, `--train.async_enable`).

Upstream's `PPOTrainerAsync` builds a generator actor (rollouts) and a training actor (RL steps) that
run side by side, joined by a queue: a rollout is produced by the policy (and head) of up to
`--train.async_queue_size` steps before the one that trains on it. Here the generator actor makes its
rollouts with GrowMTP's samples generator (records into each sample's info) and the training actor
reports GrowMTP's per-step metrics. The records stay exact for the policy that produced them; the
hidden states the head trains on come from the trainer's policy at training time (transport-free mode),
which is the rollout policy's successor by the queue's lag.
"""

from __future__ import annotations

import ray
from openrlhf.trainer.ppo_trainer_async import GenerateSamplesActor, PPOTrainerAsync, TrainingActor

from . import installer
from .ppo_trainer import GrowMTPStepMetrics, seed_data_order
from .samples_generator import GrowMTPSamplesGenerator


@ray.remote
class GrowMTPGenerateSamplesActor(GenerateSamplesActor.__ray_actor_class__):
    """Upstream's generator actor, generating with GrowMTP's samples generator."""

    def __init__(self, pretrain, strategy, vllm_engines, **kwargs):
        seed_data_order(strategy.args)  # before upstream builds its prompt dataloader
        super().__init__(pretrain, strategy, vllm_engines, **kwargs)
        upstream = self.samples_generator
        self.samples_generator = GrowMTPSamplesGenerator(
            strategy=strategy, prompts_dataloader=upstream.prompts_dataloader,
            eval_dataloader=upstream.eval_dataloader, tokenizer=upstream.tokenizer, vllm_engines=vllm_engines)


@ray.remote
class GrowMTPTrainingActor(GrowMTPStepMetrics, TrainingActor.__ray_actor_class__):
    """Upstream's training actor with GrowMTP's per-step metrics (no rollout time: it runs alongside)."""

    def __init__(self, pretrain, strategy, *args, **kwargs):
        super().__init__(pretrain, strategy, *args, **kwargs)
        self._init_step_metrics(strategy.args)


@ray.remote
class GrowMTPPPOTrainerAsync(PPOTrainerAsync.__ray_actor_class__):
    """Upstream's async controller, building GrowMTP's generator and training actors."""

    def __init__(self, *args, **kwargs):
        # upstream's __init__ looks both actor classes up by name, in this (the controller's) process
        upstream = super().__init__
        installer.install_async_controller(upstream.__func__.__globals__, GrowMTPGenerateSamplesActor,
                                           GrowMTPTrainingActor)
        upstream(*args, **kwargs)
