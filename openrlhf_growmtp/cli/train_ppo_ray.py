"""`python -m openrlhf_growmtp.cli.train_ppo_ray`: OpenRLHF's PPO/GRPO launcher with GrowMTP.

Every upstream `openrlhf.cli.train_ppo_ray` flag works unchanged; the `--growmtp_*` flags (and their
dotted aliases `--growmtp.*`) are added to upstream's own parser. Upstream's module then runs as
`__main__`: its checks, its `train()`. What differs is decided right after parsing, before Ray starts:

- `--growmtp_k 0` (default): nothing is rebound; the run is upstream's. Without CUDA the CPU layer also
  sends weights to the engines through Ray, and `--growmtp_neg_adv_weight w != 1` rebinds the policy
  actor to apply it;
- `--growmtp_k K`: the startup checks run, the initial head directory is resolved (materialised once
  for `random`, extracted for `native`), and `installer.install_driver` makes upstream's `train()`
  build GrowMTP's strategy, policy actor, controller and speculative rollout actors.

With GROWMTP_DRY_RUN=1 every check (ours, then upstream's) runs and the process exits 0 before Ray,
head materialisation or any file is touched: example scripts are validated this way.

On a machine without CUDA the CPU support layer is switched on and Ray is started here with logical
GPUs (upstream's `train()` then reuses it).
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
    """The head directory every engine and trainer starts from (written once for random / native)."""
    from openrlhf_growmtp.core.checkpoint import export_head, load_native_head, materialize_random_head

    source, model = flat["growmtp.head"], flat["actor.model_name_or_path"]
    if source not in ("random", "native"):
        return str(Path(source).resolve())
    out = Path(flat["ckpt.path"]).resolve() / INITIAL_HEAD_DIR / source
    if source == "random":
        materialize_random_head(model, out, seed=0)
    else:
        export_head(load_native_head(model), out)
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


def prepare(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """Checks, head resolution, rebinds and (CPU) Ray start; runs right after upstream parses its flags."""
    from openrlhf_growmtp.trainer import installer
    from openrlhf_growmtp.trainer.args import check_args

    flat = vars(ns)
    errors = check_args(flat)
    if errors:
        parser.error("invalid GrowMTP configuration:\n  - " + "\n  - ".join(errors))
    if os.environ.get(DRY_RUN_ENV) == "1":
        # upstream's own checks run after parsing; its train() is then replaced by a report
        sys.modules["__main__"].train = dry_run_report
        return
    cpu = cpu_support.needed()
    if cpu and "flash_attention" in (flat.get("ds.attn_implementation") or ""):
        setattr(ns, "ds.attn_implementation", "sdpa")  # flash-attn kernels need CUDA
    if flat["growmtp.k"] > 0:
        from openrlhf_growmtp.trainer.actors import make_rollout_actor

        setattr(ns, "growmtp.head_dir", resolve_head_dir(flat))
        options = {"k": flat["growmtp.k"], "head_dir": flat["growmtp.head_dir"], "topk": flat["growmtp.topk"]}
        # upstream's module is running as __main__ and already holds its imported names
        installer.install_driver(make_rollout_actor(options), launcher=sys.modules["__main__"])
    elif cpu or flat["growmtp.neg_adv_weight"] != 1.0:
        installer.install_base_driver(launcher=sys.modules["__main__"], rollout_via_ray=cpu)
    if cpu:
        import ray

        if not ray.is_initialized():
            ray.init(**cpu_support.ray_init_kwargs(logical_gpus(flat), setup_hook=f"{installer.__name__}.setup_cpu_worker",
                                                  temp_dir=os.environ.get("GROWMTP_RAY_TMP")))


def dry_run_report(args) -> None:
    """`train()` under GROWMTP_DRY_RUN=1: every check passed; say what would run, start nothing."""
    g = args.growmtp
    what = (f"GrowMTP K={g.k}, head {g.head}, mode {g.mode}, loss {g.loss}{'' if g.vgm else ' (no VGM)'}"
            if g.k else "autoregressive (GrowMTP off)")
    print(f"{DRY_RUN_ENV}=1: the configuration passed every startup check; not starting Ray.\n"
          f"  model {args.actor.model_name_or_path}; {what}; negative-advantage weight {g.neg_adv_weight}; "
          f"rollout {args.rollout.batch_size} prompts x {args.rollout.n_samples_per_prompt} samples, "
          f"max {args.rollout.max_new_tokens} new tokens")


def main() -> None:
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
