"""The upstream contract: every upstream name the adapter's rebinds and subclasses rely on. Pinned to
openrlhf 0.11.2 and deepspeed 0.19.6.

- `CONTRACT`: modules, classes and callables (with the parameters relied on), and `ATTRIBUTES`: the instance
  attributes of DeepSpeed's optimizers and engine that the head's optimizer reads or rebinds (ones the class's
  own source assigns, `self.<name> = ...`), checked at every install (`installer`) and by the tests:
  `check_upstream_contract` names every piece that is missing;
- `TRAINER_CONTRACT`: the attributes of upstream's live actor-side trainer that the head's RL step reads
  through `upstream_actor.UpstreamActorTrainer`, checked when an RL step starts (`check_trainer_contract`).
"""

from __future__ import annotations

import importlib
import inspect
import re

OPENRLHF_VERSION = "0.11.2"

# (module, attribute, required parameters of the callable or None) that the rebinds and subclasses rely on.
CONTRACT = [
    ("openrlhf.cli.train_ppo_ray", "train", ("args",)),
    ("openrlhf.cli.train_ppo_ray", "PolicyModelActor", None),
    ("openrlhf.cli.train_ppo_ray", "get_strategy", None),
    ("openrlhf.cli.train_ppo_ray", "create_vllm_engines", None),
    ("openrlhf.utils", "get_strategy", ("args",)),
    ("openrlhf.utils.deepspeed.deepspeed", "init_device_mesh", None),
    ("openrlhf.utils.deepspeed.deepspeed", "get_train_ds_config", ("optim_config",)),
    ("openrlhf.utils.deepspeed.deepspeed.DeepspeedStrategy", "_get_model_parameters",
     ("model", "optim", "weight_decay")),
    ("openrlhf.utils.deepspeed.deepspeed.DeepspeedStrategy", "_ds_init_train_model", ("model", "cfg")),
    ("openrlhf.utils.deepspeed.deepspeed.DeepspeedStrategy", "save_model", ("model", "tokenizer", "output_dir")),
    ("openrlhf.utils.deepspeed.deepspeed.DeepspeedStrategy", "backward", ("loss", "model")),
    # a head run names its checkpoint in `latest` itself, once the head snapshot is beside it
    ("openrlhf.utils.deepspeed.deepspeed.DeepspeedStrategy", "save_ckpt", ("model", "save_dir", "tag", "save_latest")),
    ("openrlhf.trainer.ray.ppo_actor.PolicyModelActor.__ray_actor_class__", "save_checkpoint",
     ("tag", "client_states")),
    # the controllers set aside the metrics rows of steps a resumed run logs again
    ("openrlhf.trainer.ppo_trainer.BasePPOTrainer", "init_checkpoint_states", ()),
    # the strategy attaches the head to the Actor it is handed to train, before DeepSpeed wraps it
    ("openrlhf.models", "Actor", None),
    ("openrlhf.trainer.ray.ppo_actor", "NaiveReplayBuffer", None),
    ("openrlhf.trainer.ray.ppo_actor.ActorPPOTrainer", "ppo_train", ("kl_ctl",)),
    ("openrlhf.trainer.ray.ppo_actor.ActorPPOTrainer", "broadcast_to_vllm", ()),
    # the head trains in each micro-batch's step, on the records that ride in its Experience.info
    ("openrlhf.trainer.ray.ppo_actor.ActorPPOTrainer", "training_step",
     ("experience", "kl_ctl", "step", "loss_batch_info")),
    ("openrlhf.trainer.ray.ppo_actor.ActorPPOTrainer", "_init_vllm_sync_group", ("backend",)),
    # the policy actor applies the reproducibility ingredients right after upstream's strategy set up
    ("openrlhf.trainer.ray.launcher.BaseModelActor", "_setup_distributed", ("strategy",)),
    ("openrlhf.trainer.ray.ppo_actor.PolicyModelActor.__ray_actor_class__", "init_model_from_pretrained",
     ("strategy", "pretrain", "max_steps", "vllm_engines")),
    ("openrlhf.trainer.ray.vllm_engine", "RolloutRayActor", None),
    # NegativeAdvantageWeightedLoss wraps the trainer's actor_loss_fn, called with advantages third
    ("openrlhf.models.loss.PolicyLoss", "forward", ("log_probs", "old_log_probs", "advantages")),
    ("openrlhf.trainer.ray.vllm_engine.RolloutRayActor.__ray_actor_class__", "generate",
     ("prompt_token_ids", "sampling_params", "multi_modal_data")),
    ("openrlhf.trainer.ray.vllm_engine.RolloutRayActor.__ray_actor_class__", "generate_responses",
     ("prompt", "label", "sampling_params", "max_length", "hf_tokenizer", "num_samples")),
    ("openrlhf.trainer.ppo_trainer", "PPOTrainer", None),
    # the async controller builds its two actors by these names (install_async_controller)
    ("openrlhf.trainer.ppo_trainer_async", "PPOTrainerAsync", None),
    ("openrlhf.trainer.ppo_trainer_async", "GenerateSamplesActor", None),
    ("openrlhf.trainer.ppo_trainer_async", "TrainingActor", None),
    ("openrlhf.trainer.ppo_trainer.PPOTrainer.__ray_actor_class__", "train_step", ("rollout_samples", "global_step")),
    ("openrlhf.trainer.ppo_utils.samples_generator.SamplesGenerator", "_process_response_into_experience",
     ("response",)),
    ("openrlhf.trainer.ppo_utils.samples_generator.SamplesGenerator", "generate_samples", ()),
    # reproducible rollouts: dispatch through our engine handles, then the step's samples back in order
    ("openrlhf.trainer.ppo_utils.samples_generator.SamplesGenerator", "_dispatch_prompts_to_vllm",
     ("prompts", "labels", "images")),
    ("openrlhf.trainer.ppo_utils.samples_generator.SamplesGenerator", "_generate_vllm",
     ("dataloader_iter", "num_prompts", "dynamic_filtering")),
    ("openrlhf.trainer.ray.vllm_engine.RolloutRayActor.__ray_actor_class__", "get_num_unfinished_requests", ()),
    ("deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3", "_get_norm_groups", ()),
    # the head's group held still: called with one group's (ZeRO-2) or sub-group's (ZeRO-3) index
    ("deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3", "_optimizer_step", None),
    ("deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer", "_optimizer_step", None),
    # decorated with DeepSpeed's nvtx wrapper (signature *args, **kwargs): existence only
    ("deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3", "unscale_and_clip_grads", None),
    ("deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3", "clear_backward_seen_flag", ()),
    ("deepspeed.runtime.engine.DeepSpeedEngine", "set_gradient_accumulation_boundary", ("is_boundary",)),
    ("deepspeed.runtime.engine.DeepSpeedEngine", "managed_gradient_accumulation", ()),
    ("deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer", "scaled_global_norm", ("norm_type",)),
    ("deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer", "unscale_and_clip_grads",
     ("grad_groups_flat", "total_norm")),
    ("deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer", "get_grad_norm_direct", ("gradients", "params")),
    ("deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer", "complete_grad_norm_calculation_for_cpu_offload",
     ("params",)),
    ("deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer", "clear_backward_seen_flag", ()),
    # allocates the gradient bucket at every micro-step (reproducibility.unfilled, on CPU)
    ("deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer", "setup_buckets", ()),
]

