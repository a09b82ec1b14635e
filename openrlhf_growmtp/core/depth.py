"""The drafting depth of the next rollout (`--growmtp_depth auto`): the depth d <= K whose predicted tokens per
second, tau(d) / cycle(d), is highest.

Terms (the README's glossary): alpha_j is the share of cycles whose first j drafts were accepted (the engine's
`growmtp/alpha_j`); a_j = alpha_j / alpha_(j-1) the conditional rate at position j; at depth d a cycle yields
tau(d) = 1 + sum_(j<=d) alpha_j tokens and costs cycle(d) seconds, one engine step of the running batch that
verifies d drafts per request and drafts d more. At depth 0 a step decodes one token per request (vLLM still
runs the head's first pass, which keeps its cache; `cycle(0)` includes it).

The rule, stated:
1. a_1..a_D come from the last rollout, drafted at depth D (the realised acceptance over every cycle).
2. **Exploration.** Positions deeper than D were not drafted. A position keeps the rate it last realised
   for `memory` rollouts (4); past that, or never drafted, it is assumed to continue at the deepest realised
   position's rate a_D (optimistic: an untrained deeper position usually does worse). So a deeper depth that
   did worse is not tried again at once, and is tried again within `memory` rollouts: while it does not pay,
   the rule spends at most one rollout in `memory + 1` probing it.
3. **No freeze.** While the head is still learning the depth stays >= 1 (`min_depth`), so a_1..a_D are
   measured again every rollout, and every deeper rate is re-assumed from a_D within `memory` rollouts: when
   the rates rise far enough that a deeper depth pays, the depth follows within `memory` rollouts (at once
   when nothing deeper was measured). Depth 0 (no drafts, so no records and nothing to learn from) is open
   only to a head that no longer trains (`min_depth=0`): a frozen or served head whose drafts cannot pay.
4. Before any rollout (nothing realised) the first depth is `min_depth` or 1, whichever is larger.
The costs are the engines' own step seconds per depth (`CycleCosts`), measured on the hardware they run on:
at start-up, then from the rollouts' own steps (`step_costs.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import median


@dataclass(frozen=True)
class CycleCosts:
    """Seconds of one engine step of the running batch at each depth 0..K (the cycle, drafting included)."""

    seconds: tuple[float, ...]  # [K + 1]

    def __post_init__(self):
        if not self.seconds or not all(math.isfinite(s) and s > 0 for s in self.seconds):
            raise ValueError(f"cycle costs must be finite and positive at every depth 0..K, got {self.seconds}")

    @property
    def max_depth(self) -> int:
        return len(self.seconds) - 1

    @classmethod
    def from_points(cls, points: dict[int, float], max_depth: int) -> CycleCosts:
        """Every depth 0..max_depth from measured ones: a measured depth keeps its seconds; the others lie on
        the least-squares line through the measured drafting depths, d >= 1 (verify and drafting both grow by
        one position per depth). Depth 0 drafts nothing and is not on that line: its reading never tilts it.
        Needs two measured drafting depths where any depth is not measured."""
        drafting = {d: s for d, s in points.items() if d >= 1}
        if len(points) == max_depth + 1:
            return cls(tuple(points[d] for d in range(max_depth + 1)))
        if len(drafting) < 2:
            raise ValueError(f"cycle costs need two measured drafting depths (d >= 1) to fill the others, got "
                             f"{sorted(points)}")
        xs, ys = list(drafting), [drafting[d] for d in drafting]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        return cls(tuple(points[d] if d in points else my + slope * (d - mx) for d in range(max_depth + 1)))

    @classmethod
    def from_steps(cls, steps: list[tuple[int, int, float]], max_depth: int) -> CycleCosts:
        """From engine steps (depth, running requests, seconds): per depth the median over the steps at the
        largest batch that depth ran (the calibration's full batch)."""
        points = {}
        for depth in sorted({d for d, _, _ in steps}):
            mine = [(b, s) for d, b, s in steps if d == depth]
            full = max(b for b, _ in mine)
            points[depth] = median(s for b, s in mine if b == full)
        return cls.from_points(points, max_depth)


def conditional_rates(alpha: list[float]) -> list[float]:
    """a_j = alpha_j / alpha_(j-1) (alpha_0 = 1); 0 once a position was never reached."""
    rates, previous = [], 1.0
    for a in alpha:
        rates.append(min(1.0, a / previous) if previous > 0 else 0.0)
        previous = a
    return rates


def expected_tau(rates: list[float], depth: int) -> float:
    """tau(depth) = 1 + sum_(j<=depth) prod_(i<=j) a_i."""
    tau, reach = 1.0, 1.0
    for rate in rates[:depth]:
        reach *= rate
        tau += reach
    return tau


@dataclass(frozen=True)
class DepthChoice:
    depth: int
    rates: tuple[float, ...]  # a_1..a_K the prediction used (realised up to the last depth, then rule 2)
    tokens_per_s: tuple[float, ...]  # predicted, per running request, at each depth 0..K

    @property
    def predicted_speedup(self) -> float:
        """The chosen depth's predicted tokens per second over depth 0's."""
        return self.tokens_per_s[self.depth] / self.tokens_per_s[0]


MEMORY = 4  # rollouts a deeper position keeps its realised rate (rule 2)


class DepthRule:
    """The rule's state over a run: each position's last realised rate and how many rollouts ago it was."""

    def __init__(self, max_depth: int, min_depth: int = 1, memory: int = MEMORY):
        if not 0 <= min_depth <= max_depth or memory < 0:
            raise ValueError(f"need 0 <= min_depth <= max_depth and memory >= 0, got {min_depth}, {max_depth}, "
                             f"{memory}")
        self.max_depth, self.min_depth, self.memory = max_depth, min_depth, memory
        self.rates: list[float | None] = [None] * max_depth
        self.ages = [0] * max_depth
        self.drafted = 0  # the depth of the last rollout observed

    def observe(self, alpha: list[float]) -> None:
        """The last rollout's alpha_1..alpha_D (D its depth; empty at depth 0)."""
        if len(alpha) > self.max_depth or not all(0.0 <= a <= 1.0 for a in alpha):
            raise ValueError(f"alpha must hold at most K = {self.max_depth} shares in [0, 1], got {alpha}")
        self.ages = [age + 1 for age in self.ages]
        for j, rate in enumerate(conditional_rates(list(alpha))):
            self.rates[j], self.ages[j] = rate, 0
        self.drafted = len(alpha)

    def assumed_rates(self) -> list[float] | None:
        """a_1..a_K as the prediction takes them (rules 1 and 2); None before anything was realised."""
        known = [j for j, rate in enumerate(self.rates) if rate is not None]
        if not known:
            return None
        deepest = self.rates[self.drafted - 1] if self.drafted else self.rates[known[-1]]
        rates = []
        for j, rate in enumerate(self.rates):
            fresh = rate is not None and (j < self.drafted or self.ages[j] < self.memory or not self.drafted)
            rates.append(rate if fresh else deepest)
        return rates

    def choose(self, costs: CycleCosts) -> DepthChoice:
        """The depth of the next rollout (rules 3 and 4)."""
        if costs.max_depth != self.max_depth:
            raise ValueError(f"costs cover depths 0..{costs.max_depth}, the rule 0..{self.max_depth}")
        rates = self.assumed_rates()
        if rates is None:
            return DepthChoice(min(self.max_depth, max(self.min_depth, 1)), (), tuple(1.0 / s for s in costs.seconds))
        speed = tuple(expected_tau(rates, d) / costs.seconds[d] for d in range(self.max_depth + 1))
        best = max(range(self.min_depth, self.max_depth + 1), key=lambda d: (speed[d], -d))  # ties: the shallower
        return DepthChoice(best, tuple(rates), speed)
