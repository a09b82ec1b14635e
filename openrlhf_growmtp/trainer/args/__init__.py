"""Every flag this launcher adds to upstream's `train_ppo_ray`, and the startup checks that run before Ray starts.

One room, one file per concern; each file registers its flags and checks them:
- here: the `--growmtp_*` group (K, the head and its schedule, the objective, VGM, mode, records,
  `--growmtp_neg_adv_weight`, the debugging logs) and `check_args`, which runs every file's checks;
- `depth.py`: `--growmtp_depth`, `--growmtp_cycle_costs`, `--growmtp_(no_)committed_loss`;
- `draft_vocab.py`: `--growmtp_draft_vocab`;
- `engine.py`: the `--vllm.*` engine settings GrowMTP adds (`--vllm.max_num_seqs`, `--vllm.runner`);
- `layout.py`: what a training head needs of upstream's training layout (ZeRO stage, optimizer, batch windows).

Every `--growmtp_*` flag is registered under both spellings (`--growmtp_k` and upstream's grouped style
`--growmtp.k`) with the dotted destination, so OpenRLHF's `hierarchize` turns it into `args.growmtp.k`.
`check_args` works on the flat namespace right after parsing: a bad combination stops the launch with
one message naming every problem, before any actor, engine or checkpoint is touched.
No openrlhf import here: the checks read only the flat namespace and the model's and head's config files.
"""

from __future__ import annotations

import argparse
import json

from ...core.checkpoint import (HeadCheckpointError, check_head_dir, check_text_only, native_head_layers,
                               native_head_tensor_names, resolve_backbone)
from ...core.objectives import ALPHA_ESTIMATES, OBJECTIVES
from ...core.reconstruction import CHUNK_CYCLES
from ...core.records import DEFAULT_TOPK
from ...core.schedule import DEFAULT_HEAD_LR, DEFAULT_MIN_LR_RATIO, DEFAULT_WARMUP_STEPS
from ...hub import ModelLocationError, local_dir
from .depth import add_depth_args, check_depth
from .draft_vocab import add_draft_vocab_flag, check_draft_vocab
from .engine import add_engine_args, check_engine_args
from .layout import check_training_layout, policy_steps_per_rl_step  # noqa: F401  (importers read it here)


MODES = ("detached", "joint", "frozen")
HEAD_UPDATES = ("rl_step", "policy_step")  # once per RL step (the paper's), or with every policy optimizer step
HEAD_SOURCES = ("random", "native")
# The deepest drafting the records, VGM and reconstruction are tested at; a head directory may declare
# a smaller `max_draft_depth` in its config.json.
MAX_DRAFT_DEPTH = 16
INF = float("inf")  # a number flag must be below it: NaN and infinity compare False


