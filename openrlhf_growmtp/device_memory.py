"""Memory of one process's device, as the per-step `growmtp/mem_*` metrics report it (GiB).

On CUDA: `peak` is what torch allocated at most in this process since it started (vLLM's KV cache and
weights, or the policy's ZeRO shards and activations; never reset here, so a caller's own peak readings stay
theirs), `used` the whole device's memory in use now, every process on it counted (a colocated reference
model, vLLM's reserved pool). Without CUDA the same two figures are the process's resident host memory: its
peak over the process's life and now (the CPU run's "device").
"""

from __future__ import annotations

import resource

import torch

GIB = 2**30


def reading() -> dict[str, float]:
    """{"peak_gib", "used_gib", "total_gib"} of this process's device (total 0 where unknown, on CPU)."""
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        return {"peak_gib": torch.cuda.max_memory_allocated() / GIB, "used_gib": (total - free) / GIB,
                "total_gib": total / GIB}
    return {"peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB,  # KiB on Linux
            "used_gib": _resident_bytes() / GIB, "total_gib": 0.0}


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()
