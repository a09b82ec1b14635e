"""The GrowMTP GPU check: the head's math and the head update on CUDA, in bf16, at Qwen3-4B's real shapes
(hidden 2560, 36 layers, 32 query / 8 key-value heads of 128, MLP 9728, tied vocabulary of 151,936, RoPE
base 1e6), K=5, top-64, with weights drawn at random from the config (nothing is downloaded).

(a) batched draft-path reconstruction against chain-by-chain drafting: log q, gradients, loss (bf16, fp32);
(b) alpha on the top-64 against the dense alpha;
(c) one RL step's head update against one policy forward + backward over the same responses: time and
    peak memory, side by side in one run;
(d) a rejection sampler's acceptance against E_{x~q}[min(1, p/q)] = sum min(p, q), and its output ~ p;
cycle_cost: a decoding step, a verify of K + 1 positions and a draft step with a KV cache at 1K, 4K and 8K
    tokens for 64 sequences; the break-even tau and the rollout speedup they predict (gpu_cycle.py);
trainer_step: upstream's DeepSpeed ZeRO-3 bf16 step and ours with the head, in one process, on cycles
    recorded by a reference drafter on the device: the policy identical with and without the head, the head
    moved, the head's share of the step (gpu_trainer.py); then, from both, the RL step's end-to-end speedup.
rollout_loop: a minimal generation loop in vLLM's place (static KV caches, every phase captured in a CUDA
    graph, drafts sampled from the head's q, rejection sampling): AR and speculative tokens/s side by side at
    1K, 4K and 8K tokens for 64 sequences, at tau 1.5, 2.0, 2.5 and 2.91 (set by the head's logit scale), at as
    many layers as the card holds and read at 36 (gpu_loop.py); its rollout feeds the end-to-end prediction;
head_update_graph: the head update over chunks of one fixed shape, captured in a CUDA graph, against the
    eager update within (a)'s bf16 bounds, and its share of the policy's forward + backward at chunks of 1,024
    and 4,096 beside the eager one, with the kernels per cycle (gpu_head_graph.py).
Each module says how its bounds follow from the dtype and the number of trials: gpu_numerics.py (a, b),
gpu_cost.py (c), gpu_sampler.py (d), gpu_trainer.py, gpu_loop.py, gpu_head_graph.py. Prints one table and
writes it as JSON, rewritten whole after every check ("complete": false until the last; "cut_off" says where a
SIGTERM or the deadline stopped it), so a run cut off by a time limit still leaves what it did.

    python benchmarks/gpu_check.py [--json PATH] [--only rollout_loop,head_update_graph,cycle_cost,...] [--deadline-s S]
    python benchmarks/gpu_check.py --tiny [--device cuda]   # the same at tiny shapes, on a CPU by default

Exit status: 0 every check passed, 1 a check failed, 2 it cannot run here (no CUDA without --tiny, bad
arguments), 3 every check that ran passed but the deadline skipped some, 124 cut off by a signal.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import transformers
from gpu_cost import check_cost
from gpu_cycle import check_cycle_cost, end_to_end
from gpu_head_graph import check_head_update_graph
from gpu_loop import check_rollout_loop
from gpu_numerics import check_alpha, check_reconstruction
from gpu_report import Row, all_passed, exit_status, rows_json, table, write_json
from gpu_sampler import check_sampler
from gpu_world import REAL, TINY, build_head, build_policy, flatten_policy_logits_

ROOT = Path(__file__).resolve().parent.parent
# in the order they run: the loop and the captured head update first (about 90 s together on an H100), then
# cycle_cost (seconds) before trainer_step (minutes), so that a run cut short keeps them; (a) to (c), which have
# passed on this code, last. The end-to-end prediction, which needs cycle_cost and
# trainer_step (and reads rollout_loop where it ran), comes after every check.
CHECKS = ("rollout_loop", "head_update_graph", "cycle_cost", "trainer_step", "a", "b", "d", "c")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (Qwen3-4B's layout), CPU unless --device")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda, or cpu with --tiny")
    parser.add_argument("--json", type=Path, help="where the JSON goes (default runs/gpu_check[_tiny].json)")
    parser.add_argument("--responses", type=int, help="(c): responses to time (default 64; tiny 4)")
    parser.add_argument("--response-tokens", type=int, help="(c): tokens per response (default 4096; tiny 96)")
    parser.add_argument("--prompt-tokens", type=int, help="(c): tokens per prompt (default 256; tiny 16)")
    parser.add_argument("--micro-batch", type=int, help="(c): responses per policy forward (default 2)")
    parser.add_argument("--repeats", type=int, help="(c): timed runs of each side (default 3; tiny 2)")
    parser.add_argument("--budget-s", type=float, help="(c): seconds its timed runs may take (default 150)")
    parser.add_argument("--chunk-cycles", type=int,
                        help="(c): cycles per head-update chunk (default 4096, a GPU's --growmtp_chunk_cycles; tiny 64)")
    parser.add_argument("--only", help=f"comma-separated checks to run, of {','.join(CHECKS)} (b and d need a, "
                        "which then runs too)")
    parser.add_argument("--deadline-s", type=float, help="checks not started this many seconds after the start "
                        "are skipped (recorded as not run)")
    parser.add_argument("--trainer-layers", type=int, help="trainer_step: the policy's layers (default: as many "
                        "as the device's memory holds under ZeRO-3; tiny 2)")
    args = parser.parse_args(argv)
    only = [c.strip() for c in (args.only or ",".join(CHECKS)).split(",") if c.strip()]
    unknown = [c for c in only if c not in CHECKS]
    if unknown or not only:
        parser.error(f"--only takes checks among {','.join(CHECKS)}; got {args.only!r}")
    if {"b", "d"} & set(only):
        only.append("a")
    args.only = [c for c in CHECKS if c in only]
    if args.trainer_layers is not None and not 1 <= args.trainer_layers <= 36:
        parser.error(f"--trainer-layers must be in 1..36, got {args.trainer_layers}")
    plan = TINY if args.tiny else REAL
    overrides = {"responses": args.responses, "response_tokens": args.response_tokens,
                 "prompt_tokens": args.prompt_tokens, "micro_batch": args.micro_batch, "repeats": args.repeats,
                 "budget_s": args.budget_s, "chunk_cycles": args.chunk_cycles, "trainer_layers": args.trainer_layers}
    for name, value in overrides.items():
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {value}")
    args.plan = dataclasses.replace(plan, **{k: v for k, v in overrides.items() if v is not None})
    if args.plan.micro_batch > args.plan.responses:
        parser.error(f"--micro-batch {args.plan.micro_batch} is more than --responses {args.plan.responses}")
    if args.plan.response_tokens < 2 * args.plan.k:
        parser.error(f"--response-tokens must be at least {2 * args.plan.k}, got {args.plan.response_tokens}")
    args.device = args.device or ("cpu" if args.tiny else "cuda")
    args.json = args.json or ROOT / "runs" / ("gpu_check_tiny.json" if args.tiny else "gpu_check.json")
    return args


def environment(device: torch.device) -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    cuda = device.type == "cuda"
    return {"device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
            "device_type": device.type, "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": commit, "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
            "bf16_reduced_precision_reduction": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
            "cpu_threads": torch.get_num_threads()}


def shapes(plan) -> dict:
    c = plan.config
    return {"plan": plan.name, "hidden_size": c.hidden_size, "num_hidden_layers": c.num_hidden_layers,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim, "intermediate_size": c.intermediate_size, "vocab_size": c.vocab_size,
            "rope_theta": c.rope_parameters["rope_theta"], "tie_word_embeddings": c.tie_word_embeddings,
            "k": plan.k, "topk": plan.topk, "dtype": "bfloat16"}


class CutOff(BaseException):
    """The run was told to stop (SIGTERM, as a time limit sends it). Not an Exception: no `except Exception`
    on the way up (a check's, a library's) may swallow it."""


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        what = "the check at Qwen3-4B's shapes needs" if not args.tiny else "--device cuda needs"
        print(f"gpu_check: {what} CUDA, and torch {torch.__version__} sees no CUDA device here. "
              "Run `python benchmarks/gpu_check.py --tiny` for the CPU version (docs/gpu.md).", file=sys.stderr)
        return 2
    plan, device = args.plan, torch.device(args.device)
    if device.type == "cuda" and "trainer_step" in args.only:
        # cuBLAS reads its workspace setting once, at its first call: before any check runs, for the
        # deterministic algorithms trainer_step runs under
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if device.type == "cpu":
        # tiny shapes' small ops gain nothing from more threads, and on a busy machine their spinning
        # threads stall each other (measured: 1.6 s with one thread, 48 s with two, under load)
        torch.set_num_threads(1)
    started = time.perf_counter()
    payload = {"complete": False, "cut_off": None, "all_passed": None, "environment": environment(device),
               "shapes": shapes(plan), "checks": args.only, "rows": [], "errors": {}}
    rows: list[Row] = []

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f} s] {message}", flush=True)

    def save() -> None:
        payload.update(rows=rows_json(rows), all_passed=all_passed(rows), seconds=time.perf_counter() - started)
        write_json(args.json, payload)

    def on_term(signum, frame):
        raise CutOff(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_term)
    env = payload["environment"]
    log(f"GrowMTP GPU check, {plan.name} shapes on {env['device']} (torch {env['torch']}, CUDA {env['cuda']}, "
        f"transformers {env['transformers']}); checks {','.join(args.only)}")
    save()
    state = {}

    def models():
        if "policy" not in state:
            state["policy"] = build_policy(plan.config, device, torch.bfloat16)
            state["head"] = build_head(state["policy"], torch.bfloat16)
            log(f"policy ({plan.config.num_hidden_layers} layers) and head built")
        return state["policy"], state["head"]

    def release_models():
        state.pop("policy", None), state.pop("head", None)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def run(check: str, fn) -> None:
        elapsed = time.perf_counter() - started
        if args.deadline_s is not None and elapsed > args.deadline_s:
            rows.append(Row(check, f"not run: {elapsed:.0f} s had passed, past --deadline-s {args.deadline_s:g}",
                            "-", "-", False, skipped=True))
            payload["cut_off"] = payload["cut_off"] or {"reason": "deadline", "before": check, "seconds": elapsed}
            save()
            log(f"({check}) skipped: past the deadline")
            return
        log(f"({check}) starts")
        try:
            fn()
        except CutOff as err:
            payload["cut_off"] = {"reason": str(err), "during": check, "seconds": time.perf_counter() - started}
            rows.append(Row(check, f"cut off by {err} while running", "-", "-", False))
            save()
            raise
        except Exception as err:  # one check's failure must not cost the others their results
            payload["errors"][check] = traceback.format_exc()
            rows.append(Row(check, f"error: {type(err).__name__}: {str(err).splitlines()[0][:80]}", "-", "-", False))
            log(f"({check}) raised {type(err).__name__}; the traceback is in the JSON")
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save()
        log(f"({check}) done")

    def reconstruction():
        found, payload["reconstruction"], state["draft_logits"] = check_reconstruction(plan, models()[1], log)
        rows.extend(found)

    def alpha():
        row, payload["alpha"], state["logp"] = check_alpha(state["draft_logits"], plan.topk)
        rows.append(row)

    def sampler():
        found, payload["rejection_sampler"] = check_sampler(state.pop("logp"), state.pop("draft_logits"),
                                                            plan.sampler_chains, plan.sampler_trials)
        rows.extend(found)

    def cost():
        found, payload["head_update_cost"] = check_cost(plan, *models(), log)
        rows.extend(found)

    def trainer():
        from gpu_trainer import check_trainer_step, layers_that_fit

        layers = plan.trainer_layers
        if layers is None:
            layers = layers_that_fit(plan.config, torch.cuda.get_device_properties(device).total_memory)
        found, payload["trainer_step"] = check_trainer_step(plan, plan.trainer_config(layers), device, log)
        rows.extend(found)

    def cycle():
        def policy_of(layers: int):
            return build_policy(plan.trainer_config(layers), device, torch.bfloat16).eval()

        found, payload["cycle_cost"] = check_cycle_cost(plan, policy_of, lambda p: build_head(p, torch.bfloat16),
                                                        log)
        rows.extend(found)

    def loop():
        def policy_of(layers: int, dtype: torch.dtype):
            policy = build_policy(plan.trainer_config(layers), device, dtype)
            policy.gradient_checkpointing_disable()
            return flatten_policy_logits_(policy.eval())

        found, payload["rollout_loop"] = check_rollout_loop(plan, policy_of, lambda p: build_head(p, torch.bfloat16),
                                                            device, log)
        rows.extend(found)

    def head_graph():
        found, payload["head_update_graph"] = check_head_update_graph(plan, *models(), log)
        rows.extend(found)

    def step_speedup():
        found, payload["cycle_cost"]["end_to_end"] = end_to_end(plan, payload["cycle_cost"],
                                                                payload.get("trainer_step"),
                                                                payload.get("rollout_loop"))
        rows.extend(found)

    try:
        fns = {"rollout_loop": (loop, None), "head_update_graph": (head_graph, None), "a": (reconstruction, None),
               "b": (alpha, "draft_logits"), "d": (sampler, "logp"), "c": (cost, None), "cycle_cost": (cycle, None),
               "trainer_step": (trainer, None)}
        for check in CHECKS:
            fn, needs = fns[check]
            if check not in args.only:
                continue
            if check in ("c", "cycle_cost", "trainer_step", "rollout_loop", "head_update_graph"):
                state.pop("draft_logits", None), state.pop("logp", None)
            if check in ("cycle_cost", "trainer_step", "rollout_loop"):  # the 36-layer policy leaves the device
                release_models()
            if needs is not None and needs not in state:
                rows.append(Row(check, f"not run: an earlier check left no {needs}", "-", "-", False))
                continue
            run(check, fn)
        if payload.get("cycle_cost"):
            step_speedup()
            save()
        release_models()
        payload["complete"] = payload["cut_off"] is None
    except CutOff as err:
        if payload["cut_off"] is None:  # between two checks
            payload["cut_off"] = {"reason": str(err), "during": None, "seconds": time.perf_counter() - started}
            save()
        print(f"\ngpu_check: cut off ({payload['cut_off']}); JSON with what was done: {args.json}", file=sys.stderr)
        return 124
    save()
    print()
    print(table(rows))
    status = exit_status(rows)
    verdict = {0: "every check passed", 1: "SOME CHECK FAILED",
               3: "every check that ran passed; the deadline skipped some (raise GPU_BUDGET_S to run them)"}[status]
    print(f"\n{verdict}; {time.perf_counter() - started:.0f} s; JSON: {args.json}")
    return status


if __name__ == "__main__":
    sys.exit(main())
