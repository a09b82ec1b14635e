"""The capture hook's top-k selection (`capture.core.top_k_rows`) next to torch.topk, per step of rows.

Each configuration times both on the same fresh rows (never the same rows twice: a CPU's branch predictor
learns a repeated row, which makes torch's nth_element look faster than it is; by how much:
docs/measurements.md). Rows are fp32
log-probs, as the hook's are. Where k * 64 > V, torch selects with std::nth_element per row
(ATen's TopKImpl.h) and top_k_rows hands the rows to numpy's vectorised argpartition; elsewhere both are
torch.topk, and the ratio only shows the noise.

    python -m benchmarks.bench_topk [--json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from vllm_patches.capture.core import top_k_rows

# (rows, V, k): the toy's step (32 requests x K=3, V=128, top-64), a 32k vocabulary with a wide top-k,
# Qwen3's vocabulary at the default top-64 (torch's partial sort) and at a top-k past V / 64
CONFIGURATIONS = [(96, 128, 64), (96, 1024, 64), (96, 32000, 1024), (96, 151936, 64), (96, 151936, 4096)]


def median_us(fn, batches: list[torch.Tensor]) -> float:
    times = []
    for rows in batches:
        began = time.perf_counter_ns()
        fn(rows)
        times.append(time.perf_counter_ns() - began)
    return sorted(times)[len(times) // 2] / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="end with one JSON line of the results")
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    results = []
    print(f"{'rows':>5}{'V':>8}{'k':>6}  {'selection':<14}{'torch.topk us':>14}{'top_k_rows us':>15}{'ratio':>7}")
    for rows, vocab, k in CONFIGURATIONS:
        count = max(5, min(100, 2_000_000 // (rows * vocab)))  # fresh batches, as many as memory allows
        batches = [torch.log_softmax(torch.randn(rows, vocab, generator=g), dim=-1) for _ in range(count)]
        top_k_rows(batches[0], k)  # warm-up (numpy's first call)
        ours = median_us(lambda x: top_k_rows(x, k), batches)
        theirs = median_us(lambda x: x.topk(k, dim=-1, sorted=False), batches)
        selection = "numpy" if k * 64 > vocab else "torch.topk"
        results.append({"rows": rows, "vocab": vocab, "k": k, "selection": selection, "torch_topk_us": theirs,
                        "top_k_rows_us": ours, "ratio": ours / theirs})
        print(f"{rows:>5}{vocab:>8}{k:>6}  {selection:<14}{theirs:>14.1f}{ours:>15.1f}{ours / theirs:>7.2f}")
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
