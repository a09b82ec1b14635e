"""Intervals for speed ratios, from scipy.stats.

- `median_interval(values)`: the median of per-pair ratios and its bootstrap 95% interval (percentile method:
  with a handful of pairs BCa's acceleration estimate is unstable, and the percentile interval of a median
  needs no symmetry);
- `mean_interval(values)`: the mean and its Student-t 95% interval, for per-seed figures of a replicated study;
- `detectable_difference(sd, n)`: the smallest true difference of a mean that a design of `n` replicates with
  per-replicate spread `sd` detects at two-sided level 0.05 with power 0.8 (a one-sample t-test on the
  per-replicate differences). A difference below it is called a tie.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

LEVEL = 0.95
POWER = 0.8
BOOTSTRAP_RESAMPLES = 9999
BOOTSTRAP_SEED = 0  # a fixed resampling seed: the same data give the same interval


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float
    n: int
    method: str  # "bootstrap median" | "t mean"

    def contains(self, value: float) -> bool:
        return self.low <= value <= self.high

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
    """The median of `values` with its percentile-bootstrap interval (a single value: a zero-width one)."""
    import numpy as np
    from scipy import stats

    values = _finite(values)
    estimate = float(np.median(values))
    if len(values) < 2 or min(values) == max(values):
        return Interval(estimate, min(values), max(values), len(values), "bootstrap median")
    result = stats.bootstrap((np.asarray(values),), np.median, confidence_level=level, method="percentile",
                             n_resamples=BOOTSTRAP_RESAMPLES, rng=np.random.default_rng(BOOTSTRAP_SEED))
    ci = result.confidence_interval
    return Interval(estimate, float(ci.low), float(ci.high), len(values), "bootstrap median")


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
