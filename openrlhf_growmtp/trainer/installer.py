"""The one place that touches OpenRLHF's (and DeepSpeed's) internals. Pinned to openrlhf 0.11.2.

Everything else in the project extends upstream by subclassing public classes. What cannot be reached
that way is done here, visibly:

- module-attribute rebinds, so upstream's own `train()` builds our classes (driver side:
  the policy actor, the strategy, the PPO controller, the rollout actor; policy-actor side: the `Actor`
  the head is attached to and the actor-side PPO trainer);
- the CPU rebinds (device mesh, replay-buffer device, torch Adam), active only without CUDA;
- three wraps of DeepSpeed ZeRO-3 optimizer internals that keep the head's param group from touching
  the policy's update (gradient-norm clipping per group, a gradient buffer that every window starts from
  zero, a skipped head step).

`check_upstream_contract()` runs first and fails loudly, naming each missing piece, if upstream's shape
is not the one this module was written against.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from typing import Callable

import torch

OPENRLHF_VERSION = "0.11.2"
HEAD_GROUP = "growmtp_head"

# (module, attribute, required parameters of the callable or None) that the rebinds and subclasses rely on.
CONTRACT = [
    ("openrlhf.cli.train_ppo_ray", "train", ("args",)),
    ("openrlhf.cli.train_ppo_ray", "PolicyModelActor", None),
    ("openrlhf.cli.train_ppo_ray", "get_strategy", None),
    ("openrlhf.cli.train_ppo_ray", "create_vllm_engines", None),
    ("openrlhf.utils", "get_strategy", ("args",)),
    ("openrlhf.utils.deepspeed.deepspeed", "init_device_mesh", None),
    ("openrlhf.utils.deepspeed.deepspeed", "get_train_ds_config", ("optim_config",)),
    ("openrlhf.utils.deepspeed.deepspeed.DeepspeedStrategy", "_get_model_parameters", ("model", "optim", "weight_decay")),
    ("openrlhf.utils.deepspeed.deepspeed.DeepspeedStrategy", "_ds_init_train_model", ("model", "cfg")),
    ("openrlhf.utils.deepspeed.deepspeed.DeepspeedStrategy", "save_model", ("model", "tokenizer", "output_dir")),
    ("openrlhf.utils.deepspeed.deepspeed.DeepspeedStrategy", "backward", ("loss", "model")),
    ("openrlhf.trainer.ray.ppo_actor", "Actor", None),
    ("openrlhf.trainer.ray.ppo_actor", "NaiveReplayBuffer", None),
    ("openrlhf.trainer.ray.ppo_actor.ActorPPOTrainer", "training_step", ("experience", "kl_ctl", "step", "loss_batch_info")),
    ("openrlhf.trainer.ray.ppo_actor.ActorPPOTrainer", "ppo_train", ("kl_ctl",)),
    ("openrlhf.trainer.ray.ppo_actor.ActorPPOTrainer", "broadcast_to_vllm", ()),
    ("openrlhf.trainer.ray.ppo_actor.ActorPPOTrainer", "_init_vllm_sync_group", ("backend",)),
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
    ("openrlhf.trainer.ppo_trainer.PPOTrainer.__ray_actor_class__", "train_step", ("rollout_samples", "global_step")),
    ("openrlhf.trainer.ppo_utils.samples_generator.SamplesGenerator", "_process_response_into_experience",
     ("response",)),
    ("openrlhf.trainer.ppo_utils.samples_generator.SamplesGenerator", "generate_samples", ()),
    ("deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3", "_get_norm_groups", ()),
    # decorated with DeepSpeed's nvtx wrapper (signature *args, **kwargs): existence only
    ("deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3", "unscale_and_clip_grads", None),
    ("deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3", "clear_backward_seen_flag", ()),
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
    if problems:
        raise UpstreamContractError("OpenRLHF integration contract broken:\n  - " + "\n  - ".join(problems))


# ---- CPU rebinds (no CUDA only) ----------------------------------------------------------------------
def install_cpu_support() -> bool:
    """openrlhf-level CPU fixes; call after cpu_support.activate(). Returns whether anything was installed."""
    from .. import cpu_support

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
    ds_module.get_train_ds_config = train_ds_config_torch_adam
    ppo_actor.NaiveReplayBuffer = CPUReplayBuffer
    return True


def setup_cpu_worker() -> None:
    """Ray's worker_process_setup_hook on CPU runs: the torch-level layer plus the openrlhf rebinds."""
    install_cpu_support()


