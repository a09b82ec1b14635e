"""Every rebind of an upstream name, each install checked against the upstream contract. Pinned to openrlhf 0.11.2.

The rest of the adapter extends upstream by subclassing (one module per upstream role: `strategy`,
`ppo_actor`, `rollout_actor`, `samples_generator`, `ppo_trainer`, `ppo_trainer_async`; DeepSpeed's
optimizer, patched per instance, in `head_step/deepspeed_patches`). What subclassing cannot reach is rebound
here, visibly:

- module attributes, so upstream's own `train()` builds the classes it is handed (`install_driver`:
  the policy actor, the rollout actor, and for a GrowMTP run the strategy and the controller;
  `install_worker`: the actor-side PPO trainer);
- the CPU rebinds (device mesh, replay-buffer device, torch Adam, sdpa for flash attention, DeepSpeed's
  gradient bucket without torch's fill under full determinism), active only without CUDA.

This module imports none of the classes it installs: the launcher (`cli.train_ppo_ray`) passes them in.
Every install checks the contract first (`contract.py`: what the rebinds and subclasses rely on), which
fails loudly, naming each missing piece, if upstream's shape is not the one this was written against.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .contract import check_upstream_contract

# ---- CPU rebinds (no CUDA only) ----------------------------------------------------------------------
def install_cpu_support() -> bool:
    """openrlhf-level CPU fixes; call after cpu_support.activate(). Returns whether anything was installed."""
    from .. import cpu_support, reproducibility

    if not cpu_support.activate():
        return False
    ds_module = importlib.import_module("openrlhf.utils.deepspeed.deepspeed")
    if getattr(ds_module.get_train_ds_config, "_growmtp", False):
        return True
    from torch.distributed.device_mesh import init_device_mesh

    from openrlhf.trainer.ray import ppo_actor

    def cpu_device_mesh(device_type, *args, **kwargs):
        return init_device_mesh("cpu", *args, **kwargs)

    upstream_config = ds_module.get_train_ds_config

    @functools.wraps(upstream_config)
    def train_ds_config_torch_adam(*args, **kwargs):
        # DeepSpeed's fused Adam is a C++ JIT build on CPU; torch's AdamW needs none.
        config = upstream_config(*args, **kwargs)
        if "optimizer" in config:
            config["optimizer"].setdefault("params", {})["torch_adam"] = True
        # ZeRO-3's coalesced all-gather launches one async op per parameter and waits on the last only
        # ("enqueued, but not necessarily complete"): safe on one CUDA stream, not on gloo, whose two
        # worker threads may finish out of order, so a gathered parameter can be read before it arrived.
        # The sequential gather waits on every op.
        config.setdefault("zero_optimization", {})["stage3_allgather_sequential"] = True
        return config

    train_ds_config_torch_adam._growmtp = True

    class CPUReplayBuffer(ppo_actor.NaiveReplayBuffer):
        # upstream builds torch.device(f"cuda:{current_device()}") in __init__
        def __init__(self, *args, **kwargs):
            current = torch.cuda.current_device
            torch.cuda.current_device = lambda: 0
            try:
                super().__init__(*args, **kwargs)
            finally:
                torch.cuda.current_device = current
            self.target_device = torch.device("cpu")

    ds_module.init_device_mesh = cpu_device_mesh
    if not reproducibility.ingredient("fill_gradient_bucket"):
        zero2 = importlib.import_module("deepspeed.runtime.zero.stage_1_and_2").DeepSpeedZeroOptimizer
        zero2.setup_buckets = reproducibility.unfilled(zero2.setup_buckets)
    ds_module.get_train_ds_config = train_ds_config_torch_adam
    ppo_actor.NaiveReplayBuffer = CPUReplayBuffer
    return True


def sdpa_attention(train: Callable) -> Callable:
    """Upstream's train() with sdpa wherever its args ask for flash attention (CPU: its kernels need CUDA).

    Applied to the args train() receives, because upstream's post-parse checks, which run after the
    GrowMTP hook, switch to flash attention for packed samples (`--ds.packing_samples`; dynamic batching
    turns packing on). transformers' sdpa path keeps packed samples apart by their position ids.
    """
    if getattr(train, "_growmtp", False):
        return train

    @functools.wraps(train)
    def run(args):
        if "flash_attention" in (args.ds.attn_implementation or ""):
            args.ds.attn_implementation = "sdpa"
        return train(args)

    run._growmtp = True
    return run


def setup_cpu_worker() -> None:
    """Ray's worker_process_setup_hook on CPU runs: the torch-level layer plus the openrlhf rebinds."""
    install_cpu_support()


