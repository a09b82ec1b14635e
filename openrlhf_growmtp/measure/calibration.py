"""The machine a figure was measured on, by what moves a speed figure: a short calibration kept beside it.

Two machines that report the same CPU name and core count can decode at twice each other's speed, and a
speculative speedup moves with that (docs/measurements.md, "The machine in every figure"). `calibrate()`
times, with this process's torch threads:

- `decode_step_ms`: one decode step of a fixed tiny workload, the speed world's target shape (10 layers of
  hidden 512, its attention projections and MLP, the 32-word lm_head: 31.5M parameters, fp32, fixed seeded
  weights) for 2 sequences, torch's matmuls alone: a step reads every weight once, as the world's decode does,
  so it is bound by memory traffic and per-operator work, as the world's decode is;
- `bandwidth_gb_s`: read bandwidth, a `sum` over 256 MiB of fp32 (far beyond any cache);
- `gemm_gflops`: fp32 GEMM rate, 1024 x 1024 x 1024;
- `bf16_gemm_gflops`: bf16 GEMM rate, 256 x 256 x 256: the dtype the policy trains in (DeepSpeed's default), which
  a CPU without native bf16 arithmetic runs tens of times slower than fp32;
- `cpu_capability`: the instruction set torch dispatches to (`torch.backends.cpu.get_cpu_capability()`: AVX2,
  AVX512, ...).

Each is the median of its repeats after a warm-up (what a run meets, not the machine's best); about 2 s in
all. The same numbers on two machines say little; different ones say why a figure moved.
"""

from __future__ import annotations

import statistics
import time

LAYERS, HIDDEN, KV, MLP, VOCAB = 10, 512, 256, 1536, 32  # the speed world's target (growmtp_lab/worlds)
SEQUENCES = 2  # the demo's concurrency
REPEATS = 15


def _median_s(work, repeats: int) -> float:
    work()  # warm-up
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        work()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def _decode_weights():
    import torch

    generator = torch.Generator().manual_seed(0)
    shapes = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN),  # q, k, v, o
              (MLP, HIDDEN), (MLP, HIDDEN), (HIDDEN, MLP)]  # gate, up, down
    layers = [[torch.randn(shape, generator=generator) * 0.02 for shape in shapes] for _ in range(LAYERS)]
    return layers, torch.randn(VOCAB, HIDDEN, generator=generator) * 0.02


def calibrate(repeats: int = REPEATS) -> dict:
    """{"decode_step_ms", "bandwidth_gb_s", "gemm_gflops", "torch_threads", "repeats"} (module docstring)."""
    import torch
    from torch.nn.functional import linear, silu

    layers, lm_head = _decode_weights()
    x0 = torch.randn(SEQUENCES, HIDDEN, generator=torch.Generator().manual_seed(1))

    @torch.no_grad()
    def decode_step():
        x = x0
        for q, k, v, o, gate, up, down in layers:
            linear(x, k), linear(x, v)
            x = x + linear(linear(x, q), o)
            x = x + linear(silu(linear(x, gate)) * linear(x, up), down)
        return linear(x, lm_head)

    big = torch.ones(64 * 1024 * 1024, dtype=torch.float32)  # 256 MiB
    bandwidth = big.numel() * 4 / _median_s(big.sum, repeats) / 1e9
    del big
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    gemm = 2 * 1024 ** 3 / _median_s(lambda: torch.mm(a, b), repeats) / 1e9
    a16, b16 = torch.randn(256, 256).bfloat16(), torch.randn(256, 256).bfloat16()
    bf16 = 2 * 256 ** 3 / _median_s(lambda: torch.mm(a16, b16), 5) / 1e9
    return {"decode_step_ms": 1e3 * _median_s(decode_step, repeats), "bandwidth_gb_s": bandwidth,
            "gemm_gflops": gemm, "bf16_gemm_gflops": bf16, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch_threads": torch.get_num_threads(), "repeats": repeats}


if __name__ == "__main__":
    import json

    print(json.dumps(calibrate(), indent=1))
