"""The intervals behind every speed figure, tested by what they claim: coverage on synthetic data whose truth is
known (the order-statistic median, the interval over measurement processes, the block bootstrap of a run's
cumulative ratio), the t interval against its textbook form, the detectable difference against the power of
simulated t-tests, and the one decision rule."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from openrlhf_growmtp.measure.intervals import (batch_ratio_interval, detectable_difference, mean_interval,
                                                median_interval, process_interval, sample_sd, verdict)


def covers(interval, value: float) -> bool:
    return interval.low <= value <= interval.high


def test_the_median_interval_of_six_pairs_is_min_to_max_and_covers_at_its_stated_level():
    # distribution-free: for any continuous distribution [x(1), x(6)] covers the median with probability
    # 1 - 2 / 2^6 = 0.96875 exactly. 2,000 samples of a skewed distribution (lognormal, sigma 0.5) put the observed
    # share within +-0.016 of it (4 standard errors of 0.0039)
    rng = np.random.default_rng(7)
    truth = math.exp(0.2)
    covered = 0
    for _ in range(2000):
        sample = rng.lognormal(0.2, 0.5, 6)
        interval = median_interval(sample)
        assert (interval.low, interval.high) == (sample.min(), sample.max())
        covered += covers(interval, truth)
    assert interval.coverage == pytest.approx(0.96875) and interval.method == "order-statistic median"
    assert covered / 2000 == pytest.approx(0.96875, abs=0.016)
    # more pairs: inner order statistics at >= 95% (n = 18: the 5th and 14th, 96.9%)
    wide = median_interval(np.arange(1.0, 19.0))
    assert (wide.low, wide.high) == (5.0, 14.0) and wide.coverage >= 0.95
    # too few pairs for 95%: [min, max], its lower level said
    assert median_interval([1.0, 2.0, 3.0]).coverage == pytest.approx(0.75)


def hierarchical_speedups(rng, processes: int, pairs: int, between: float, within: float, size: int):
    """`size` data sets of per-pair speedups, log-normal around 1.15: each process's log level drawn with spread
    `between` (the machine's state), each pair's with spread `within` around it. [size, processes, pairs]."""
    level = math.log(1.15) + rng.normal(0.0, between, (size, processes, 1))
    return np.exp(level + rng.normal(0.0, within, (size, processes, pairs)))


def test_the_interval_over_processes_covers_what_moves_between_processes_and_one_process_does_not():
    # The truth a paired figure estimates: the mean over processes of one process's median over its 6 pairs, here
    # from 200,000 simulated processes (standard error 0.00014, against intervals about +-0.15 wide). The
    # spreads are the kept demo's: within a process about 4% between pairs, between two processes of one
    # checkpoint about 5% (the speed study's 1.129 against 1.050).
    rng = np.random.default_rng(11)
    truth = float(np.median(hierarchical_speedups(rng, 1, 6, 0.05, 0.04, 200_000)[:, 0], axis=-1).mean())
    data = hierarchical_speedups(rng, 3, 6, 0.05, 0.04, 2000)
    over_processes = one_process = 0
    for groups in data:
        interval, medians = process_interval(groups)
        assert interval.estimate == pytest.approx(np.mean(medians)) and interval.n == 3
        over_processes += covers(interval, truth)
        one_process += covers(median_interval(groups[0]), truth)
    # the t interval over 3 process medians is exact for normal medians: 2,000 data sets put its share within
    # +-0.02 of 0.95 (4 standard errors of 0.0049)
    assert over_processes / 2000 == pytest.approx(0.95, abs=0.02)
    # one process's own interval ([min, max] of its pairs) leaves the between-process spread out: expected near
    # 0.6 here; below 0.85 by far more than the sampling error
    assert one_process / 2000 < 0.85
    with pytest.raises(ValueError, match="at least 2"):
        process_interval([[1.0, 1.1]])


def ar1(rng, n: int, phi: float, sd: float, size: int) -> np.ndarray:
    """[size, n] stationary AR(1) noise of marginal spread `sd`."""
    noise = rng.normal(0.0, sd * math.sqrt(1 - phi ** 2), (size, n))
    out = np.empty_like(noise)
    out[:, 0] = rng.normal(0.0, sd, size)
    for t in range(1, n):
        out[:, t] = phi * out[:, t - 1] + noise[:, t]
    return out


def test_batch_means_cover_a_runs_cumulative_ratio_under_correlated_step_noise():
    # 150 steps per arm, step times 3.0 s and 3.1 s with 10% noise correlated from step to step (AR(1), 0.5: nearly
    # gone across 10-step batches); the truth is 3.0 / 3.1. 1,000 runs put the observed share within +-0.028 of
    # 0.95 (4 standard errors of 0.0069). (A moving-block percentile bootstrap, tried first on the same data,
    # covered 0.90: it is not used.)
    rng = np.random.default_rng(5)
    steps = 150
    mine = 3.0 * (1 + ar1(rng, steps, 0.5, 0.1, 1000))
    theirs = 3.1 * (1 + ar1(rng, steps, 0.5, 0.1, 1000))
    covered = sum(covers(batch_ratio_interval(a, b), 3.0 / 3.1) for a, b in zip(mine, theirs))
    assert covered / 1000 == pytest.approx(0.95, abs=0.028)
    interval = batch_ratio_interval(mine[0], theirs[0])
    assert interval.estimate == pytest.approx(mine[0].sum() / theirs[0].sum()) and interval.n == steps
    with pytest.raises(ValueError, match="at least 30 steps"):
        batch_ratio_interval([1.0] * 20, [1.0] * 20)


def test_one_rule_decides_win_tie_and_loss_by_the_interval_alone():
    assert verdict({"estimate": 0.954, "low": 0.912, "high": 0.995, "n": 3}) == "below"  # whatever the detectable
    assert verdict({"estimate": 1.04, "low": 0.956, "high": 1.13, "n": 3}) == "tie"
    assert verdict(median_interval([1.14, 1.16, 1.18, 1.2, 1.22, 1.26])) == "above"
    assert verdict({"estimate": 1.1, "low": 1.1, "high": 1.1, "n": 1}) == "one measurement"
    # [min, max] of 3 pairs covers 75%: both above 1 is no 95% verdict
    assert verdict(median_interval([1.14, 1.16, 1.18])) == "no verdict (a 75.0% interval)"


def test_bad_values_are_refused():
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