# ---- class rebinds -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunClasses:
    """What upstream's `train()` builds instead of its own classes (chosen by `cli.train_ppo_ray`).

    `policy_actor` and `rollout_actor` are always set; `get_strategy` and `controller` only for a
    GrowMTP run (K > 0). `rollout_actor` is what `create_vllm_engines` calls `.options(...).remote(...)` on.
    """

    policy_actor: type
    rollout_actor: Any
    get_strategy: Callable | None = None
    controller: Any = None
    async_controller: Any = None  # what `--train.async_enable` builds instead of PPOTrainerAsync


def install_driver(classes: RunClasses, launcher=None) -> None:
    """Driver side, before upstream's `train()` runs: make it build `classes`.

    `launcher` is the running `openrlhf.cli.train_ppo_ray` module (run as __main__): it imported
    PolicyModelActor and get_strategy by name before its parser ran, so those names are rebound there too.
    """
    check_upstream_contract()
    cpu = install_cpu_support()
    import openrlhf.utils
    import ray
    from openrlhf.trainer import ppo_trainer
    from openrlhf.trainer.ray import ppo_actor, vllm_engine

    policy_actor = ray.remote(num_gpus=1)(classes.policy_actor)  # upstream's PolicyModelActor asks for one GPU
    ppo_actor.PolicyModelActor = policy_actor
    vllm_engine.RolloutRayActor = classes.rollout_actor
    if launcher is not None:
        launcher.PolicyModelActor = policy_actor
        if cpu:
            launcher.train = sdpa_attention(launcher.train)
    if classes.get_strategy is not None:
        openrlhf.utils.get_strategy = classes.get_strategy
        if launcher is not None:
            launcher.get_strategy = classes.get_strategy
    if classes.controller is not None:
        ppo_trainer.PPOTrainer = classes.controller
    if classes.async_controller is not None:  # train() imports it from its module when it runs
        from openrlhf.trainer import ppo_trainer_async

        ppo_trainer_async.PPOTrainerAsync = classes.async_controller


def install_async_controller(upstream_globals: dict, generator_actor, training_actor) -> None:
    """Async controller side, before upstream's PPOTrainerAsync.__init__ builds its two actors by name.

    `upstream_globals` is that method's `__globals__`: as for `install_worker`, Ray ships the actor class by
    value, so the rebind has to land in the method's own copy of the module's globals.
    """
    check_upstream_contract()
    from openrlhf.trainer import ppo_trainer_async

    for namespace in (upstream_globals, vars(ppo_trainer_async)):
        namespace["GenerateSamplesActor"] = generator_actor
        namespace["TrainingActor"] = training_actor


def install_worker(upstream_globals: dict, trainer_cls: type) -> None:
    """Policy-actor side, before upstream's init_model_from_pretrained builds the actor-side trainer.

    `upstream_globals` is that method's `__globals__`. Ray ships the actor class by value (its module
    name points at the Ray wrapper, not the class), so the method looks names up in its own copy of the
    module's globals: the rebind has to land there, not only on the module.
    """
    check_upstream_contract()
    install_cpu_support()
    from openrlhf.trainer.ray import ppo_actor

    for namespace in (upstream_globals, vars(ppo_actor)):
        namespace["ActorPPOTrainer"] = trainer_cls
