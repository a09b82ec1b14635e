"""One run of check `trainer_step` (`gpu_trainer.py`) in a process of its own: upstream's or our actor-side RL
steps under DeepSpeed ZeRO-3 in bf16 (kind "step"), or the policy's plain forward + backward over the same
sequences (kind "plain").

Why a process each: a DeepSpeed engine outlives every reference the check holds to it. Its ZeRO-3 hooks and
module stack keep the engine, its optimizer and Adam's state alive: with every run in one process, all four
runs' engines were alive at the end on CPU, and on an H100 the second run started with 26 GB of the first's
still allocated. A process that ends gives all of it back, so no run starts with memory an earlier one held.
Each run records what was held when it started (`held`), how many engines it counts while its own is alive
(the counter is not blind), and, once its result is saved, how many are still alive after the teardown the
check did when the runs shared a process (`engines_after_teardown`).

    python -m benchmarks.gpu_check.gpu_trainer_run SPEC.json

SPEC.json (written by gpu_trainer.py) says what to run and where its result goes. The process's stdout and
stderr are the run's log (the parent points both at one file). The result JSON is written when the run
starts and again when it ends. On an error the traceback goes to the log and to the JSON first, with no CUDA
call in between (after a device-side assert every CUDA call fails), and the process then ends without tearing
anything down; `faulthandler` writes every thread's stack to the log if the process dies in C.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import json
import os
import signal
import socket
import sys
import time
import traceback
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch

from benchmarks.gpu_check.gpu_fused_adam import FUSED, TORCH_ADAM
from benchmarks.gpu_check.gpu_report import write_json

ROOT = Path(__file__).resolve().parents[2]


class CutOff(BaseException):
    """SIGTERM (the budget's end): recorded as this run's error, like any other."""


def held(device: torch.device) -> dict:
    """What this process holds now: live DeepSpeed engines (gc), and on CUDA the memory torch has allocated and
    reserved here and the device's memory in use by every process (the check's own included)."""
    out = {"deepspeed_engines": live_engines(), "pid": os.getpid()}
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        out.update(cuda_allocated_mib=torch.cuda.memory_allocated(device) / 2**20,
                   cuda_reserved_mib=torch.cuda.memory_reserved(device) / 2**20,
                   device_used_mib=(total - free) / 2**20)
    return out


def live_engines() -> int:
    """DeepSpeed engines this process still holds (none where DeepSpeed was never imported)."""
    engine = sys.modules.get("deepspeed.runtime.engine")
    if engine is None:
        return 0
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on every object wakes deprecated module attributes
        warnings.simplefilter("ignore")
        return sum(isinstance(o, engine.DeepSpeedEngine) for o in gc.get_objects())


def main(spec_path: str) -> None:
    faulthandler.enable()
    spec = json.loads(Path(spec_path).read_text())
    device = torch.device(spec["device"])
    if device.type == "cpu":
        torch.set_num_threads(1)  # as gpu_check.py runs tiny shapes: one thread
    result_path = Path(spec["result"])
    print(f"gpu_trainer_run: {spec['name']} ({spec['kind']}) on {device.type}, pid {os.getpid()}", flush=True)
    result = {"name": spec["name"], "kind": spec["kind"], "stage": "started", "ok": False, "error": None,
              "launch_blocking": os.environ.get("CUDA_LAUNCH_BLOCKING") == "1", "held_at_start": held(device)}
    write_json(result_path, result)
    signal.signal(signal.SIGTERM, _cut_off)
    teardown = None
    try:
        result.update(RUNS[spec["kind"]](spec, device))
        teardown = result.pop("teardown", None)
        result.update(ok=True, stage="done")
    except BaseException:
        error = traceback.format_exc()  # the first traceback, before anything else can fail
        sys.stderr.write(error)
        sys.stderr.flush()
        result.update(error=error, stage="failed")
    write_json(result_path, result)
    if teardown is not None:  # after the result is safe: what one process would have carried into the next run
        with contextlib.suppress(Exception):
            result["engines_after_teardown"] = teardown()
            write_json(result_path, result)
    print(f"gpu_trainer_run: {spec['name']} {result['stage']}", flush=True)
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0 if result["ok"] else 1)  # no teardown: the process's end gives everything back


def _cut_off(signum, frame):
    raise CutOff(signal.Signals(signum).name)


# ---- kind "step": upstream's or our actor-side RL steps ------------------------------------------------
def run_step(spec: dict, device: torch.device) -> dict:
    plan = SimpleNamespace(**spec["plan"])
    # the experience first: a spec that names none fails here, before DeepSpeed is imported
    sequences, logp, records = _load_experience(Path(spec["experience_dir"]), spec["logp_file"], spec["ours"])
    standins = _prepare_process(device)
    args = _train_args(Path(spec["policy_dir"]), Path(spec["work_dir"]), plan,
                       Path(spec["head_dir"]) if spec["head_dir"] else None, strict=spec["strict"])

    def make_experience(step: int):
        return _experience(sequences, logp, plan.trainer_prompt, records, seed=10 + step)

    out = _run_steps(args, spec["ours"], spec["fused_adam"], make_experience, plan.trainer_steps, device,
                     Path(spec["outputs"]), gather_policy=spec["gather_policy"])
    return {**out, "standins": standins, "optimizer": FUSED if spec["fused_adam"] else TORCH_ADAM,
            "deterministic_algorithms": "strict" if spec["strict"] else "off"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _prepare_process(device: torch.device) -> list[str]:
    """What an actor process of a run has: torch.distributed's one rank, the CPU layer where there is no
    CUDA, a flash_attn module for upstream's imports, and the stand-ins for Ray and vLLM (returned: the
    packages stood in for; none where they were imported already)."""
    from benchmarks.gpu_check import gpu_standins

    standins = gpu_standins.install(force=True)
    from openrlhf_growmtp import cpu_support
    from openrlhf_growmtp.trainer import installer

    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's deterministic mode
        cpu_support.add_flash_attn_shim()  # upstream imports its padding helpers only
    else:
        installer.install_cpu_support()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    return standins


def _train_args(policy_dir: Path, work: Path, plan, head_dir: Path | None, strict: bool):
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


def _load_experience(experience_dir: Path, logp_file: str, with_records: bool):
    """The drafted sequences, the old policy's log-probs of their response tokens, and (`with_records`) the
    records, as `gpu_trainer.save_experience` wrote them."""
    from safetensors.torch import load_file

    from openrlhf_growmtp.core.records import SequenceRecord

    sequences = load_file(str(experience_dir / "sequences.safetensors"))["sequences"]
    logp = load_file(str(experience_dir / logp_file))["logp"]
    records = None
    if with_records:
        records = [SequenceRecord.unpack(p.read_bytes()) for p in sorted((experience_dir / "records").glob("*.rec"))]
    return sequences, logp, records


def _experience(sequences: torch.Tensor, logp: torch.Tensor, prompt: int, records, seed: int):
    from openrlhf.trainer.ppo_utils.experience import Experience

    from openrlhf_growmtp.trainer.keys import RECORD_KEY, PackedRecord

    batch, length = sequences.shape
    response = length - prompt
    g = torch.Generator().manual_seed(seed)
    info = {"reward": torch.rand(batch, generator=g)}
    if records is not None:
        info[RECORD_KEY] = [PackedRecord.of(r) for r in records]
    return Experience(sequences=sequences.clone(), attention_mask=torch.ones_like(sequences),
                      action_mask=torch.ones(batch, response, dtype=torch.bool), action_log_probs=logp.clone(),
                      advantages=torch.randn(batch, response, generator=g),
                      response_length=torch.full((batch,), float(response)),
                      total_length=torch.full((batch,), float(length)), info=info)


def _run_steps(args, ours: bool, fused_adam: bool, make_experience, steps: int, device: torch.device, outputs: Path,
               gather_policy: bool) -> dict:
    """Build strategy, actor and actor-side trainer as the policy actor does; `steps` RL steps, each on a
    fresh copy of the same experience; the steps' times, and the head (where there is one) and (where
    `gather_policy`) the policy after them, saved under `outputs`."""
    from openrlhf_growmtp.trainer import strategy as ours_strategy

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        at_start = torch.cuda.memory_allocated(device)
    trainer, actor = _actor_trainer(args, ours, fused_adam)
    engines = live_engines()
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
    memory = ({"at_start": at_start / 2**20, "peak": torch.cuda.max_memory_allocated(device) / 2**20,
               "peak_reserved": torch.cuda.max_memory_reserved(device) / 2**20} if device.type == "cuda" else None)
    hf_model = actor.model.module
    head = ours_strategy.head_of(hf_model)
    outputs.mkdir(parents=True, exist_ok=True)
    files = {"policy_file": None, "head_file": None}
    if gather_policy:
        with ours_strategy.without_head(hf_model):
            files["policy_file"] = _save_gathered(hf_model, outputs / "policy.safetensors")
    if head is not None:
        files["head_file"] = _save_gathered(head, outputs / "head.safetensors")
    def teardown() -> int:
        """The teardown the check did when every run shared one process; the engines still alive after it."""
        nonlocal trainer, actor, hf_model, head
        actor.model.destroy()
        trainer = actor = hf_model = head = None
        return live_engines()

    return {"seconds": seconds, "status": {k: float(v) for k, v in status.items() if isinstance(v, (int, float))},
            "nondeterministic_ops": nondeterministic, "memory_mb": memory, "engines_while_running": engines,
            "teardown": teardown, **files}


def _save_gathered(module, path: Path) -> str:
    """`module`'s parameters, gathered from their ZeRO-3 partitions, saved as they are (bf16)."""
    import deepspeed
    from safetensors.torch import save_file

    params = dict(module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        save_file({name: p.detach().cpu().contiguous() for name, p in params.items()}, str(path))
    return str(path)


def _actor_trainer(args, ours: bool, fused_adam: bool):
    """Our strategy and `GrowMTPActorTrainer`, or upstream's strategy and `ActorPPOTrainer`, set up as the policy
    actor sets them up (DeepSpeed's fused Adam where `fused_adam`: built on this device, `gpu_fused_adam`; else
    torch's AdamW); the trainer and the actor."""
    from openrlhf.models import Actor
    from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer
    from openrlhf.utils import get_strategy as upstream_get_strategy

    from openrlhf_growmtp.trainer import ppo_actor
    from openrlhf_growmtp.trainer import strategy as ours_strategy

    strategy = ours_strategy.get_strategy(args) if ours else upstream_get_strategy(args)
    # upstream's enable_full_determinism, strict as upstream sets it: an operator without a deterministic kernel
    # raises (the run's error names it), and attention's backward takes its deterministic kernels (with
    # warn_only, as the first device run had it, cuDNN's attention ran its non-deterministic backward)
    strategy.setup_distributed()
    train_config = strategy.get_ds_train_config

    def torch_adam_config(*a, **kw):
        config = train_config(*a, **kw)
        if "optimizer" in config:
            config["optimizer"].setdefault("params", {})["torch_adam"] = True
        return config

    if not fused_adam:
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
    return trainer, actor


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ---- kind "plain": the policy's own forward + backward -------------------------------------------------
def run_plain(spec: dict, device: torch.device) -> dict:
    """Seconds of the policy's plain forward + backward (`bench_common.policy_step`, gradient checkpointing on,
    micro-batches of the plan's) over the drafted sequences, the second of two passes (the first warms up),
    from the same saved policy the steps start from; no optimizer."""
    from safetensors.torch import load_file
    from transformers import Qwen3ForCausalLM

    from benchmarks.shared.bench_common import policy_step

    micro_batch = spec["plan"]["micro_batch"]
    sequences = load_file(str(Path(spec["experience_dir"]) / "sequences.safetensors"))["sequences"]
    policy = Qwen3ForCausalLM.from_pretrained(spec["policy_dir"], dtype=torch.bfloat16, attn_implementation="sdpa")
    policy = policy.to(device).train()
    policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = []
    for _ in range(2):
        policy.zero_grad(set_to_none=False)
        _sync(device)
        t0 = time.perf_counter()
        for lo in range(0, sequences.shape[0], micro_batch):
            policy_step(policy, sequences[lo:lo + micro_batch].to(device))
        _sync(device)
        seconds.append(time.perf_counter() - t0)
    memory = ({"peak": torch.cuda.max_memory_allocated(device) / 2**20} if device.type == "cuda" else None)
    return {"seconds": seconds, "memory_mb": memory}


RUNS = {"step": run_step, "plain": run_plain}

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", help="the run's SPEC.json, as gpu_trainer.py writes it")
    main(parser.parse_args().spec)