# (class, instance attributes) that trainer/head_step's deepspeed_patches.py and head_optimizer.py read or rebind
ATTRIBUTES = [
    ("deepspeed.runtime.engine.DeepSpeedEngine", ("optimizer", "global_steps", "_is_gradient_accumulation_boundary")),
    ("deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3",
     ("optimizer", "sub_group_to_group_id", "fp32_partitioned_groups_flat", "grad_partitions_flat_buffer")),
    ("deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer",
     ("optimizer", "partition_gradients", "cpu_offload", "bit16_groups", "params_in_partition", "averaged_gradients",
      "single_partition_of_fp32_groups", "accumulated_grads_in_cpu")),
]


class UpstreamContractError(RuntimeError):
    """The installed OpenRLHF/DeepSpeed does not have the shape this integration was written against."""


def _resolve(path: str):
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def check_upstream_contract() -> None:
    """Raise UpstreamContractError listing every rebind target or signature that is not as expected."""
    from importlib.metadata import PackageNotFoundError, version

    problems = []
    try:
        installed = version("openrlhf")
    except PackageNotFoundError:
        installed = None
    if installed != OPENRLHF_VERSION:
        problems.append(f"openrlhf {installed} is installed; this integration is pinned to {OPENRLHF_VERSION}")
    for owner, name, params in CONTRACT:
        try:
            obj = getattr(_resolve(owner), name)
        except (ImportError, AttributeError) as err:
            problems.append(f"{owner}.{name} is missing ({type(err).__name__}: {err})")
            continue
        if params is not None:
            found = set(inspect.signature(obj).parameters)
            missing = [p for p in params if p not in found]
            if missing:
                problems.append(f"{owner}.{name} lost parameter(s) {missing}")
    problems += _missing_attributes()
    if problems:
        raise UpstreamContractError("OpenRLHF integration contract broken:\n  - " + "\n  - ".join(problems))


def _missing_attributes() -> list[str]:
    """The `ATTRIBUTES` that their class's source no longer assigns on `self`."""
    problems = []
    for owner, names in ATTRIBUTES:
        try:
            source = inspect.getsource(_resolve(owner))
        except (ImportError, AttributeError, OSError, TypeError) as err:
            problems.append(f"{owner} is missing ({type(err).__name__}: {err})")
            continue
        problems += [f"{owner} no longer sets self.{name}" for name in names
                     if not re.search(rf"\bself\.{re.escape(name)}\s*(:[^=\n]*)?=(?!=)", source)]
    return problems


# Attribute paths on upstream's ActorPPOTrainer instance (trainer/head_step/upstream_actor.py reads each one).
TRAINER_CONTRACT = ("args", "actor.model", "replay_buffer.items",
                    "replay_buffer.sample_batch_size", "replay_buffer.dynamic_optimizer_step",
                    "strategy.accumulated_gradient", "strategy.ring_attn_group")


def check_trainer_contract(trainer) -> None:
    """Raise UpstreamContractError naming every `TRAINER_CONTRACT` attribute this trainer lacks."""
    missing = []
    for path in TRAINER_CONTRACT:
        obj = trainer
        for name in path.split("."):
            if not hasattr(obj, name):
                missing.append(path)
                break
            obj = getattr(obj, name)
    if missing:
        raise UpstreamContractError(f"upstream's actor-side trainer ({type(trainer).__name__}) lacks {missing}, which "
                                    "the head's RL step reads (trainer/head_step/upstream_actor.py)")
