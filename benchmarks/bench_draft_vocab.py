"""A draft step over a smaller vocabulary at Qwen3-4B's shapes on this CPU (`--growmtp_draft_vocab`).

One request, bf16, Qwen3-4B's real widths and vocabulary (151,936; hidden 2,560; 36 layers, random weights: a
step's time does not depend on them), every linear through vLLM's CPU GEMM as the engine runs it
(`shared/cpu_runs.with_engine_gemms`), at --context cached positions, measured side by side in one run:
  decode      the policy's step: 36 layers, the lm_head, a token sampled (`cycle_timing.policy_times`)
  verify      the same over K + 1 positions
  draft       one head step (fc, its layer, its norm) and its logits, sampled as vLLM's draft sampler does
              (softmax of logits / T in fp32, exponential noise, argmax of probs / noise), q kept as a [1, V]
              row for the rejection sampler; its three parts are also timed alone:
              - full:   the lm_head over the whole vocabulary
              - subset: the draft vocabulary's rows only, gathered once, into a [1, V] row of -inf, sampled over
                the vocabulary's ids alone and q written back into a row of zeros, as the engine does
                (`vllm_patches/head_model.py`, `vllm_patches/draft_sampling.py`)
From them, per arm: draft / decode, and the cycle speedup the formula predicts at --tau and K, τ x decode /
(verify + K x draft) (engine overhead left out, as in docs/gpu.md's cycle formula).

    python -m benchmarks.bench_draft_vocab [--layers 36] [--subset 32768] [--k 5] [--tau 2.91] [--out FILE]
    python -m benchmarks.bench_draft_vocab --acceptance docs/data/draft_vocab/runs [--out FILE.json]

--acceptance: what a smaller draft vocabulary costs in τ, from the paper and reasoning worlds' runs kept by
    python -m growmtp_lab.ablations --worlds paper,reasoning --arms growmtp --no-ceiling \
        --keep docs/data/draft_vocab/runs [--draft-vocab-share 0.25 --tag vocab-quarter]
(once plainly and once with the vocabulary, the same seeds); with --out, its table goes beside the JSON (FILE.md).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import Qwen3ForCausalLM

from benchmarks.shared.cpu_runs import machine, provenance, with_engine_gemms
from benchmarks.shared.bench_common import median_seconds, qwen3_4b_config
from benchmarks.shared.cycle_timing import KVBuffer, policy_times
from openrlhf_growmtp.core import MTPHead, make_head_config
from openrlhf_growmtp.core.families import get_family


def draft_step(head: MTPHead, lm_head, vocab_size: int, context: int, repeats: int, subset: torch.Tensor | None,
               seed: int = 0) -> dict[str, float]:
    """Median seconds of one draft step (module docstring) with the head's cache holding `context` positions,
    and of its parts alone: the head's layer (`head_s`), its logits (`logits_s`) and the sampling (`sample_s`)."""
    config, dtype = head.config, lm_head.weight.dtype if lm_head.weight.numel() else torch.bfloat16
    g = torch.Generator().manual_seed(seed)
    cache = KVBuffer.empty(1, config.num_key_value_heads, context + 1, config.head_dim, "cpu", dtype)
    cache.fill_random(context, g)
    state = torch.randn(1, 1, config.hidden_size, dtype=dtype, generator=g)
    token = torch.randint(0, vocab_size, (1, 1), generator=g)
    position = torch.full((1, 1), context)

    def forward():
        cache.reset(context)
        return head(state, token, position, cache=cache).normed[:, -1]  # [1, H]

    def logits_of(normed):
        if subset is None:
            return lm_head(normed)
        logits = normed.new_full((1, vocab_size), float("-inf"))
        return logits.index_copy_(1, subset, lm_head(normed))  # as vllm_patches/head_model.py does

    def vllm_sample(logits):  # vLLM's draft sampler: softmax in fp32, exponential noise, argmax of probs / noise
        probs = torch.softmax(logits.float(), dim=-1)
        return (probs / torch.empty_like(probs).exponential_(generator=g)).argmax(dim=-1), probs

    def sample(logits):  # over the vocabulary's ids alone, q back into a row of zeros (vllm_patches/draft_sampling.py)
        if subset is None:
            return vllm_sample(logits)
        token, probs = vllm_sample(logits.index_select(-1, subset))
        return subset[token], probs.new_zeros(logits.shape).index_copy_(-1, subset, probs)

    with torch.no_grad():
        normed = forward()
        logits = logits_of(normed)
        return {"draft_s": median_seconds(lambda: sample(logits_of(forward())), "cpu", repeats)[0],
                "head_s": median_seconds(forward, "cpu", repeats)[0],
                "logits_s": median_seconds(lambda: logits_of(normed), "cpu", repeats)[0],
                "sample_s": median_seconds(lambda: sample(logits), "cpu", repeats)[0]}