def add_growmtp_args(parser: argparse.ArgumentParser) -> None:
    """Register the GrowMTP flags on upstream's parser (idempotent)."""
    add_engine_args(parser)
    if any(action.dest == "growmtp.k" for action in parser._actions):
        return
    group = parser.add_argument_group("GrowMTP (speculative rollouts that train their own draft head)")

    def flag(name: str, *, aliases: tuple[str, ...] = (), **kwargs) -> None:
        # aliases: earlier names of the flag, still accepted in both spellings
        kwargs.setdefault("metavar", name.upper())
        names = [spelling for n in (name, *aliases) for spelling in (f"--growmtp_{n}", f"--growmtp.{n}")]
        group.add_argument(*names, dest=f"growmtp.{name}", **kwargs)

    flag("k", type=int, default=0, help="drafting depth K per cycle; 0 turns GrowMTP off (plain upstream run)")
    add_depth_args(group, flag)
    flag("head", type=str, default="random",
         help="the draft head: 'random' (materialised once, seed 0), 'native' (the model's own MTP layer) "
              "or a head directory written by growmtp-make-head / a previous run")
    flag("head_lr", type=float, default=None,
         help=f"peak head LR (default {DEFAULT_HEAD_LR['random']} random, {DEFAULT_HEAD_LR['native']} native)")
    flag("head_update", type=str, default="rl_step", choices=HEAD_UPDATES,
         help="when the head takes an optimizer step: rl_step (the paper's schedule: once per RL step, on all of "
              "that step's records, in its first accumulation window) or policy_step (with every policy optimizer "
              "step, on the records of that step's samples; not the paper's). Default: %(default)s")
    flag("head_warmup_steps", aliases=("warmup_steps",), type=int, default=DEFAULT_WARMUP_STEPS,
         help="head LR warm-up, in RL steps (under --growmtp_head_update policy_step the schedule advances with "
              "every policy optimizer step)")
    flag("head_min_lr_ratio", aliases=("min_lr_ratio",), type=float, default=DEFAULT_MIN_LR_RATIO,
         help="head LR cosine floor, fraction of peak")
    flag("loss", type=str, default="dca", choices=OBJECTIVES,
         help="the head's objective: dca (the paper's), tv, ce, kl, or hybrid: lambda CE + (1 - lambda) DCA with "
              "lambda = exp(-3 alpha_1), alpha_1 the previous RL step's realised first-draft acceptance (a cold "
              "start from a random head; docs/from_scratch.md). Default: %(default)s")
    flag("alpha_estimate", type=str, default="residual", choices=ALPHA_ESTIMATES,
         help="the update's alpha on the recorded top-k: residual (plus one bin for the mass outside it, an upper "
              "bound of the true alpha) or topk (the top-k overlap alone, a lower bound). Default: %(default)s")
    group.add_argument("--growmtp_vgm", "--growmtp.vgm", dest="growmtp.vgm", action="store_true", default=True,
                       help="verify-gated masking: stop each chain at its first rejection (default on)")
    group.add_argument("--growmtp_no_vgm", "--growmtp.no_vgm", dest="growmtp.vgm", action="store_false",
                       help="train every draft position (ablation)")
    flag("mode", type=str, default="detached", choices=MODES,
         help="detached: head loss reaches only the head; joint: it also trains the backbone; "
              "frozen: the head drafts but is never updated")
    flag("topk", type=int, default=DEFAULT_TOPK, help="target log-probs recorded per draft position")
    flag("chunk_cycles", type=int, default=None,
         help=f"cycles reconstructed per forward/backward (default: {CHUNK_CYCLES['cuda']} on a GPU, "
              f"{CHUNK_CYCLES['cpu']} on a CPU)")
    group.add_argument("--growmtp_teacher_forcing", "--growmtp.teacher_forcing", dest="growmtp.teacher_forcing",
                       action="store_true", default=False,
                       help="train on the committed response instead of the recorded draft paths (ablation)")
    flag("neg_adv_weight", type=float, default=1.0,
         help="weight of the policy loss on tokens with a negative advantage (the paper's GRPO uses 0.5); "
              "applies to every run, --growmtp_k 0 included; 1.0 is upstream's loss")
    group.add_argument("--growmtp_log_lag", "--growmtp.log_lag", dest="growmtp.log_lag", action="store_true",
                       default=False,
                       help="after each head step, also log growmtp/lag_alpha_k: the updated head's alpha on the "
                            "records it was trained on (the next step's head_alpha_k is its alpha on the next "
                            "policy's); keeps the step's hidden states and costs one more forward of the head")
    group.add_argument("--growmtp_check_sync", "--growmtp.check_sync", dest="growmtp.check_sync",
                       action="store_true", default=False,
                       help="after every sync, compare the engines' head parameters with the trainer's and log "
                            "growmtp/head_sync_max_diff (gathers the head each step; for debugging and tests)")
    add_draft_vocab_flag(flag)


def growmtp_options(flat: dict) -> dict:
    """The growmtp.* entries of a flat namespace dict, without the prefix."""
    return {key.split(".", 1)[1]: value for key, value in flat.items() if key.startswith("growmtp.")}