# ---- class rebinds -------------------------------------------------------------------------------------
def install_driver(rollout_actor_cls, launcher=None) -> None:
    """Driver side of a GrowMTP run (K > 0), before upstream's train() runs: make it build GrowMTP's classes.

    `launcher` is the running `openrlhf.cli.train_ppo_ray` module (run as __main__): it imported
    PolicyModelActor and get_strategy by name before its parser ran, so those names are rebound there too.
    """
    check_upstream_contract()
    install_cpu_support()
    import openrlhf.utils
    from openrlhf.trainer import ppo_trainer

    from . import actors

    _rebind_actors(actors.GrowMTPPolicyActor, rollout_actor_cls, launcher)
    openrlhf.utils.get_strategy = actors.get_strategy
    ppo_trainer.PPOTrainer = actors.GrowMTPPPOTrainer
    if launcher is not None:
        launcher.get_strategy = actors.get_strategy


def install_base_driver(launcher=None, rollout_via_ray: bool = False) -> None:
    """Driver side of a plain run (K = 0) that needs more than upstream: the policy actor builds
    `BaseActorTrainer` (negative-advantage weight, Ray weight path without CUDA), and without CUDA the
    engines take weights through Ray (upstream's weight sync is NCCL/CUDA only)."""
    check_upstream_contract()
    install_cpu_support()
    import ray
    from openrlhf.trainer.ray import vllm_engine

    from . import actors

    rollout = ray.remote(actors.RaySyncRolloutActor) if rollout_via_ray else vllm_engine.RolloutRayActor
    _rebind_actors(actors.BasePolicyActor, rollout, launcher)


def _rebind_actors(policy_actor_cls, rollout_actor_cls, launcher) -> None:
    import ray
    from openrlhf.trainer.ray import ppo_actor, vllm_engine

    policy_actor = ray.remote(num_gpus=1)(policy_actor_cls)  # upstream's PolicyModelActor asks for one GPU
    ppo_actor.PolicyModelActor = policy_actor
    vllm_engine.RolloutRayActor = rollout_actor_cls
    if launcher is not None:
        launcher.PolicyModelActor = policy_actor


def install_worker(upstream_globals: dict, trainer_cls, actor_cls=None) -> None:
    """Policy-actor side, before upstream's init_model_from_pretrained builds the Actor and its trainer.

    `upstream_globals` is that method's `__globals__`. Ray ships the actor class by value (its module
    name points at the Ray wrapper, not the class), so the method looks names up in its own copy of the
    module's globals: the rebind has to land there, not only on the module.
    """
    check_upstream_contract()
    install_cpu_support()
    from openrlhf.trainer.ray import ppo_actor

    for namespace in (upstream_globals, vars(ppo_actor)):
        namespace["ActorPPOTrainer"] = trainer_cls
        if actor_cls is not None:
            namespace["Actor"] = actor_cls


# ---- DeepSpeed ZeRO-3: the head's param group next to the policy's ------------------------------------
def _zero3_optimizer(engine):
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    optimizer = engine.optimizer
    if not isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        raise UpstreamContractError(f"GrowMTP head training needs the ZeRO-3 optimizer, found {type(optimizer)}")
    return optimizer


def head_group_index(optimizer) -> int:
    names = [group.get("name") for group in optimizer.param_groups]
    if HEAD_GROUP not in names:
        raise UpstreamContractError(f"no {HEAD_GROUP!r} param group in the optimizer (groups: {names})")
    return names.index(HEAD_GROUP)


