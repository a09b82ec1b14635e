"""Peak memory of one piece of work, on CPU as on CUDA: what `bench_reconstruction`, `bench_head_update` and
`bench_memory` report. On CPU, the bytes malloc has handed out (mallinfo2), sampled from another thread, and the
peak resident memory; on CUDA, torch's peak allocation."""

from __future__ import annotations

import ctypes
import gc
import os
import threading
import time

import torch

from benchmarks.shared.bench_common import sync


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


_LIBC = ctypes.CDLL("libc.so.6")
_LIBC.mallinfo2.restype = _MallInfo2


def _allocated() -> int:
    """Bytes malloc has handed out and not taken back (heap in use + mmapped blocks): torch's CPU tensors
    live there, so this is the CPU analogue of CUDA's memory_allocated, without the freed memory that
    glibc keeps mapped (which resident memory counts)."""
    info = _LIBC.mallinfo2()
    return info.uordblks + info.hblkhd


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakMemory:
    """Peak allocated bytes (`_allocated`) and peak resident memory above their levels at entry, sampled
    every millisecond from another thread (torch releases the GIL inside its kernels). Memory that glibc
    retained from earlier frees is handed back first (malloc_trim), so that it cannot hide the work."""

    def __enter__(self):
        gc.collect()
        _LIBC.malloc_trim(0)
        self.base = self.peak = (_allocated(), _rss())
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self._update()
            time.sleep(0.001)

    def _update(self):
        self.peak = (max(self.peak[0], _allocated()), max(self.peak[1], _rss()))

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self._update()

    @property
    def mb(self) -> float:
        """Peak allocated MB above entry (what the benchmarks report on CPU)."""
        return (self.peak[0] - self.base[0]) / 2**20

    @property
    def rss_mb(self) -> float:
        return (self.peak[1] - self.base[1]) / 2**20


def measure_peak(fn, device: str):
    """(fn's value, peak MB above entry, peak resident MB or None on CUDA) of one more run of fn. Timed runs
    stay apart: the sampling thread slowed the toy head update by ~55% (mallinfo2 takes malloc's locks)."""
    sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        value = fn()
        sync(device)
        return value, (torch.cuda.max_memory_allocated() - base) / 2**20, None
    with PeakMemory() as memory:
        value = fn()
    return value, memory.mb, memory.rss_mb
