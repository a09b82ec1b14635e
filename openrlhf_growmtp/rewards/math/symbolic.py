"""Rule "symbolic": equivalence decided by HF's math-verify (PyPI `math-verify`) under a wall-clock deadline;
whatever the dapo rule accepts is accepted first, without asking math-verify.

Why processes: OpenRLHF calls `reward_func` from a worker thread, where math-verify's SIGALRM timeouts
raise ValueError; with them off (`parsing_timeout=None`, `timeout_seconds=None`) nothing bounds a call, and
some short answers run for minutes (measured: `9!!!` and `2^{2^{2^{100}}}` against `1`, over 30 s). So
math-verify runs in `symbolic_worker` processes; a comparison gets TIME_LIMIT_S, and a worker that misses
it is killed (not equal) and replaced. A spare worker is always starting, so after a kill the next call
need not wait for math-verify's import (~0.9 s). At most MAX_WORKERS comparisons run at once.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

from openrlhf_growmtp.rewards.math.dapo import dapo_equal

logger = logging.getLogger(__name__)

TIME_LIMIT_S = 1.0  # per comparison, both parses included; legitimate answers take milliseconds
START_LIMIT_S = 60.0  # for a worker to import math-verify on a busy machine
MAX_WORKERS = min(8, os.cpu_count() or 1)
WORKER_MODULE = "openrlhf_growmtp.rewards.math.symbolic_worker"
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])  # so the worker imports this checkout, installed or not


class _Worker:
    """One `symbolic_worker` process and the bytes it has written but we have not read yet."""

    def __init__(self):
        path = os.pathsep.join(filter(None, (_PACKAGE_ROOT, os.environ.get("PYTHONPATH"))))
        self.proc = subprocess.Popen([sys.executable, "-m", WORKER_MODULE], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env=dict(os.environ, PYTHONPATH=path))
        self.ready, self.pending = False, b""

    def _read_line(self, deadline: float) -> bytes | None:
        """The next line, or None at the deadline or when the worker has exited."""
        poller = select.poll()  # poll, not select: the trainer may hold more than FD_SETSIZE descriptors
        poller.register(self.proc.stdout, select.POLLIN)
        while b"\n" not in self.pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not poller.poll(remaining * 1000):
                return None
            chunk = os.read(self.proc.stdout.fileno(), 1 << 12)
            if not chunk:
                return None
            self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\n")
        return line

    def ask(self, reference: str, answer: str) -> bool | None:
        """math-verify's verdict, or None when the worker failed to start, missed the deadline or died."""
        if not self.ready:
            self.ready = self._read_line(time.monotonic() + START_LIMIT_S) == b"ready"
            if not self.ready:
                return None
        try:
            self.proc.stdin.write(json.dumps([reference, answer]).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:
            return None
        reply = self._read_line(time.monotonic() + TIME_LIMIT_S)
        return None if reply is None else reply == b"1"

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()


_idle: list[_Worker] = []  # last in, first out: the warmest worker is taken first, the spare last
_lock = threading.Lock()
_slots = threading.BoundedSemaphore(MAX_WORKERS)


def _take() -> _Worker:
    with _lock:
        worker = _idle.pop() if _idle else _Worker()
        if not _idle:
            _idle.insert(0, _Worker())  # the spare starts importing now
        return worker


def symbolic_equal(answer: str, reference: str) -> bool:
    """Whether math-verify finds `answer` equivalent to `reference` within TIME_LIMIT_S (or dapo_equal holds)."""
    if dapo_equal(answer, reference):
        return True
    with _slots:
        worker = _take()
        verdict = worker.ask(reference, answer)
        if verdict is None:
            worker.close()
            logger.warning("math reward: math-verify gave no verdict within %.1f s; scoring 0", TIME_LIMIT_S)
            return False
        with _lock:
            _idle.append(worker)
        return verdict