def check_args(flat: dict) -> list[str]:
    """Every problem with this configuration (empty when it can run). `flat` is vars(parsed namespace)."""
    g = growmtp_options(flat)
    k = g.get("k", 0)
    if k < 0:
        return [f"--growmtp_k must be >= 0 (0 = off), got {k}"]
    errors = check_engine_args(flat)
    if not 0 < g.get("neg_adv_weight", 1.0) < INF:
        errors.append(f"--growmtp_neg_adv_weight must be a finite number > 0, got {g.get('neg_adv_weight')}")
    max_len, new_tokens = flat.get("data.max_len"), flat.get("rollout.max_new_tokens")
    if max_len is not None and new_tokens is not None and new_tokens >= max_len:
        # upstream's agent counts --data.max_len as prompt + response and keeps the prompt's last
        # (max_len - max_new_tokens) tokens: none here (vLLM then refuses the empty prompt mid-run)
        errors.append(f"--rollout.max_new_tokens ({new_tokens}) must be below --data.max_len ({max_len}), the "
                      "prompt and response together: it leaves no room for the prompt")
    errors += check_draft_vocab(flat)
    # the head's own settings, with any K: a value out of range is a mistake even where K 0 leaves it unread
    if g["mode"] not in MODES:
        errors.append(f"--growmtp_mode must be one of {MODES}, got {g['mode']!r}")
    chunk_ok = g["chunk_cycles"] is None or g["chunk_cycles"] >= 1  # None: the device's (CHUNK_CYCLES)
    if g["topk"] < 1 or not chunk_ok or g["head_warmup_steps"] < 0 or not 0 <= g["head_min_lr_ratio"] <= 1:
        errors.append("--growmtp_topk and --growmtp_chunk_cycles must be >= 1, --growmtp_head_warmup_steps >= 0 "
                      f"and --growmtp_head_min_lr_ratio in [0, 1]; got {g['topk']}, {g['chunk_cycles']}, "
                      f"{g['head_warmup_steps']}, {g['head_min_lr_ratio']}")
    if g.get("head_lr") is not None and not 0 < g["head_lr"] < INF:  # NaN too: it would reach every engine
        errors.append(f"--growmtp_head_lr must be a finite number > 0, got {g['head_lr']}")
    if k == 0:
        if (g.get("depth", "fixed") != "fixed" or g.get("cycle_costs") is not None
                or g.get("committed_loss", False)):
            errors.append("--growmtp_depth auto (and its --growmtp_cycle_costs, --growmtp_committed_loss) chooses "
                          "a depth up to K: it needs --growmtp_k >= 1")
        return errors
    get = flat.get
    # Drafting is sampled from q and verified by rejection sampling; the records describe that process only.
    # Evaluation drafts in the same engines: upstream takes every other sampling setting of it (top_p, top_k,
    # max_new_tokens) from the rollout's, so only its temperature and sample count are its own.
    temperatures = ["rollout.temperature"] + (["eval.temperature"] if get("eval.dataset") else [])
    for name in temperatures:
        temperature = get(name, 1.0)
        if temperature is None or not 0 < temperature < INF:
            errors.append(f"GrowMTP drafts by sampling: --{name} must be a finite number > 0 (got {temperature}); "
                          "greedy drafting is not supported")
    if get("eval.dataset") and not (get("eval.n_samples_per_prompt") or 0) >= 1:
        errors.append(f"--eval.n_samples_per_prompt must be >= 1, got {get('eval.n_samples_per_prompt')}")
    if get("rollout.top_p", 1.0) != 1.0 or get("rollout.top_k", -1) not in (-1, 0, None):
        errors.append("GrowMTP records need the full target distribution: use --rollout.top_p 1.0 and no "
                      f"--rollout.top_k (got top_p={get('rollout.top_p')}, top_k={get('rollout.top_k')}); "
                      "evaluation samples with them too")
    if (get("ds.lora.rank") or 0) > 0:
        errors.append(f"--ds.lora.rank {get('ds.lora.rank')}: LoRA is not supported with a GrowMTP head (--growmtp_k "
                      "> 0): the head is a module of the policy's HF model, which LoRA wraps and freezes, with its own "
                      "param group, export and weight sync of the full policy. Train the full policy, or run LoRA "
                      "without the head (--growmtp_k 0, on a GPU)")
    if not get("vllm.num_engines"):
        errors.append("GrowMTP drafts inside vLLM: set --vllm.num_engines >= 1")
    if get("train.async_enable") and get("train.partial_rollout_enable"):
        errors.append("--train.partial_rollout_enable is not supported with GrowMTP: a sample continued across a "
                      "weight update would mix two policies' cycles in one record")
    if get("train.agent_func_path"):
        errors.append("--train.agent_func_path (multi-turn agents) is not supported with GrowMTP: records "
                      "describe one generate call per sample")
    if g.get("log_lag") and (g["mode"] == "frozen" or g.get("teacher_forcing")):
        errors.append("--growmtp_log_lag measures a training head on its draft paths: it needs a head that trains "
                      "on them (not --growmtp_mode frozen or --growmtp_teacher_forcing)")
    errors += check_depth(g, k, get("train.async_enable"))
    if g["mode"] != "frozen":
        errors += check_training_layout(flat)
    errors += _check_head(flat, g, k)
    return errors


