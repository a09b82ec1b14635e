"""The cycle costs `--growmtp_depth auto` chooses with: medians of the run's own engine steps at each depth.

Each engine times its steps (`vllm_patches.engine_depth`): (depth, running requests, seconds) of every step
whose requests all verify and draft at the step's depth. After each rollout the controller hands the
rollout's steps here (`RecentCosts.add_rollout`), and a depth's cost is:
- *measured*: the median seconds of its steps at the reference batch over the last `window` rollouts that
  drafted at that depth, once they hold `min_steps` such steps. The reference batch is the largest running
  batch among the kept steps of every depth: a rollout with more samples than the engine runs at once spends
  most of its steps there, and steps at smaller batches (a rollout's draining tail) are left out, so that every
  depth is compared at one batch;
- *from the start-up measurement* (`prior`, `engine_depth.calibration`) otherwise (a depth not drafted
  lately, or depth 0, which a learning head never drafts), scaled by the median over measured depths of
  measured / prior: the start-up generates are short and random, the rollouts run at their own context lengths,
  and the scale keeps a measured depth and an unmeasured one comparable.
A median over a rollout's hundreds of steps is not moved by a few slow ones (a sync, a cache miss), and the
next rollout at that depth measures it again: no one moment's noise decides for the whole run.
"""

from __future__ import annotations

from collections import defaultdict, deque
from statistics import median
from typing import Sequence

from .depth import CycleCosts

WINDOW = 4  # rollouts per depth whose steps the median pools (a depth probed every MEMORY + 1 rollouts: 20)
MIN_STEPS = 8  # steps at the reference batch before a depth counts as measured


class RecentCosts:
    """Cycle costs from recent rollouts' steps over a start-up measurement (module docstring)."""

    def __init__(self, prior: CycleCosts, window: int = WINDOW, min_steps: int = MIN_STEPS):
        if window < 1 or min_steps < 1:
            raise ValueError(f"window and min_steps must be >= 1, got {window}, {min_steps}")
        self.prior, self.window, self.min_steps = prior, window, min_steps
        # depth -> the (running requests, seconds) of each of its last `window` rollouts
        self.rollouts: dict[int, deque[list[tuple[int, float]]]] = defaultdict(lambda: deque(maxlen=window))

    def add_rollout(self, steps: Sequence[tuple[int, int, float]]) -> None:
        """One rollout's steps, (depth, running requests, seconds), from every engine."""
        by_depth: dict[int, list[tuple[int, float]]] = defaultdict(list)
        for depth, requests, seconds in steps:
            if not 0 <= depth <= self.prior.max_depth or requests < 1 or not seconds > 0:
                raise ValueError(f"a step must be (depth in 0..{self.prior.max_depth}, requests >= 1, seconds > 0), "
                                 f"got {(depth, requests, seconds)}")
            by_depth[int(depth)].append((int(requests), float(seconds)))
        for depth, kept in by_depth.items():
            self.rollouts[depth].append(kept)

    def measured(self) -> dict[int, tuple[float, int]]:
        """depth -> (median seconds, steps behind it) at the reference batch, for the measured depths."""
        pooled = {d: [step for rollout in rollouts for step in rollout] for d, rollouts in self.rollouts.items()}
        batches = [requests for steps in pooled.values() for requests, _ in steps]
        if not batches:
            return {}
        batch = max(batches)
        at_batch = {d: [seconds for requests, seconds in steps if requests == batch] for d, steps in pooled.items()}
        return {d: (median(s), len(s)) for d, s in sorted(at_batch.items()) if len(s) >= self.min_steps}

    def costs(self) -> CycleCosts:
        """Every depth's seconds: measured where it is, else the prior's at the measured depths' scale."""
        measured = self.measured()
        prior = self.prior.seconds
        scale = median(seconds / prior[d] for d, (seconds, _) in measured.items()) if measured else 1.0
        return CycleCosts(tuple(measured[d][0] if d in measured else prior[d] * scale
                                for d in range(self.prior.max_depth + 1)))
