"""The intervals behind every speed figure: the bootstrap median's coverage, the t interval against its textbook
form, and the detectable difference against the power of simulated t-tests."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from openrlhf_growmtp.measure.intervals import (detectable_difference, mean_interval, median_interval,
                                                sample_sd)


def test_median_interval_holds_the_sample_median_and_narrows_with_more_pairs():
    rng = np.random.default_rng(1)
    few, many = rng.lognormal(0.3, 0.1, 6), rng.lognormal(0.3, 0.1, 60)
    small, large = median_interval(few), median_interval(many)
    assert small.estimate == pytest.approx(float(np.median(few)))
    assert small.low <= small.estimate <= small.high and small.n == 6
    assert large.high - large.low < small.high - small.low


def test_median_interval_covers_the_true_median_about_as_often_as_it_says():
    # 200 data sets of 8 ratios with a known median exp(0.3): a 95% percentile-bootstrap interval of a median at
    # n = 8 covers it in 90-99% of them (it undercovers a little at small n); 200 draws put the observed share
    # within +-0.04 of its mean at 2.5 standard errors
    rng = np.random.default_rng(7)
    truth = math.exp(0.3)
    covered = sum(median_interval(rng.lognormal(0.3, 0.1, 8)).contains(truth) for _ in range(200))
    assert 0.86 <= covered / 200 <= 1.0


def test_a_constant_sample_has_a_zero_width_interval_and_bad_values_are_refused():
    assert median_interval([1.5, 1.5, 1.5]).as_dict() == {"estimate": 1.5, "low": 1.5, "high": 1.5, "n": 3,
                                                          "method": "bootstrap median"}
    with pytest.raises(ValueError, match="non-finite"):
        median_interval([1.0, float("nan")])
    with pytest.raises(ValueError, match="at least one"):
        mean_interval([])


def test_mean_interval_is_the_textbook_t_interval():
    # 1..5: mean 3, sd sqrt(2.5), t_0.975 with 4 degrees of freedom 2.7764 (a printed t table)
    interval = mean_interval([1, 2, 3, 4, 5])
    half = 2.7764 * math.sqrt(2.5) / math.sqrt(5)
    assert interval.estimate == 3 and interval.low == pytest.approx(3 - half, abs=1e-3)
    assert interval.high == pytest.approx(3 + half, abs=1e-3)
    assert mean_interval([2.0]).low == mean_interval([2.0]).high == 2.0  # one seed: no spread to speak of
    assert sample_sd([1, 2, 3, 4, 5]) == pytest.approx(math.sqrt(2.5))


def test_a_true_difference_of_the_detectable_size_is_found_80_percent_of_the_time():
    # simulated studies of n replicates at that shift, each judged by scipy's one-sample t-test: 4,000 of them
    # put the share found within +-0.025 of the true power (4 standard errors)
    rng = np.random.default_rng(3)
    for n in (3, 6):
        sd = 0.05
        shift = detectable_difference(sd, n)
        found = sum(stats.ttest_1samp(rng.normal(shift, sd, n), 0.0).pvalue < 0.05 for _ in range(4000))
        assert found / 4000 == pytest.approx(0.8, abs=0.025), n
    assert detectable_difference(0.05, 1) == math.inf
    assert detectable_difference(0.05, 24) < detectable_difference(0.05, 6)  # more replicates detect less