def acceptance(keep: Path, tag: str = "vocab-quarter") -> dict:
    """τ with and without a draft vocabulary, per world and seed, from the runs `make ablations` kept under `keep`
    (its growmtp arm, invoked once plainly and once with `--draft-vocab-share ... --tag <tag>`): the mean τ of
    each run's last 5 steps, and the mean coverage of the vocabulary's runs."""
    from statistics import mean

    from growmtp_lab.report import final_window

    out = {}
    for plain in sorted(d for d in keep.iterdir() if d.is_dir() and not d.name.endswith(f"-{tag}")):
        subset = keep / f"{plain.name}-{tag}"
        for run in sorted(plain.glob("growmtp-s*.json")):
            if not (subset / run.name).exists():
                continue
            paths = {"all": run, "subset": subset / run.name}
            kept = {arm: json.loads(path.read_text()) for arm, path in paths.items()}
            rows = {arm: k["rows"] for arm, k in kept.items()}
            window = {arm: r[-final_window(len(r)):] for arm, r in rows.items()}
            tau = {arm: mean(row["tau"] for row in w) for arm, w in window.items()}
            out.setdefault(plain.name, {})[run.stem.split("-s")[-1]] = {
                "tau_final_all_ids": tau["all"], "tau_final_subset": tau["subset"],
                "tau_change": tau["subset"] / tau["all"] - 1.0,
                "coverage_mean": mean(row["draft_vocab_coverage"] for row in rows["subset"]),
                "flags": kept["subset"]["flags"],
                # where each arm ran: the world's build and the code (a seed's two arms compare on one of each)
                "world_digest": {arm: k.get("world_digest") for arm, k in kept.items()},
                "commit": {arm: k.get("commit") for arm, k in kept.items()}}
    return out


def acceptance_table(result: dict) -> str:
    """`acceptance`'s result as the markdown table docs/measurements.md shows (a `table:` block of it)."""
    lines = ["| world | seed | ids | τ final, every id | τ final, draft vocabulary | change | coverage |",
             "|---|---|---|---|---|---|---|"]
    for world, seeds in result.items():
        for seed, pair in sorted(seeds.items(), key=lambda item: int(item[0])):
            flags = pair["flags"]
            ids = int(flags[flags.index("--growmtp_draft_vocab") + 1])
            lines.append(f"| {world.split('-')[0]} | {seed} | {ids:,} | {pair['tau_final_all_ids']:.3f} | "
                         f"{pair['tau_final_subset']:.3f} | {100 * pair['tau_change']:+.1f}% | "
                         f"{pair['coverage_mean']:.4f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--subset", type=int, default=32768, help="draft vocabulary size")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--tau", type=float, default=2.91)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out")
    parser.add_argument("--acceptance", type=Path, metavar="KEEP",
                        help="instead: τ with and without the vocabulary, from the runs kept under KEEP (above)")
    args = parser.parse_args()
    if args.acceptance:
        result = acceptance(args.acceptance)
        print(json.dumps(result, indent=2))
        if args.out:  # and its table beside it (FILE with .md)
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
            Path(args.out).with_suffix(".md").write_text(acceptance_table(result))
        return

    began = time.perf_counter()
    torch.manual_seed(0)
    config = qwen3_4b_config(args.layers)
    torch.set_default_dtype(torch.bfloat16)
    policy = Qwen3ForCausalLM(config).eval()
    head = MTPHead(make_head_config(config, get_family("qwen3")), policy.model.embed_tokens, policy.lm_head)
    torch.set_default_dtype(torch.float32)
    vocab = config.vocab_size
    subset = torch.randperm(vocab, generator=torch.Generator().manual_seed(1))[: args.subset].sort().values
    rows = torch.nn.Linear(config.hidden_size, args.subset, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        rows.weight.copy_(policy.lm_head.weight[subset])  # gathered once, as the engine keeps them
    for module in (policy, head, rows):
        with_engine_gemms(module, remove_weight=True)
    built_s = time.perf_counter() - began

    times = policy_times(policy, 1, args.context, args.k, args.repeats)
    decode, verify = times["decode_s"], times["verify_s"]
    arms = {"full": draft_step(head, policy.lm_head, vocab, args.context, args.repeats, None),
            "subset": draft_step(head, rows, vocab, args.context, args.repeats, subset)}
    result = {**provenance(["--layers", str(args.layers), "--subset", str(args.subset), "--context", str(args.context),
                            "--k", str(args.k), "--tau", str(args.tau), "--repeats", str(args.repeats)]),
              "shapes": {"layers": args.layers, "hidden": config.hidden_size, "vocab": vocab, "subset": args.subset,
                         "context": args.context, "dtype": "bfloat16", "requests": 1},
              "decode_s": decode, "verify_s": verify, "decode_all_s": times["decode_all_s"],
              "verify_all_s": times["verify_all_s"], "built_s": built_s, "arms": {}}
    print(f"Qwen3-4B shapes ({args.layers} layers, V {vocab}, bf16, 1 request, context {args.context}) on "
          f"{machine()['processor']}: decode {decode * 1e3:.1f} ms, verify of {args.k + 1} {verify * 1e3:.1f} ms")
    for arm, parts in arms.items():
        draft = parts["draft_s"]
        speedup = args.tau * decode / (verify + args.k * draft)
        result["arms"][arm] = {**parts, "draft_over_decode": draft / decode, "predicted_cycle_speedup": speedup}
        print(f"  draft over {'all ' + str(vocab) if arm == 'full' else str(args.subset)} ids: {draft * 1e3:6.2f} ms "
              f"(alone: head {parts['head_s'] * 1e3:.2f}, logits {parts['logits_s'] * 1e3:.2f}, sampling "
              f"{parts['sample_s'] * 1e3:.2f}), draft / decode {draft / decode:.4f}, predicted cycle speedup at tau "
              f"{args.tau}, K {args.k}: {speedup:.2f}x")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
