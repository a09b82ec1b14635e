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
    many layers as the card holds and read at 36 (gpu_rollout_loop.py); its rollout feeds the end-to-end
    prediction;
head_update_graph: the head update over chunks of one fixed shape, captured in a CUDA graph, against the
    eager update within (a)'s bf16 bounds, and its share of the policy's forward + backward at chunks of 1,024
    and 4,096 beside the eager one, with the kernels per cycle (gpu_head_graph.py).
Each module says how its bounds follow from the dtype and the number of trials: gpu_numerics.py (a, b),
gpu_cost.py (c), gpu_sampler.py (d), gpu_trainer.py, gpu_rollout_loop.py, gpu_head_graph.py. The device-neutral
timing they share with the CPU benchmarks is benchmarks/cycle_timing.py. Prints one table and
writes it as JSON, rewritten whole after every check ("complete": false until the last; "cut_off" says where a
SIGTERM or the deadline stopped it), so a run cut off by a time limit still leaves what it did.

    python benchmarks/gpu_check/gpu_check.py [--json PATH] [--only rollout_loop,head_update_graph,...] [--deadline-s S]
    python benchmarks/gpu_check/gpu_check.py --tiny [--device cuda]   # the same at tiny shapes, on a CPU by default

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

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(1, str(ROOT / "benchmarks"))  # bench_common, cycle_timing: what the CPU benchmarks share with it

from gpu_cost import check_cost  # noqa: E402
from gpu_cycle import check_cycle_cost, end_to_end  # noqa: E402
from gpu_head_graph import check_head_update_graph  # noqa: E402
from gpu_numerics import check_alpha, check_reconstruction  # noqa: E402
from gpu_report import Row, all_passed, exit_status, rows_json, table, write_json  # noqa: E402
from gpu_rollout_loop import check_rollout_loop  # noqa: E402
from gpu_sampler import check_sampler  # noqa: E402
from gpu_world import REAL, TINY, build_head, build_policy, flatten_policy_logits_  # noqa: E402
# in the order they run: the loop and the captured head update first (about 90 s together on an H100), then
# cycle_cost (seconds) before trainer_step (minutes), so that a run cut short keeps them; (a) to (c), which have
# passed on this code, last. The end-to-end prediction, which needs cycle_cost and
# trainer_step (and reads rollout_loop where it ran), comes after every check.
CHECKS = ("rollout_loop", "head_update_graph", "cycle_cost", "trainer_step", "a", "b", "d", "c")
# --draft-vocab without N: the issue's 32,768 of Qwen3-4B's 151,936 ids; at tiny shapes about the same share
DRAFT_VOCAB_DEFAULT = {"Qwen3-4B": 32768, "tiny": 512}
DRAFT_VOCAB_GIVEN = -1  # what argparse holds for a --draft-vocab given without N


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
    parser.add_argument("--tau", type=float, help="(c): the records' tau, tokens per cycle (default 3.0; also (a)'s "
                        "records; 2.91 with 64 responses of 8,192 tokens is the paper's step per GPU, ~180K cycles)")
    parser.add_argument("--chunk-cycles", type=int,
                        help="(c): cycles per head-update chunk (default 4096, a GPU's --growmtp_chunk_cycles; tiny 64)")
    parser.add_argument("--only", help=f"comma-separated checks to run, of {','.join(CHECKS)} (b and d need a, "
                        "which then runs too)")
    parser.add_argument("--deadline-s", type=float, help="checks not started this many seconds after the start "
                        "are skipped (recorded as not run)")
    parser.add_argument("--trainer-layers", type=int, help="trainer_step: the policy's layers (default: as many "
                        "as the device's memory holds under ZeRO-3; tiny 2)")
    parser.add_argument("--draft-vocab", type=int, nargs="?", const=DRAFT_VOCAB_GIVEN, metavar="N",
                        help="rollout_loop: also time the head drafting over N ids alone; (c) and "
                        "head_update_graph: also the head update over N ids alone (without N: "
                        f"{DRAFT_VOCAB_DEFAULT['Qwen3-4B']:,}; tiny {DRAFT_VOCAB_DEFAULT['tiny']})")
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
                 "budget_s": args.budget_s, "chunk_cycles": args.chunk_cycles, "trainer_layers": args.trainer_layers,
                 "tau": args.tau}
    for name, value in overrides.items():
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {value}")
    args.plan = dataclasses.replace(plan, **{k: v for k, v in overrides.items() if v is not None})
    if args.draft_vocab == DRAFT_VOCAB_GIVEN:
        args.draft_vocab = DRAFT_VOCAB_DEFAULT[plan.name]
    if args.draft_vocab is not None and not 1 <= args.draft_vocab < plan.config.vocab_size:
        parser.error(f"--draft-vocab must be in 1..{plan.config.vocab_size - 1}, got {args.draft_vocab}")
    if not 1.0 < args.plan.tau <= args.plan.k + 1:
        parser.error(f"--tau must be in (1, {args.plan.k + 1}], got {args.plan.tau}")
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