def _check_head(flat: dict, g: dict, k: int) -> list[str]:
    model = flat.get("actor.model_name_or_path")
    family = text_config = raw = model_dir = None
    try:
        if model:  # a local directory or a hub id (its cached snapshot, fetched when the hub is reachable)
            model_dir = local_dir(model)
            family, text_config, raw = resolve_backbone(model_dir)
            check_text_only(model_dir)
    except ModelLocationError as err:  # names the model itself
        return [f"--actor.model_name_or_path {err}"]
    except (HeadCheckpointError, KeyError, ValueError) as err:
        return [f"--actor.model_name_or_path {model}: {err}"]
    source = g["head"]
    if source in HEAD_SOURCES:
        if family is None:
            return [f"--growmtp_head {source} reads the model's config: set --actor.model_name_or_path (a local "
                    "model directory or a hub id)"]
        if source == "native" and native_head_layers(family, raw) == 0:
            return [f"--growmtp_head native: {model} ships no native MTP layer ({family.name} config field "
                    f"{family.native_layers_field!r} is 0 or missing); use --growmtp_head random"]
        if source == "native" and native_head_tensor_names(model_dir) == []:
            # e.g. a checkpoint saved by transformers' Qwen3_5ForCausalLM, which drops mtp.* on load
            return [f"--growmtp_head native: {model}'s config declares an MTP layer but its weights hold no "
                    f"{family.native_prefix}* tensors; use a checkpoint with them, or --growmtp_head random"]
        max_depth = MAX_DRAFT_DEPTH
    else:
        try:  # a local directory or a hub id's cached snapshot, checked whole: it drafts from the first rollout
            head_dir = local_dir(source, weights=True)
            policy = None if family is None else (family, text_config, str(model))
            config = check_head_dir(head_dir, policy)
        except (HeadCheckpointError, ModelLocationError) as err:
            return [f"--growmtp_head: {err}"]
        declared = int(getattr(config, "max_draft_depth", MAX_DRAFT_DEPTH))
        if k > declared:
            return [f"--growmtp_k {k} is deeper than the head at --growmtp_head {source} drafts "
                    f"({head_dir}/config.json: max_draft_depth {declared})"]
        max_depth = min(declared, MAX_DRAFT_DEPTH)  # a head may lower the tested limit, never raise it
    if k > max_depth:
        return [f"--growmtp_k {k} is deeper than this head supports (max {max_depth})"]
    return []


class _Parsed(Exception):
    def __init__(self, namespace):
        self.namespace = namespace


def parse_train_args(argv: list[str]):
    """Upstream's parser (built inside its `__main__` block) plus the GrowMTP flags, on `argv`.

    Returns the flat namespace; upstream's post-parse checks and train() do not run.
    """
    import runpy
    import sys

    original, saved_argv = argparse.ArgumentParser.parse_args, sys.argv

    def capture(parser, args=None, namespace=None):
        add_growmtp_args(parser)
        raise _Parsed(original(parser, args, namespace))

    argparse.ArgumentParser.parse_args = capture
    sys.argv = ["train_ppo_ray", *argv]
    try:
        runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__")
    except _Parsed as parsed:
        return parsed.namespace
    finally:
        argparse.ArgumentParser.parse_args, sys.argv = original, saved_argv
    raise RuntimeError("upstream's train_ppo_ray never parsed its arguments")


def resolve_head_lr(g: dict) -> float:
    if g.get("head_lr") is not None:
        return float(g["head_lr"])
    return DEFAULT_HEAD_LR["native" if g["head"] == "native" else "random"]


def describe(args) -> str:
    """One line for the launch log."""
    return "GrowMTP: " + json.dumps(dict(sorted(vars(args.growmtp).items())), default=str)
