"""Two simulated data-parallel ranks in two threads, for the core's lockstep tests."""

from __future__ import annotations

import contextlib
import operator
import threading
from concurrent.futures import ThreadPoolExecutor


class TwoRanks:
    """One rank's `core.Lockstep` in a simulated pair: `most`, `every` and `total` meet the other rank at a
    barrier and answer across both, as the trainer's all-reduces do. A collective that the other rank never
    makes (or makes with another length) fails instead of hanging."""

    def __init__(self, pair: dict, rank: int):
        self.pair, self.rank = pair, rank
        self.gathers = 0  # `gathered` entered (a collective: the other rank enters it too, with as many params)

    @staticmethod
    def run(work, first, second):
        """[work(lockstep, first), work(lockstep, second)], each on its own simulated rank."""
        pair = {"barrier": threading.Barrier(2, timeout=120), "slots": [None, None]}
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(work, TwoRanks(pair, r), data) for r, data in enumerate((first, second))]
            return [f.result() for f in futures]

    @staticmethod
    def backward(loss) -> None:
        loss.backward()

    def _exchange(self, values: list, op) -> list:
        slots, barrier = self.pair["slots"], self.pair["barrier"]
        slots[self.rank] = list(values)
        barrier.wait()
        mine, other = slots[self.rank], slots[1 - self.rank]
        barrier.wait()
        assert len(mine) == len(other), f"the ranks made different collectives: {mine} vs {other}"
        return [op(a, b) for a, b in zip(mine, other)]

    def gathered(self, params):
        self._exchange([len(list(params))], max)
        self.gathers += 1
        return contextlib.nullcontext()

    def most(self, counts) -> list[int]:
        return [int(v) for v in self._exchange(counts, max)]

    def every(self, flag: bool) -> bool:
        return bool(self._exchange([flag], operator.and_)[0])

    def total(self, values) -> list[float]:
        return self._exchange(values, operator.add)


def module_calls(head, run) -> dict[str, int]:
    """Forward calls per module of `head` and its lm_head (the backward's recomputations included) while `run()`
    runs: under ZeRO-3 each is a collective, so ranks must make the same."""
    calls: dict[str, int] = {}

    def count(name: str):
        def hook(module, args, out):
            calls[name] = calls.get(name, 0) + 1
        return hook

    modules = dict(head.named_modules(), lm_head=head.lm_head)
    handles = [m.register_forward_hook(count(name)) for name, m in modules.items()]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return calls
