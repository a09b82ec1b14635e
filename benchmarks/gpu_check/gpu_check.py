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
trainer_step: upstream's DeepSpeed ZeRO-3 bf16 step and ours with the head, each run in a process of its
    own, on cycles recorded by a reference drafter on the device, at one depth or several: the production
    step per token beside the plain forward + backward, and under strict determinism the policy identical
    with and without the head; the head moved; no run started with memory an earlier one held
    (gpu_trainer.py, gpu_trainer_run.py); then, from it and cycle_cost, the RL step's end-to-end speedup.
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
timing they share with the CPU benchmarks is benchmarks/shared/cycle_timing.py. Prints one table and
writes it as JSON, rewritten whole after every check ("complete": false until the last; "cut_off" says where a
SIGTERM or the deadline stopped it), so a run cut off by a time limit still leaves what it did.

    python -m benchmarks.gpu_check.gpu_check [--json PATH] [--only rollout_loop,head_update_graph,...] [--deadline-s S]
    GPU_HOST_COMMIT=<the host's commit> python -m benchmarks.gpu_check.gpu_check ...   # the commit the JSON records
    python -m benchmarks.gpu_check.gpu_check --tiny [--device cuda]   # the same at tiny shapes, on a CPU by default

Exit status: 0 every check passed, 1 a check failed, 2 it cannot run here (no CUDA without --tiny, bad
arguments), 3 every check that ran passed but the deadline skipped some, 124 cut off by a signal.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import faulthandler
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

from benchmarks.gpu_check.gpu_cost import check_cost
from benchmarks.gpu_check.gpu_cycle import check_cycle_cost, end_to_end
from benchmarks.gpu_check.gpu_head_graph import check_head_update_graph
from benchmarks.gpu_check.gpu_numerics import check_alpha, check_reconstruction
from benchmarks.gpu_check.gpu_report import Row, all_passed, exit_status, rows_json, table, write_json
from benchmarks.gpu_check.gpu_rollout_loop import check_rollout_loop
from benchmarks.gpu_check.gpu_sampler import check_sampler
from benchmarks.gpu_check.gpu_world import REAL, TINY, build_head, build_policy, flatten_policy_logits_

ROOT = Path(__file__).resolve().parents[2]
# in the order they run without --only (with it, in its order): the loop and the captured head update first (about
# 90 s together on an H100), then cycle_cost (seconds); the head's math (a), (b), (d) before trainer_step
# (minutes), as the guide's step 2 has it (they must pass before anything trains with the head); (c), a cost,
# last. The end-to-end prediction, which needs cycle_cost and trainer_step (and reads rollout_loop where it ran),
# comes after every check.
CHECKS = ("rollout_loop", "head_update_graph", "cycle_cost", "a", "b", "d", "trainer_step", "c")
# (b) reads (a)'s draft logits, (d) those and (b)'s log p, which every other check drops: the head's math runs as one
# block, in this order, where --only first names one of them
MATH_CHAIN = ("a", "b", "d")
PREREQUISITES = {"b": ("a",), "d": ("a", "b")}
# --draft-vocab without N: the issue's 32,768 of Qwen3-4B's 151,936 ids; at tiny shapes about the same share
DRAFT_VOCAB_DEFAULT = {"Qwen3-4B": 32768, "tiny": 512}
DRAFT_VOCAB_GIVEN = -1  # what argparse holds for a --draft-vocab given without N
TRAINER_RUNS = ("production", "strict")  # gpu_trainer.RUN_MODES, in the order they run at each depth
HOST_COMMIT_ENV = "GPU_HOST_COMMIT"


