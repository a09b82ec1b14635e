"""Where the head update's time goes on a GPU, and how far each path of check (a) is from fp64 in fp32:
the follow-up to `make gpu-check` (docs/gpu.md).

1. The head update of check (c) (DCA + VGM, K=5, τ≈3, top-64, Qwen3-4B's head and vocabulary, hidden states
   N(0, 1) in bf16), timed in bf16 and in fp32 and at several chunk sizes, medians of `--repeats`; then one
   bf16 update under torch.profiler: the kernels by their own device time, the CPU operators by their own
   CPU time, and the device's busy time against the wall time (a gap is time the GPU waits on the host).
2. Check (a)'s records in fp32: per chunking, ||batched - chain||, ||batched - fp64|| and ||chain - fp64||
   per gradient tensor (check (a) bounds the first by 4 x the third; the second says which path rounds more).

    python -m benchmarks.gpu_check.gpu_profile [--responses 8] [--chunks 256,1024,4096] [--json PATH]
    python -m benchmarks.gpu_check.gpu_profile --responses 16 --chunks 1024,2048,4096,8192,16384   # the chunk sweep

Prints its tables; writes a JSON with the timings and the fp32 distances. CUDA only (exit status 2 without).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from benchmarks.gpu_check.gpu_cost import Meter
from benchmarks.gpu_check.gpu_cost import make_records as cost_records
from benchmarks.gpu_check.gpu_numerics import batched_run, chain_run
from benchmarks.gpu_check.gpu_numerics import make_records as numerics_records
from benchmarks.gpu_check.gpu_world import REAL, build_head, build_policy, head_copy
from benchmarks.shared.bench_common import head_update, qwen3_4b_config


def timed_update(head, records, hiddens, chunk: int, repeats: int) -> tuple[float, float | None]:
    """(median seconds of `repeats` head updates after one warm-up, their peak MB: `gpu_cost.Meter`'s)."""
    device = next(head.parameters()).device
    times, peaks = [], []
    for _ in range(repeats + 1):
        head.zero_grad(set_to_none=False)
        with Meter(device) as meter:
            head_update(head, records, hiddens, chunk)
        times.append(meter.seconds)
        peaks.append(meter.peak_mb)
    return statistics.median(times[1:]), (max(peaks) if peaks[0] is not None else None)


def profile_update(head, records, hiddens, chunk: int, rows: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    head.zero_grad(set_to_none=False)
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities) as prof, Meter(torch.device("cuda")) as meter:
        head_update(head, records, hiddens, chunk)
    wall = meter.seconds
    events = prof.key_averages()
    kernels = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),  # kernels, memcpys
                     key=lambda e: -e.self_device_time_total)
    busy = sum(e.self_device_time_total for e in kernels) / 1e6
    print(f"\nprofiled bf16 update, chunks of {chunk}: wall {wall:.2f} s (under the profiler), "
          f"device busy {busy:.2f} s ({busy / wall:.0%})")
    print(events.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=70))
    print(events.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=70))
    return {"wall_s": wall, "device_busy_s": busy,
            "top_kernels": [{"name": e.key, "self_device_s": e.self_device_time_total / 1e6, "calls": e.count}
                            for e in kernels[:rows]]}


def fp32_distances(head_bf16) -> dict:
    plan = REAL
    records = numerics_records(plan)
    hidden_bf16 = [r.hidden.to(device="cuda", dtype=torch.bfloat16) for r in records]
    h64, h32 = head_copy(head_bf16, torch.float64), head_copy(head_bf16, torch.float32)
    ref = chain_run(h64, records, [x.double() for x in hidden_bf16])
    chain = chain_run(h32, records, [x.float() for x in hidden_bf16])
    batched = batched_run(h32, records, [x.float() for x in hidden_bf16], (plan.recon_chunk, plan.chunk_cycles))
    out = {"log_q": {"chain_vs_fp64": (chain["logq"] - ref["logq"]).abs().max().item(),
                     "batched_vs_fp64": (batched["logq"] - ref["logq"]).abs().max().item(),
                     "batched_vs_chain": (batched["logq"] - chain["logq"]).abs().max().item()},
           "gradients": {}}
    print("\nfp32, check (a)'s records: L2 distances per gradient tensor, as multiples of ||chain - fp64||")
    print(f"{'tensor':42s} {'chunk':>6s} {'b-chain':>8s} {'b-fp64':>8s}")
    for chunk, grads in batched["grads"].items():
        for name, want in ref["grads"].items():
            eps = (chain["grads"][name] - want).norm().item()
            d_chain, d_ref = (grads[name] - chain["grads"][name]).norm().item(), (grads[name] - want).norm().item()
            out["gradients"].setdefault(str(chunk), {})[name] = {"batched_vs_chain": d_chain, "batched_vs_fp64": d_ref,
                                                                 "chain_vs_fp64": eps}
            print(f"{name:42s} {chunk:6d} {d_chain / eps:8.2f} {d_ref / eps:8.2f}")
    print(f"log q max|d|: chain-fp64 {out['log_q']['chain_vs_fp64']:.2e}, batched-fp64 "
          f"{out['log_q']['batched_vs_fp64']:.2e}, batched-chain {out['log_q']['batched_vs_chain']:.2e}")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--responses", type=int, default=8)
    parser.add_argument("--chunks", default="256,1024,4096")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_profile: needs CUDA", file=sys.stderr)
        return 2
    plan, chunks = REAL, [int(c) for c in args.chunks.split(",")]
    policy = build_policy(qwen3_4b_config(1), torch.device("cuda"), torch.bfloat16)  # its embedding and lm_head
    head = build_head(policy, torch.bfloat16)
    records = cost_records(plan, args.responses)
    g = torch.Generator(device="cuda").manual_seed(0)
    hiddens = [torch.randn(r.token_ids.numel(), plan.config.hidden_size, device="cuda", generator=g,
                           dtype=torch.bfloat16) for r in records]
    cycles = sum(r.num_cycles for r in records)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "responses": args.responses,
              "cycles": cycles, "seconds": {}, "peak_mb": {}}
    print(f"{args.responses} responses, {cycles} cycles, K={plan.k}, V={plan.config.vocab_size}")
    for dtype, h in ((torch.bfloat16, head), (torch.float32, head_copy(head, torch.float32))):
        hs = [x.to(dtype) for x in hiddens]
        for chunk in chunks:
            seconds, peak_mb = timed_update(h, records, hs, chunk, args.repeats)
            name = str(dtype).replace("torch.", "")
            result["seconds"][f"{name}/{chunk}"], result["peak_mb"][f"{name}/{chunk}"] = seconds, peak_mb
            print(f"  {name:9s} chunks of {chunk:5d}: {seconds:6.2f} s ({cycles / seconds:,.0f} cycles/s), "
                  f"peak {peak_mb:,.0f} MB")
        del hs
    result["profile"] = profile_update(head, records, hiddens, plan.chunk_cycles, args.rows)
    result["fp32_distances"] = fp32_distances(head)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