def attach_head_optimizer(engine, scheduler, lr_multiplier: Callable[[int], float]) -> None:
    """Give the head group its own LR schedule and keep its gradients out of the policy's clipping.

    DeepSpeed clips with one norm over all groups; here the policy's sub-groups are clipped with the
    norm of the policy's gradients alone (exactly upstream's, since the head group contributes zero to it)
    and the head's sub-groups with the head's own norm.
    """
    optimizer = _zero3_optimizer(engine)
    group = head_group_index(optimizer)
    head_subgroups = {sub for sub, grp in optimizer.sub_group_to_group_id.items() if grp == group}
    if optimizer.offload_optimizer:
        raise UpstreamContractError("GrowMTP head training does not support optimizer offload")

    norms = {}
    original_norms = optimizer._get_norm_groups
    original_clip = optimizer.unscale_and_clip_grads

    def norm_groups_without_head():
        per_subgroup = original_norms()
        head = [n for sub, n in enumerate(per_subgroup) if sub in head_subgroups]
        norms["head"] = torch.linalg.vector_norm(torch.stack(head)) if head else None
        return [torch.zeros_like(n) if sub in head_subgroups else n for sub, n in enumerate(per_subgroup)]

    def clip_per_group(sub_group_id, total_norm):
        if sub_group_id in head_subgroups:
            total_norm = norms["head"]
        return original_clip(sub_group_id, total_norm)

    optimizer._get_norm_groups = norm_groups_without_head
    optimizer.unscale_and_clip_grads = clip_per_group

    # LambdaLR keeps one multiplier per group; the head's replaces upstream's for its group only.
    scheduler.lr_lambdas[group] = lr_multiplier
    base = scheduler.base_lrs[group]
    optimizer.param_groups[group]["lr"] = base * lr_multiplier(scheduler.last_epoch)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


def begin_head_window(engine) -> None:
    """Zero the partitioned gradient buffer before the head's backwards open an accumulation window.

    ZeRO-3 copies (instead of adding) gradients in a window's first backward and keeps stale values in
    the buffer otherwise; with the head's backwards first, every later backward must add onto zeros.
    """
    optimizer = _zero3_optimizer(engine)
    optimizer.grad_partitions_flat_buffer.zero_()


def head_backward(engine) -> Callable[[torch.Tensor], None]:
    """DeepSpeed's engine backward for one head chunk, then close that backward as a micro-step."""
    optimizer = _zero3_optimizer(engine)

    def backward(loss: torch.Tensor) -> None:
        engine.backward(loss)
        # The engine closes a micro-step at its next forward; the head runs no engine forward, so close
        # it here: the next backward (head chunk or policy) then accumulates instead of overwriting.
        optimizer.clear_backward_seen_flag()

    return backward


@contextlib.contextmanager
def head_step_skipped(engine, scheduler):
    """Optimizer steps inside run with the head group's LR at zero: head parameters stay as they are.

    The scheduler's own step (inside engine.step) still sets the next LR; it is kept when it ran.
    """
    optimizer = _zero3_optimizer(engine)
    index = head_group_index(optimizer)
    group, lr, epoch = optimizer.param_groups[index], optimizer.param_groups[index]["lr"], scheduler.last_epoch
    group["lr"] = 0.0
    try:
        yield
    finally:
        if scheduler.last_epoch == epoch:
            group["lr"] = lr


def head_optimizer_state(engine) -> dict[str, torch.Tensor]:
    """This rank's partition of the head group's Adam moments (for checkpoint tests)."""
    optimizer = _zero3_optimizer(engine)
    group = head_group_index(optimizer)
    out = {}
    for sub, grp in sorted(optimizer.sub_group_to_group_id.items()):
        if grp != group:
            continue
        state = optimizer.optimizer.state[optimizer.fp32_partitioned_groups_flat[sub]]
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{sub}.{key}"] = state[key].detach().cpu().clone()
    return out
