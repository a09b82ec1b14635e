"""Check `trainer_step` of the GPU check: the RL step's training side on one device, in one process, with no
Ray and no vLLM (`gpu_standins` answers for their names).

1. A policy at Qwen3-4B's widths (`trainer_layers` layers; the real plan takes as many as the device's
   memory holds under ZeRO-3, `layers_that_fit`) and a random K = 5 head bound to it, both bf16.
2. The reference drafter (`gpu_drafter`) rolls out `trainer_responses` responses with that head on the
   device, its tau set to the paper's 2.91; its records are validated as the trainer validates them.
3. Upstream's actor-side step twice, each from the same saved policy and the same experience (the
   drafted sequences, their log-probs, random advantages): upstream's DeepSpeed strategy (ZeRO-3, bf16)
   and `ActorPPOTrainer`, without the head; then our strategy (`get_strategy`: the head in its own
   parameter group) and `GrowMTPActorTrainer.ppo_train` (its head step), with the head (detached, the
   paper's schedule). Each runs `trainer_steps` RL steps; the last one is timed.
It shows:
- the policy's parameters after the steps: bit-identical with and without the head. Both runs use
  torch's deterministic algorithms, strict (upstream's `--train.full_determinism_enable`), so nothing but
  the head could make them differ; an operator without a deterministic implementation raises. Should they
  differ all the same, upstream runs a second time, and how far it lands from itself is reported beside;
- the head's parameters moved: every weight matrix differs from where it started;
- the head's share of the whole step: the head update's seconds (the step's `growmtp/head_update_s`) over
  the step with it, and the step with the head over the step without, measured one after the other.
4. The production step: the same two runs again without strict determinism (strict mode fills every new
   tensor and takes the deterministic kernels: no run trains under it), timed, and per token beside the plain
   forward + backward of the same policy over the same sequences (`bench_common.policy_step`, micro-batches of
   `micro_batch`, gradient checkpointing on as in the step; no optimizer).
DeepSpeed's optimizer is torch's AdamW (`torch_adam`): DeepSpeed's fused Adam is a C++/CUDA build at first
use, which an offline GPU machine may not be able to make; the update is the same AdamW.
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import gpu_standins
import torch
from gpu_drafter import calibrate_head, draft_rollouts, first_accept_z
from gpu_report import Row
from gpu_sampler import Z_LIMIT  # the drafter's first acceptance, held as check (d) holds its own
from gpu_world import build_head, flatten_policy_logits_

# Bytes per parameter (the policy's and the head's) at the peak of the step, measured: on an H100 (2026-11-27)
# 18 layers, 2.32B parameters with the head, ran out of memory in our run's optimizer step with 75.88 GiB
# allocated and 3.76 GiB more asked: at least 36.9 bytes per parameter. ZeRO-3's state in bf16 is 20 of them
# (bf16 weight and gradient, fp32 master, momentum, variance and gradient partition); torch's multi-tensor
# AdamW adds a temporary of its sub-group's size at the step (the 3.76 GiB); the rest (activations, what the
# run before left on the device) that run did not separate (`memory_mb` in the JSON now does).
PEAK_BYTES_PER_PARAM = 37
# Environment variables upstream's --train.full_determinism_enable sets (transformers' enable_full_determinism)
DETERMINISM_ENV = ("CUDA_LAUNCH_BLOCKING", "CUBLAS_WORKSPACE_CONFIG", "ASCEND_LAUNCH_BLOCKING", "HCCL_DETERMINISTIC",
                   "FLASH_ATTENTION_DETERMINISTIC")


def layers_that_fit(config, memory_bytes: int, share: float = 0.8) -> int:
    """Decoder layers of `config`'s widths whose step, with the embedding and a head layer, peaks within `share`
    of `memory_bytes` (the rest: the allocator's slack, and what the measured lower bound of
    `PEAK_BYTES_PER_PARAM` may miss); at least 1, at most 36."""
    h, inter = config.hidden_size, config.intermediate_size
    attn = h * config.head_dim * (config.num_attention_heads * 2 + config.num_key_value_heads * 2)
    layer = attn + 3 * h * inter
    fixed = config.vocab_size * h + layer + 2 * h * h  # embedding (tied), the head's layer and fc
    fit = (share * memory_bytes / PEAK_BYTES_PER_PARAM - fixed) // layer
    return int(max(1, min(36, fit)))


@contextlib.contextmanager
def determinism_restored():
    """Upstream's --train.full_determinism_enable switches torch's deterministic algorithms on for the whole
    process (strict, with cuDNN's deterministic mode and environment variables): the checks after this one
    must not be timed under it. (On the H100 on 2026-11-27, `cycle_cost` run after `trainer_step` in one
    process timed decode steps ~3x as long as in a process of its own: deterministic mode fills every new
    tensor, a launch more per allocation, and the eager steps there are launch-bound.)"""
    env = {name: os.environ.get(name) for name in DETERMINISM_ENV}
    algorithms = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    cudnn = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(algorithms[0], warn_only=algorithms[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn
        for name, value in env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _prepare_process(device: torch.device) -> list[str]:
    """What the actor processes of a run have: torch.distributed's one rank, the CPU layer where there is no
    CUDA, a flash_attn module for upstream's imports, and the stand-ins for Ray and vLLM (returned: the
    packages stood in for; none where they were imported already)."""
    standins = gpu_standins.install(force=True)
    from openrlhf_growmtp import cpu_support
    from openrlhf_growmtp.trainer import installer

    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's deterministic mode
        import importlib.util

        if importlib.util.find_spec("flash_attn") is None:  # upstream imports its padding helpers only
            sys.path.insert(0, str(cpu_support.SHIM_DIR))
    else:
        installer.install_cpu_support()
    if not torch.distributed.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
    return standins


def _train_args(policy_dir: Path, work: Path, plan, head_dir: Path | None, strict: bool = True):
    from openrlhf.utils.config import hierarchize

    from openrlhf_growmtp.trainer.args import parse_train_args

    batch = plan.trainer_responses
    argv = ["--actor.model_name_or_path", str(policy_dir), "--ds.zero_stage", "3", "--ds.attn_implementation", "sdpa",
            "--ds.param_dtype", "bf16", "--train.batch_size", str(batch), "--train.micro_batch_size",
            str(plan.micro_batch), "--rollout.batch_size", str(batch // 2), "--rollout.n_samples_per_prompt", "2",
            "--algo.advantage.estimator", "group_norm", "--algo.kl.init_coef", "0", "--actor.adam.lr", "1e-3",
            "--actor.lr_warmup_ratio", "0", "--vllm.num_engines", "1", "--ckpt.path", str(work / "ckpt"),
            "--train.seed", "1", "--actor.gradient_checkpointing_enable"] + (["--train.full_determinism_enable"]
                                                                                 if strict else [])
    if head_dir is not None:
        argv += ["--growmtp_k", str(plan.k), "--growmtp_mode", "detached", "--growmtp_topk", str(plan.topk),
                 "--growmtp_chunk_cycles", str(plan.chunk_cycles)]
    args = hierarchize(parse_train_args(argv))
    # what upstream's __main__ fills in after parsing (parse_train_args stops before it)
    args.actor.eps_clip_low_high = (args.actor.eps_clip, args.actor.eps_clip)
    args.algo.advantage.is_correction_threshold.insert(0, 0.0)
    if head_dir is not None:
        args.growmtp.head_dir = str(head_dir)
    return args


def _experience(sequences: torch.Tensor, logp: torch.Tensor, prompt: int, records, seed: int):
    from openrlhf.trainer.ppo_utils.experience import Experience

    batch, length = sequences.shape
    response = length - prompt
    g = torch.Generator().manual_seed(seed)
    info = {"reward": torch.rand(batch, generator=g)}
    if records is not None:
        info["growmtp_record"] = [r.pack() for r in records]
        info["growmtp_accepted"] = [r.accepted.tolist() for r in records]
    return Experience(sequences=sequences.clone(), attention_mask=torch.ones_like(sequences),
                      action_mask=torch.ones(batch, response, dtype=torch.bool), action_log_probs=logp.clone(),
                      advantages=torch.randn(batch, response, generator=g),
                      response_length=torch.full((batch,), float(response)),
                      total_length=torch.full((batch,), float(length)), info=info)


def _gathered(module) -> dict[str, torch.Tensor]:
    import deepspeed

    params = dict(module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {name: p.detach().float().cpu().clone() for name, p in params.items()}


def _run_steps(args, ours: bool, make_experience, steps: int, device: torch.device, gather: bool = True) -> dict:
    """Build strategy, actor and actor-side trainer as the policy actor does; `steps` RL steps, each on a
    fresh copy of the same experience; the steps' times and (where `gather`) the parameters after them."""
    from openrlhf_growmtp.trainer import strategy as ours_strategy

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        at_start = torch.cuda.memory_allocated(device)
    trainer, parts = _actor_trainer(args, ours)
    seconds, status = [], {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            trainer.replay_buffer.clear()
            trainer.replay_buffer.append(make_experience(step))
            _sync(device)
            t0 = time.perf_counter()
            status = trainer.ppo_train(0.0)
            _sync(device)
            seconds.append(time.perf_counter() - t0)
    nondeterministic = sorted({str(w.message).split("\n")[0][:160] for w in caught
                               if "deterministic" in str(w.message)})
    hf_model = parts[0].model.module
    head = ours_strategy.head_of(hf_model)
    policy = None
    if gather:
        with ours_strategy.without_head(hf_model):
            policy = _gathered(hf_model)
    out = {"seconds": seconds, "status": {k: float(v) for k, v in status.items() if isinstance(v, (int, float))},
           "policy": policy, "head": _gathered(head) if head is not None and gather else None,
           "nondeterministic_ops": nondeterministic,
           "memory_mb": {"at_start": at_start / 2**20, "peak": torch.cuda.max_memory_allocated(device) / 2**20}
           if device.type == "cuda" else None}
    with contextlib.suppress(Exception):
        parts[0].model.destroy()
    del trainer, parts
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _actor_trainer(args, ours: bool):
    """Our strategy and `GrowMTPActorTrainer`, or upstream's strategy and `ActorPPOTrainer`, set up as the policy
    actor sets them up; the trainer and (actor, optimizer, scheduler, strategy)."""
    from openrlhf.models import Actor
    from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer
    from openrlhf.utils import get_strategy as upstream_get_strategy

    from openrlhf_growmtp.trainer import ppo_actor, strategy as ours_strategy

    strategy = ours_strategy.get_strategy(args) if ours else upstream_get_strategy(args)
    # upstream's enable_full_determinism, strict as upstream sets it: an operator without a deterministic kernel
    # raises (the check's error names it), and attention's backward takes its deterministic kernels (with
    # warn_only, as the first device run had it, cuDNN's attention ran its non-deterministic backward)
    strategy.setup_distributed()
    train_config = strategy.get_ds_train_config

    def torch_adam_config(*a, **kw):
        config = train_config(*a, **kw)
        if "optimizer" in config:
            config["optimizer"].setdefault("params", {})["torch_adam"] = True
        return config

    strategy.get_ds_train_config = torch_adam_config
    actor = Actor(args.actor.model_name_or_path, attn_implementation="sdpa", param_dtype="bf16",
                  ds_config=strategy.get_ds_train_config(), packing_samples=args.ds.packing_samples)
    actor.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    cfg = dict(optim="adam", muon=vars(args.actor.muon), adam=vars(args.actor.adam),
               lr_scheduler=args.actor.lr_scheduler, lr_warmup_ratio=args.actor.lr_warmup_ratio,
               min_lr_ratio=args.actor.min_lr_ratio, max_norm=args.actor.max_norm, scheduler_steps=10)
    actor, optimizer, scheduler = strategy.prepare((actor, cfg))
    trainer = (ppo_actor.GrowMTPActorTrainer if ours else ActorPPOTrainer)(
        strategy, actor, None, optimizer, scheduler, micro_train_batch_size=args.train.micro_batch_size,
        tokenizer=None, vllm_engines=None)
    return trainer, (actor, optimizer, scheduler, strategy)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _build_policy(config, device, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config.from_dict(config.to_dict())
    config._attn_implementation = "sdpa"
    with torch.device(device):
        policy = Qwen3ForCausalLM(config)
    return flatten_policy_logits_(policy.to(torch.bfloat16).eval())


@dataclass
class Drafted:
    """The experience both runs train on: the reference drafter's sequences and records, and the rollout policy's
    log-probs of their response tokens; the policy and the head as they were saved under the work directory."""

    sequences: torch.Tensor
    logp: torch.Tensor
    rollouts: object  # gpu_drafter.Rollouts
    calibration: dict
    z: float
    initial_head: dict[str, torch.Tensor]


def _draft(plan, config, device: torch.device, work: Path, log) -> Drafted:
    """A policy of `config` and a random head, the head's tau set to the plan's, their rollouts drafted and
    validated, the old policy's log-probs; both models saved under `work` and released from the device."""
    from openrlhf_growmtp.core.checkpoint import export_head, load_head
    from openrlhf_growmtp.core.validation import validate_records

    policy = _build_policy(config, device)
    head = build_head(policy, torch.bfloat16)
    g = torch.Generator(device=device).manual_seed(1)
    prompts = torch.randint(0, config.vocab_size, (plan.trainer_responses, plan.trainer_prompt), device=device,
                            generator=g)
    calibration = calibrate_head(policy, head, prompts, plan.tau_target, plan.k)
    rollouts = draft_rollouts(policy, head, prompts, plan.trainer_response_tokens, plan.k, plan.topk)
    records = rollouts.records
    validate_records(records, depth=plan.k, vocab_size=config.vocab_size, topk=plan.topk)
    log(f"  (trainer_step) drafted {len(records)} x {records[0].token_ids.numel()} tokens, {rollouts.cycles} "
        f"cycles at tau {rollouts.tau:.2f} in {rollouts.seconds:.1f} s")
    sequences = torch.stack([r.token_ids for r in records])
    with torch.no_grad():  # the rollout policy's log-probs of the sampled tokens (the old policy of the step)
        logits = policy(input_ids=sequences.to(device)).logits.float()
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, sequences[:, 1:, None].to(device))[..., 0]
    policy.save_pretrained(work / "policy")
    export_head(head, work / "head")
    del policy, head, logits
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    initial_head = {n: p.to(torch.bfloat16).float() for n, p in load_head(work / "head").state_dict().items()}
    return Drafted(sequences, logp[:, plan.trainer_prompt - 1:].cpu(), rollouts, calibration, first_accept_z(rollouts),
                   initial_head)


def _both_runs(plan, work: Path, drafted: Drafted, device: torch.device, log
               ) -> tuple[dict, dict, dict | None, dict]:
    """Upstream's steps without the head, ours with it, from the same saved policy and experience, under
    upstream's full determinism (given back afterwards); upstream once more where the policies differ; then the
    pair again without it (the production step, its parameters not gathered)."""
    records = drafted.rollouts.records

    def experience(with_records: bool):
        return lambda step: _experience(drafted.sequences, drafted.logp, plan.trainer_prompt,
                                        records if with_records else None, seed=10 + step)

    def upstream(run: str) -> dict:
        return _run_steps(_train_args(work / "policy", work / run, plan, None), False, experience(False),
                          plan.trainer_steps, device)

    with determinism_restored():
        without = upstream("up")
        log(f"  (trainer_step) upstream, no head: steps {', '.join(f'{s:.2f}' for s in without['seconds'])} s")
        with_head = _run_steps(_train_args(work / "policy", work / "ours", plan, work / "head"), True,
                               experience(True), plan.trainer_steps, device)
        log(f"  (trainer_step) ours, with the head: steps {', '.join(f'{s:.2f}' for s in with_head['seconds'])} s")
        control = None
        if _differences(without["policy"], with_head["policy"])[0]:  # the head's doing, or the device's?
            again = upstream("up_again")
            names, largest = _differences(without["policy"], again["policy"])
            control = {"differing": len(names), "max_abs_diff": largest}
            log(f"  (trainer_step) upstream against itself: {control['differing']} tensors differ")
    production = {"without_head": _run_steps(_train_args(work / "policy", work / "up_prod", plan, None, strict=False),
                                             False, experience(False), plan.trainer_steps, device, gather=False)}
    log(f"  (trainer_step) production (not strict), no head: steps "
        f"{', '.join(f'{s:.2f}' for s in production['without_head']['seconds'])} s")
    production["with_head"] = _run_steps(_train_args(work / "policy", work / "ours_prod", plan, work / "head",
                                                     strict=False), True, experience(True), plan.trainer_steps,
                                         device, gather=False)
    log(f"  (trainer_step) production (not strict), with the head: steps "
        f"{', '.join(f'{s:.2f}' for s in production['with_head']['seconds'])} s")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return without, with_head, control, production


def _plain_forward_backward(config, sequences: torch.Tensor, micro_batch: int, device: torch.device) -> float:
    """Seconds of the policy's plain forward + backward (`bench_common.policy_step`, gradient checkpointing on)
    over `sequences` in micro-batches, the second of two passes (the first warms up)."""
    from bench_common import policy_step

    policy = _build_policy(config, device).train()
    policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    seconds = []
    for _ in range(2):
        policy.zero_grad(set_to_none=False)
        _sync(device)
        t0 = time.perf_counter()
        for lo in range(0, sequences.shape[0], micro_batch):
            policy_step(policy, sequences[lo:lo + micro_batch].to(device))
        _sync(device)
        seconds.append(time.perf_counter() - t0)
    del policy
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return seconds[-1]


def _production(plan, runs: dict, plain_s: float, tokens: int) -> dict:
    """The production steps' times (the last of each run), per token, over the plain forward + backward's."""
    step = {name: run["seconds"][-1] for name, run in runs.items()}
    head_s = runs["with_head"]["status"].get("growmtp/head_update_s", float("nan"))
    return {"deterministic_algorithms": "off", "steps": plan.trainer_steps, "tokens": tokens,
            "seconds": {name: run["seconds"] for name, run in runs.items()},
            "step_s": step, "head_update_s": head_s, "head_share_of_step": head_s / step["with_head"],
            "step_ratio_with_over_without": step["with_head"] / step["without_head"],
            "plain_forward_backward_s": plain_s,
            "per_token_s": {**{name: s / tokens for name, s in step.items()},
                            "plain_forward_backward": plain_s / tokens},
            "step_over_plain_forward_backward": {name: s / plain_s for name, s in step.items()},
            "memory_mb": {name: run["memory_mb"] for name, run in runs.items()}}


def check_trainer_step(plan, config, device: torch.device, log) -> tuple[list[Row], dict]:
    """`config`: the policy's (its depth chosen by the caller)."""
    standins = _prepare_process(device)
    work = Path(tempfile.mkdtemp(prefix="gpu_trainer_"))
    drafted = _draft(plan, config, device, work, log)
    without, with_head, control, production = _both_runs(plan, work, drafted, device, log)
    plain_s = _plain_forward_backward(config, drafted.sequences, plan.micro_batch, device)
    rollouts, status = drafted.rollouts, with_head["status"]
    differing, worst = _differences(without["policy"], with_head["policy"])
    matrices = [n for n, p in with_head["head"].items() if p.ndim == 2]
    step_without, step_with = without["seconds"][-1], with_head["seconds"][-1]
    head_s = status.get("growmtp/head_update_s", float("nan"))
    details = {
        "layers": config.num_hidden_layers, "hidden_size": config.hidden_size, "vocab_size": config.vocab_size,
        "responses": plan.trainer_responses, "prompt_tokens": plan.trainer_prompt,
        "sequence_tokens": int(drafted.sequences.shape[1]), "tokens": int(drafted.sequences.numel()),
        "cycles": rollouts.cycles, "tau": rollouts.tau, "micro_batch": plan.micro_batch, "steps": plan.trainer_steps,
        "drafter": {"seconds": rollouts.seconds, "phases": rollouts.phases, "calibration": drafted.calibration,
                    "first_accept_rate": rollouts.first_accept_rate, "first_alpha": rollouts.first_alpha,
                    "z": drafted.z},
        "seconds_without_head": without["seconds"], "seconds_with_head": with_head["seconds"],
        "step_s_without_head": step_without, "step_s_with_head": step_with, "head_update_s": head_s,
        "head_share_of_step": head_s / step_with, "step_ratio_with_over_without": step_with / step_without,
        "policy_tensors": len(without["policy"]), "policy_tensors_differing": differing,
        "policy_max_abs_diff": worst, "policy_tensors_trained": _count_trained(work / "policy", without["policy"]),
        "head_matrices": matrices,
        "head_matrices_moved": [n for n in matrices if not torch.equal(with_head["head"][n], drafted.initial_head[n])],
        "status_with_head": status, "status_without_head": without["status"], "upstream_against_itself": control,
        "memory_mb": {"without_head": without["memory_mb"], "with_head": with_head["memory_mb"]},
        "nondeterministic_ops": sorted(set(without["nondeterministic_ops"] + with_head["nondeterministic_ops"])),
        "optimizer": "torch AdamW through DeepSpeed (torch_adam)", "deterministic_algorithms": "strict",
        "standins": standins,
        "production": _production(plan, production, plain_s, int(drafted.sequences.numel())),
    }
    details["strict_over_production"] = {"without_head": step_without / details["production"]["step_s"]["without_head"],
                                         "with_head": step_with / details["production"]["step_s"]["with_head"]}
    return _rows(plan, details) + _production_rows(details), details


def _rows(plan, d: dict) -> list[Row]:
    n, differing, control = d["policy_tensors"], d["policy_tensors_differing"], d["upstream_against_itself"]
    z, tau, cycles = d["drafter"]["z"], d["tau"], d["cycles"]
    head_s, step_with, step_without = d["head_update_s"], d["step_s_with_head"], d["step_s_without_head"]
    moved, matrices = d["head_matrices_moved"], d["head_matrices"]
    return [
        Row("trainer_step", f"reference drafter: first-draft acceptance vs sum min(p, q), {cycles} cycles",
            f"z {z:.2f} ({d['drafter']['first_accept_rate']:.3f} vs {d['drafter']['first_alpha']:.3f}); tau {tau:.2f}",
            f"|z| <= {Z_LIMIT:g}", abs(z) <= Z_LIMIT, {"z": z, "tau": tau}),
        Row("trainer_step", f"policy after {plan.trainer_steps} ZeRO-3 bf16 steps, {d['layers']} "
            f"layers: ours with the head vs upstream without", f"{n - len(differing)} of {n} tensors identical"
            + (f", max|d| {d['policy_max_abs_diff']:.1e}" if differing else "")
            + (f"; upstream vs itself: {n - control['differing']} identical, max|d| {control['max_abs_diff']:.1e}"
               if control else ""), f"bit-identical; {d['policy_tensors_trained']} of {n} trained",
            not differing and d["policy_tensors_trained"] > 0
            and d["status_with_head"].get("growmtp/head_finite") == 1.0,
            {"differing": len(differing), "max_abs_diff": d["policy_max_abs_diff"]}),
        Row("trainer_step", "head's weight matrices moved", f"{len(moved)} of {len(matrices)}", "all",
            bool(matrices) and len(moved) == len(matrices), {"moved": len(moved)}),
        Row("trainer_step", f"head update / whole step with it, {d['tokens']} tokens, {cycles} cycles",
            f"{head_s / step_with:.3f}", f"{head_s:.2f} s / {step_with:.2f} s (last of {plan.trainer_steps} steps)",
            None, {"ratio": head_s / step_with}),
        Row("trainer_step", "step with the head / step without (upstream)", f"{step_with / step_without:.3f}",
            f"{step_with:.2f} s / {step_without:.2f} s", None, {"ratio": step_with / step_without}),
    ]


def _production_rows(d: dict) -> list[Row]:
    prod, layers = d["production"], d["layers"]
    per_token, over = prod["per_token_s"], prod["step_over_plain_forward_backward"]
    return [
        Row("trainer_step", f"production step (not strict), {layers} layers, {prod['tokens']} tokens: per token "
            "with the head / without / plain fwd+bwd", f"{per_token['with_head'] * 1e6:.1f} / "
            f"{per_token['without_head'] * 1e6:.1f} / {per_token['plain_forward_backward'] * 1e6:.1f} us",
            f"over plain fwd+bwd: {over['with_head']:.2f}x with, {over['without_head']:.2f}x without; strict / "
            f"production {d['strict_over_production']['without_head']:.2f}x", None,
            {"with_head": over["with_head"], "without_head": over["without_head"]}),
        Row("trainer_step", "production step (not strict): with the head / without; head update / step",
            f"{prod['step_ratio_with_over_without']:.3f}; {prod['head_share_of_step']:.3f}",
            f"{prod['step_s']['with_head']:.2f} s / {prod['step_s']['without_head']:.2f} s", None,
            {"ratio": prod["step_ratio_with_over_without"], "head_share": prod["head_share_of_step"]}),
    ]


def _differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[list[str], float]:
    """The names whose tensors differ, and the largest absolute difference among them."""
    differing = [n for n in a if not torch.equal(a[n], b[n])]
    return differing, max((float((a[n] - b[n]).abs().max()) for n in differing), default=0.0)


def _count_trained(policy_dir: Path, params: dict[str, torch.Tensor]) -> int:
    """How many of `params` differ from the saved policy's tensors of the same name."""
    from safetensors import safe_open

    changed = 0
    for path in sorted(policy_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                if name in params:
                    changed += not torch.equal(params[name], f.get_tensor(name).float())
    return changed