def run_order(only: list[str]) -> list[str]:
    """The checks `--only` names, in its order (each once; a deadline skips the last ones), except the head's math:
    the (a), (b), (d) named and those they read (`PREREQUISITES`) run together, as `MATH_CHAIN` orders them, where
    the first of them is named."""
    chain = [c for c in MATH_CHAIN if c in only or any(c in PREREQUISITES.get(named, ()) for named in only)]
    order: list[str] = []
    for check in dict.fromkeys(only):
        if check not in MATH_CHAIN:
            order.append(check)
        elif chain[0] not in order:
            order += chain
    return order


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
                        help="(c): cycles per head-update chunk (default 4096, a GPU's --growmtp_chunk_cycles; "
                        "tiny 64)")
    parser.add_argument("--only", help=f"comma-separated checks to run, in the order given, of {','.join(CHECKS)} "
                        "(b needs a, d needs a and b: they then run too, just before)")
    parser.add_argument("--deadline-s", type=float, help="checks not started this many seconds after the start "
                        "are skipped (recorded as not run)")
    parser.add_argument("--trainer-layers", help="trainer_step: the policy's depths, comma-separated, each 1..36 or "
                        "auto (as many layers as the device's memory holds under ZeRO-3); the first one drafts "
                        "(default: auto; tiny 2)")
    parser.add_argument("--trainer-runs", default=",".join(TRAINER_RUNS), help="trainer_step: the runs at each "
                        "depth, of production (the step as the example scripts run it, and the plain forward + "
                        "backward) and strict (under upstream's full determinism: the policy bit-identical)")
    parser.add_argument("--strict-layers", help="trainer_step: the depths (as --trainer-layers) whose strict runs "
                        "run, where --trainer-runs asks for them (default: every depth)")
    parser.add_argument("--fused-adam-s", type=float, default=0.0, help="trainer_step: build DeepSpeed's fused Adam on "
                        "the device, beside the drafter, and use it where built within this many seconds of "
                        "trainer_step's start (default 0: torch's AdamW; gpu_fused_adam.py)")
    parser.add_argument("--launch-blocking-layers", help="trainer_step: depths (as --trainer-layers) whose runs run "
                        "with CUDA_LAUNCH_BLOCKING=1 (a kernel's error at the call that launched it; not timings)")
    parser.add_argument("--draft-vocab", type=int, nargs="?", const=DRAFT_VOCAB_GIVEN, metavar="N",
                        help="rollout_loop: also time the head drafting over N ids alone; (c) and "
                        "head_update_graph: also the head update over N ids alone (without N: "
                        f"{DRAFT_VOCAB_DEFAULT['Qwen3-4B']:,}; tiny {DRAFT_VOCAB_DEFAULT['tiny']})")
    args = parser.parse_args(argv)
    only = [c.strip() for c in (args.only or ",".join(CHECKS)).split(",") if c.strip()]
    unknown = [c for c in only if c not in CHECKS]
    if unknown or not only:
        parser.error(f"--only takes checks among {','.join(CHECKS)}; got {args.only!r}")
    args.only = run_order(only)
    args.trainer_layers = _depths(parser, "--trainer-layers", args.trainer_layers or "auto")
    args.launch_blocking_layers = _depths(parser, "--launch-blocking-layers", args.launch_blocking_layers or "")
    args.strict_layers = None if args.strict_layers is None else _depths(parser, "--strict-layers", args.strict_layers)
    args.trainer_runs = tuple(r.strip() for r in args.trainer_runs.split(",") if r.strip())
    if not args.trainer_runs or set(args.trainer_runs) - set(TRAINER_RUNS):
        parser.error(f"--trainer-runs takes runs among {','.join(TRAINER_RUNS)}; got {','.join(args.trainer_runs)!r}")
    plan = TINY if args.tiny else REAL
    overrides = {"responses": args.responses, "response_tokens": args.response_tokens,
                 "prompt_tokens": args.prompt_tokens, "micro_batch": args.micro_batch, "repeats": args.repeats,
                 "budget_s": args.budget_s, "chunk_cycles": args.chunk_cycles, "tau": args.tau}
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


def _depths(parser, flag: str, text: str) -> list[int | str]:
    """A comma-separated list of depths, each 1..36 or "auto", in the order given."""
    depths = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        if item != "auto" and not (item.isdigit() and 1 <= int(item) <= 36):
            parser.error(f"{flag} must be in 1..36 or auto, got {item}")
        depths.append(item if item == "auto" else int(item))
    return depths


def commits() -> dict:
    """The commit the run is of: the host's, where `$GPU_HOST_COMMIT` gives it (a device's copy of the tree has
    carried stale git metadata: its own HEAD, beside, is then not the tree's), else this copy's HEAD."""
    try:
        copy = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        copy = None
    host = os.environ.get(HOST_COMMIT_ENV, "").strip() or None
    agree = None if host is None or copy is None else copy.startswith(host) or host.startswith(copy)
    return {"git_commit": host or copy, "git_commit_from": HOST_COMMIT_ENV if host else "this copy's git HEAD",
            "git_commit_of_this_copy": copy, "git_commit_disagrees": agree is False}