# in the order they run, with what each needs an earlier one to have left (b: a's draft logits; d: b's log p)
NEEDS = {"b": "draft_logits", "d": "logp"}
# those after which a's and b's tensors go; those before which the 36-layer policy leaves the device
DROPS_TENSORS = ("c", "cycle_cost", "trainer_step", "rollout_loop", "head_update_graph")
DROPS_MODELS = ("cycle_cost", "trainer_step", "rollout_loop")


class Run:
    """One invocation: the JSON payload (rewritten after every check), the table's rows, and what checks hand on
    to each other (the 36-layer policy and its head, (a)'s draft logits, (b)'s log p)."""

    def __init__(self, args, device: torch.device):
        self.args, self.plan, self.device = args, args.plan, device
        self.started = time.perf_counter()
        self.payload = {"complete": False, "cut_off": None, "all_passed": None, "environment": environment(device),
                        "shapes": shapes(self.plan), "checks": args.only, "rows": [], "errors": {}}
        self.rows: list[Row] = []
        self.state = {}

    def log(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.started:6.1f} s] {message}", flush=True)

    def save(self) -> None:
        self.payload.update(rows=rows_json(self.rows), all_passed=all_passed(self.rows),
                            seconds=time.perf_counter() - self.started)
        write_json(self.args.json, self.payload)

    def models(self):
        if "policy" not in self.state:
            self.state["policy"] = build_policy(self.plan.config, self.device, torch.bfloat16)
            self.state["head"] = build_head(self.state["policy"], torch.bfloat16)
            self.log(f"policy ({self.plan.config.num_hidden_layers} layers) and head built")
        return self.state["policy"], self.state["head"]

    def release_models(self) -> None:
        self.state.pop("policy", None), self.state.pop("head", None)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def all_checks(self) -> None:
        """Every check asked for, in CHECKS' order, then the end-to-end prediction where cycle_cost ran."""
        for check in (c for c in CHECKS if c in self.args.only):
            if check in DROPS_TENSORS:
                self.state.pop("draft_logits", None), self.state.pop("logp", None)
            if check in DROPS_MODELS:
                self.release_models()
            needs = NEEDS.get(check)
            if needs is not None and needs not in self.state:
                self.rows.append(Row(check, f"not run: an earlier check left no {needs}", "-", "-", False))
                continue
            self.run(check)
        if self.payload.get("cycle_cost"):
            self.end_to_end()
            self.save()
        self.release_models()
        self.payload["complete"] = self.payload["cut_off"] is None

    def run(self, check: str) -> None:
        """One check, unless past the deadline; its error recorded, not raised (it must not cost the others their
        results); a cut-off recorded and raised on."""
        elapsed = time.perf_counter() - self.started
        if self.args.deadline_s is not None and elapsed > self.args.deadline_s:
            self.rows.append(Row(check, f"not run: {elapsed:.0f} s had passed, past --deadline-s "
                                 f"{self.args.deadline_s:g}", "-", "-", False, skipped=True))
            self.payload["cut_off"] = self.payload["cut_off"] or {"reason": "deadline", "before": check,
                                                                  "seconds": elapsed}
            self.save()
            self.log(f"({check}) skipped: past the deadline")
            return
        self.log(f"({check}) starts")
        try:
            method, section = CHECK_RUNS[check]
            found, self.payload[section] = getattr(self, method)()
            self.rows.extend(found)
        except CutOff as err:
            self.payload["cut_off"] = {"reason": str(err), "during": check,
                                       "seconds": time.perf_counter() - self.started}
            self.rows.append(Row(check, f"cut off by {err} while running", "-", "-", False))
            self.save()
            raise
        except Exception as err:
            self.payload["errors"][check] = traceback.format_exc()
            self.rows.append(Row(check, f"error: {type(err).__name__}: {str(err).splitlines()[0][:80]}", "-", "-",
                                 False))
            self.log(f"({check}) raised {type(err).__name__}; the traceback is in the JSON")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.save()
        self.log(f"({check}) done")

    # ---- the checks: each returns its rows and its section of the JSON ----------------------------------
    def reconstruction(self):
        found, details, self.state["draft_logits"] = check_reconstruction(self.plan, self.models()[1], self.log)
        return found, details

    def alpha(self):
        row, details, self.state["logp"] = check_alpha(self.state["draft_logits"], self.plan.topk)
        return [row], details

    def sampler(self):
        return check_sampler(self.state.pop("logp"), self.state.pop("draft_logits"), self.plan.sampler_chains,
                             self.plan.sampler_trials)

    def cost(self):
        return check_cost(self.plan, *self.models(), self.log, self.args.draft_vocab)

    def trainer(self):
        from gpu_trainer import check_trainer_step, layers_that_fit

        layers = self.plan.trainer_layers
        if layers is None:
            layers = layers_that_fit(self.plan.config, torch.cuda.get_device_properties(self.device).total_memory)
        return check_trainer_step(self.plan, self.plan.trainer_config(layers), self.device, self.log)

    def cycle(self):
        def policy_of(layers: int):
            return build_policy(self.plan.trainer_config(layers), self.device, torch.bfloat16).eval()

        return check_cycle_cost(self.plan, policy_of, lambda p: build_head(p, torch.bfloat16), self.log)

    def loop(self):
        def policy_of(layers: int, dtype: torch.dtype):
            policy = build_policy(self.plan.trainer_config(layers), self.device, dtype)
            policy.gradient_checkpointing_disable()
            return flatten_policy_logits_(policy.eval())

        return check_rollout_loop(self.plan, policy_of, lambda p: build_head(p, torch.bfloat16), self.device,
                                  self.log, self.args.draft_vocab)

    def head_graph(self):
        return check_head_update_graph(self.plan, *self.models(), self.log, self.args.draft_vocab)

    def end_to_end(self) -> None:
        found, self.payload["cycle_cost"]["end_to_end"] = end_to_end(
            self.plan, self.payload["cycle_cost"], self.payload.get("trainer_step"), self.payload.get("rollout_loop"))
        self.rows.extend(found)


