"""Intervals for speed ratios, from scipy.stats, and the one rule that reads them.

- `median_interval(values)`: the median of one measurement's per-pair ratios with its distribution-free
  interval (order statistics, `scipy.stats.quantile_test`): it covers that measurement's median at least at
  the level it states, whatever the ratios' distribution (with 6 pairs: [min, max], 96.9%). It says nothing
  about the next measurement: the machine's state moves between processes more than between pairs;
- `process_interval(groups)`: the figure of several measurement processes (fresh engines), hierarchical:
  each process's median over its pairs, then the mean of those medians with its Student-t interval over
  processes. The process is the unit, so the interval covers what moves between processes as well as between
  pairs (the two-stage estimate of a balanced random-effects design);
- `mean_interval(values)`: the mean and its Student-t 95% interval, for per-seed figures of a replicated study;
- `batch_ratio_interval(a, b)`: one run's cumulative ratio, sum(a) / sum(b) over paired steps, with a
  batch-means interval over the steps (what single steps' noise leaves of it, not seed to seed);
- `detectable_difference(sd, n)`: the smallest true difference of a mean that a design of `n` replicates with
  per-replicate spread `sd` detects at two-sided level 0.05 with power 0.8 (a one-sample t-test on the
  per-replicate differences): how large a difference a tie may hide, reported beside a figure;
- `verdict(interval)`: the decision rule, the only one (docs/measurements.md, "One rule"): "above" or "below"
  where the 95% interval excludes the reference, else "tie".
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, replace

LEVEL = 0.95
POWER = 0.8
BATCH = 10  # steps per batch: a step's time is correlated with its neighbours' (τ, lengths), not beyond


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float
    n: int  # pairs, seeds or processes: the units the interval is over
    method: str  # "order-statistic median" | "t mean" | "t mean of process medians" | "batch means (...)"
    coverage: float | None = None  # the order-statistic interval's exact level (at least LEVEL from 6 values on)

    def as_dict(self) -> dict:
        return asdict(self)

    def text(self, digits: int = 2, unit: str = "×") -> str:
        return f"{self.estimate:.{digits}f}{unit} [{self.low:.{digits}f}, {self.high:.{digits}f}]"


def _finite(values) -> list[float]:
    values = [float(v) for v in values]
    if not values:
        raise ValueError("an interval needs at least one value")
    bad = [v for v in values if not math.isfinite(v)]
    if bad:
        raise ValueError(f"non-finite values {bad} in an interval's data")
    return values


def median_interval(values, level: float = LEVEL) -> Interval:
    """The median of `values` with its distribution-free interval: the order statistics x(r) and x(n + 1 - r)
    that `scipy.stats.quantile_test` picks so that the interval covers the median with probability at least
    `level`; the exact probability, 1 - 2 P(Binomial(n, 1/2) < r), is kept as `coverage`. Below 6 values no
    pair of order statistics reaches 95%: [min, max] then, its lower coverage saying so."""
    import numpy as np
    from scipy import stats

    values = _finite(values)
    estimate, n = float(np.median(values)), len(values)
    ci = stats.quantile_test(values, q=estimate, p=0.5).confidence_interval(level)
    low, high = float(ci.low), float(ci.high)
    if not (math.isfinite(low) and math.isfinite(high)):
        low, high = min(values), max(values)
    rank = sum(v < low for v in values) + 1 if n > 1 else 1  # r: low is the r-th smallest value
    coverage = 1.0 - 2.0 * float(stats.binom.cdf(rank - 1, n, 0.5)) if n > 1 else 0.0
    return Interval(estimate, low, high, n, "order-statistic median", coverage)


def process_interval(groups, level: float = LEVEL) -> tuple[Interval, list[float]]:
    """Hierarchical: each group's (measurement process's) median over its values (pairs), then the mean of
    those medians with its Student-t interval over groups; also the medians themselves (the between-process
    spread, printed beside the figure). At least 2 groups."""
    medians = [statistics.median(_finite(group)) for group in groups]
    if len(medians) < 2:
        raise ValueError(f"{len(medians)} measurement process(es): the interval over processes needs at least 2")
    interval = mean_interval(medians, level)
    return replace(interval, method="t mean of process medians"), medians
def mean_interval(values, level: float = LEVEL) -> Interval:
    """The mean of `values` with its Student-t interval (a single value: a zero-width one, n = 1 says so)."""
    from scipy import stats

    values = _finite(values)
    n, estimate = len(values), sum(values) / len(values)
    if n < 2:
        return Interval(estimate, estimate, estimate, n, "t mean")
    sd = math.sqrt(sum((v - estimate) ** 2 for v in values) / (n - 1))
    half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)
    return Interval(estimate, estimate - half, estimate + half, n, "t mean")


def batch_ratio_interval(numerator, denominator, batch: int = BATCH, level: float = LEVEL) -> Interval:
    """sum(numerator) / sum(denominator) over paired series (one run's steps: GrowMTP's and the autoregressive
    arm's wall at each step) with a batch-means interval: the steps cut into B consecutive batches of `batch`
    (the last one takes the remainder), the ratio R = sum(G_k) / sum(A_k) of the batches' sums, and
    R +- t(B - 1) s / sqrt(B), s the spread of the linearised batch residuals (G_k - R A_k) / mean(A). Batches
    longer than the steps' correlation are nearly independent; a trend over the run (τ growing) counts as spread
    and widens the interval. Machine drift between the two arms and the spread between seeds are outside it."""
    from scipy import stats

    a, b = _finite(numerator), _finite(denominator)
    if len(a) != len(b) or len(a) < 3 * batch:
        raise ValueError(f"{len(a)} and {len(b)} steps: a batch-means interval needs paired series of at least "
                         f"{3 * batch} steps")
    count = len(a) // batch
    cuts = [i * batch for i in range(count)] + [len(a)]
    sums = [(sum(a[i:j]), sum(b[i:j])) for i, j in zip(cuts, cuts[1:])]
    ratio = sum(g for g, _ in sums) / sum(d for _, d in sums)
    scale = sum(d for _, d in sums) / count
    spread = sample_sd([(g - ratio * d) / scale for g, d in sums])
    half = float(stats.t.ppf(0.5 + level / 2, count - 1)) * spread / math.sqrt(count)
    return Interval(ratio, ratio - half, ratio + half, len(a), f"batch means ({batch} steps)")


def detectable_difference(sd: float, n: int, level: float = LEVEL, power: float = POWER) -> float:
    """The smallest true shift of a mean over `n` replicates of spread `sd` that a two-sided one-sample t-test
    at 1 - `level` finds with probability `power`: the exact power, from the noncentral t distribution."""
    from scipy import optimize, stats

    if n < 2 or not math.isfinite(sd):
        return math.inf
    df, critical = n - 1, float(stats.t.ppf(0.5 + level / 2, n - 1))

    def shortfall(noncentrality: float) -> float:
        # the wrong-sign tail is below 0.025 for a positive shift; scipy's nct gives NaN where it underflows
        wrong_sign = float(stats.nct.cdf(-critical, df, noncentrality))
        found = float(stats.nct.sf(critical, df, noncentrality)) + (0.0 if math.isnan(wrong_sign) else wrong_sign)
        return found - power

    # at a noncentrality of 40 the power is above 0.99 for any n >= 2
    return optimize.brentq(shortfall, 0.0, 40.0) * sd / math.sqrt(n)


def sample_sd(values) -> float:
    values = _finite(values)
    if len(values) < 2:
        return math.nan
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def verdict_phrase(figure, reference: float = 1.0) -> str:
    """`verdict` as a report writes it: "above 1", "tie 1", or what stands in for a verdict."""
    judged = verdict(figure, reference)
    return f"{judged} {reference:g}" if judged in ("below", "above", "tie") else judged


def verdict(figure, reference: float = 1.0) -> str:
    """The one decision rule for a figure with a 95% interval (an `Interval` or its dict): "below" or "above"
    where the interval excludes `reference`, "tie" where it holds it, "one measurement" where the interval is
    over fewer than 2 units (no spread to judge by), "no verdict" where the interval covers less than 95% (the
    order-statistic interval of a median over 5 or fewer pairs: [min, max] at 94% or less). The detectable
    difference is no part of the rule: it says how large a difference a tie may hide."""
    get = figure.get if isinstance(figure, dict) else lambda name: getattr(figure, name, None)
    if get("n") < 2:
        return "one measurement"
    if get("coverage") is not None and get("coverage") < LEVEL:
        return f"no verdict (a {100 * get('coverage'):.1f}% interval)"
    if get("high") < reference:
        return "below"
    if get("low") > reference:
        return "above"
    return "tie"