def environment(device: torch.device) -> dict:
    cuda = device.type == "cuda"
    return {"device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
            "device_type": device.type, "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **commits(), "float32_matmul_precision": torch.get_float32_matmul_precision(),
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
        self.cuda_error = None  # the check whose CUDA error left the device unusable in this process

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
        """Every check asked for, in `--only`'s order, then the end-to-end prediction where cycle_cost ran."""
        for check in self.args.only:
            if self.cuda_error is not None:  # after a device-side assert every CUDA call raises: run nothing more
                self.rows.append(Row(check, f"not run: the CUDA error in ({self.cuda_error}) left the device "
                                     "unusable in this process", "-", "-", False))
                continue
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
        if self.cuda_error is None:
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
            # first the traceback, to the log and the JSON, with no CUDA call before it is saved: after a
            # device-side assert every CUDA call raises anew (an empty_cache here once lost the first one)
            error = traceback.format_exc()
            print(error, file=sys.stderr, flush=True)
            self.payload["errors"][check] = error
            self.rows.append(Row(check, f"error: {type(err).__name__}: {(str(err).splitlines() or [''])[0][:80]}",
                                 "-", "-", False))
            self.save()
            if self.device.type == "cuda" and _is_cuda_error(err):
                self.cuda_error = check
            self.log(f"({check}) raised {type(err).__name__}; the traceback is above and in the JSON")
            return
        self.save()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
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
        from benchmarks.gpu_check.gpu_trainer import check_trainer_step

        def progress(details: dict) -> None:  # a later depth cut off keeps the earlier ones'
            self.payload["trainer_step"] = details
            self.save()

        out_dir = self.args.json.with_name(f"{self.args.json.stem}_trainer_runs")
        deadline_at = None if self.args.deadline_s is None else self.started + self.args.deadline_s
        depths = self.depths(self.args.trainer_layers)
        strict_at = depths if self.args.strict_layers is None else self.depths(self.args.strict_layers)
        return check_trainer_step(self.plan, depths, self.device, self.log, out_dir, self.args.trainer_runs,
                                  tuple(self.depths(self.args.launch_blocking_layers)), tuple(strict_at), deadline_at,
                                  progress, self.args.fused_adam_s)

    def depths(self, asked: list) -> list[int]:
        """--trainer-layers' depths, "auto" as many as the device holds (`layers_that_fit`; the plan's on a CPU),
        each once, in the order given."""
        from benchmarks.gpu_check.gpu_trainer import layers_that_fit

        def resolve(layers):
            if layers != "auto":
                return layers
            if self.plan.trainer_layers is not None or self.device.type != "cuda":
                return self.plan.trainer_layers or 2
            return layers_that_fit(self.plan.config, torch.cuda.get_device_properties(self.device).total_memory)

        return list(dict.fromkeys(resolve(layers) for layers in asked))

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
              "`python -m benchmarks.gpu_check.gpu_check --tiny` for the CPU version (docs/gpu.md).", file=sys.stderr)
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
    faulthandler.enable()  # a death in C leaves every thread's Python stack in the log
    run = Run(args, device)
    signal.signal(signal.SIGTERM, _cut_off)
    env = run.payload["environment"]
    run.log(f"GrowMTP GPU check, {args.plan.name} shapes on {env['device']} (torch {env['torch']}, CUDA "
            f"{env['cuda']}, transformers {env['transformers']}); checks {','.join(args.only)}; commit "
            f"{env['git_commit']} ({env['git_commit_from']})")
    if env["git_commit_disagrees"]:
        run.log(f"WARNING: ${HOST_COMMIT_ENV} is {env['git_commit']}, this copy's git HEAD "
                f"{env['git_commit_of_this_copy']}: the JSON records the host's")
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


def _is_cuda_error(err: BaseException) -> bool:
    """A CUDA error (a device-side assert among them) after which this process's CUDA context is lost."""
    return type(err).__name__ == "AcceleratorError" or "CUDA error" in str(err)


if __name__ == "__main__":
    sys.exit(main())
