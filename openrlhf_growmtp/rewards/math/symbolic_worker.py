"""The process `symbolic` asks: math-verify's verdict on `[reference, answer]` JSON lines, one `1`/`0` line each.

Run as `python -m openrlhf_growmtp.rewards.math.symbolic_worker`; it prints `ready` once math-verify is
imported. math-verify's own SIGALRM timeouts are off: the parent kills this process at its deadline,
which also bounds time spent inside one C call (a signal handler only runs between bytecodes).
"""

from __future__ import annotations

import json
import logging
import resource
import sys

MEMORY_BYTES = 2 << 30  # sympy on a hostile answer gets a MemoryError (scored 0), not the trainer's memory


def equal(reference: str, answer: str) -> bool:
    """math-verify's `verify(parse(reference), parse(answer))`, each wrapped as inline math."""
    from math_verify import parse, verify

    gold = parse("$" + reference + "$", parsing_timeout=None)
    return bool(gold) and verify(gold, parse("$" + answer + "$", parsing_timeout=None), timeout_seconds=None)


def main() -> None:
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    limit = MEMORY_BYTES if hard == resource.RLIM_INFINITY else min(MEMORY_BYTES, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    logging.disable(logging.WARNING)  # "timeout is disabled" on every call: intended, see the docstring
    equal("1", "1")  # imports math-verify and warms its caches before the parent's clock starts
    print("ready", flush=True)
    for line in sys.stdin:
        try:
            verdict = equal(*json.loads(line))
        except Exception:  # MemoryError, RecursionError, ...: not equal, and the worker lives on
            verdict = False
        print(int(verdict), flush=True)


if __name__ == "__main__":
    main()