# each check: the Run method that runs it, and its section of the JSON
CHECK_RUNS = {"rollout_loop": ("loop", "rollout_loop"), "head_update_graph": ("head_graph", "head_update_graph"),
              "cycle_cost": ("cycle", "cycle_cost"), "trainer_step": ("trainer", "trainer_step"),
              "a": ("reconstruction", "reconstruction"), "b": ("alpha", "alpha"), "d": ("sampler", "rejection_sampler"),
              "c": ("cost", "head_update_cost")}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        what = "the check at Qwen3-4B's shapes needs" if not args.tiny else "--device cuda needs"
        print(f"gpu_check: {what} CUDA, and torch {torch.__version__} sees no CUDA device here. Run "
              "`python benchmarks/gpu_check/gpu_check.py --tiny` for the CPU version (docs/gpu.md).", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    if device.type == "cuda" and "trainer_step" in args.only:
        # cuBLAS reads its workspace setting once, at its first call: before any check runs, for the
        # deterministic algorithms trainer_step runs under
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if device.type == "cpu":
        # tiny shapes' small ops gain nothing from more threads, and on a busy machine their spinning
        # threads stall each other (measured: 1.6 s with one thread, 48 s with two, under load)
        torch.set_num_threads(1)
    run = Run(args, device)
    signal.signal(signal.SIGTERM, _cut_off)
    env = run.payload["environment"]
    run.log(f"GrowMTP GPU check, {args.plan.name} shapes on {env['device']} (torch {env['torch']}, CUDA "
            f"{env['cuda']}, transformers {env['transformers']}); checks {','.join(args.only)}")
    run.save()
    try:
        run.all_checks()
    except CutOff as err:
        if run.payload["cut_off"] is None:  # between two checks
            run.payload["cut_off"] = {"reason": str(err), "during": None, "seconds": time.perf_counter() - run.started}
            run.save()
        print(f"\ngpu_check: cut off ({run.payload['cut_off']}); JSON with what was done: {args.json}", file=sys.stderr)
        return 124
    run.save()
    print()
    print(table(run.rows))
    status = exit_status(run.rows)
    verdict = {0: "every check passed", 1: "SOME CHECK FAILED",
               3: "every check that ran passed; the deadline skipped some (raise GPU_BUDGET_S to run them)"}[status]
    print(f"\n{verdict}; {time.perf_counter() - run.started:.0f} s; JSON: {args.json}")
    return status


def _cut_off(signum, frame):
    raise CutOff(signal.Signals(signum).name)


if __name__ == "__main__":
    sys.exit(main())
