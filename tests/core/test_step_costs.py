"""Cycle costs from the run's own steps (`core/step_costs.py`): robust medians per depth at one batch, recent
rollouts only, the start-up measurement where a depth was not drafted."""

import random
from statistics import mean, pstdev

import pytest

from openrlhf_growmtp.core.depth import CycleCosts
from openrlhf_growmtp.core.step_costs import RecentCosts

PRIOR = CycleCosts((1.0, 1.1, 1.2, 1.3))


def rollout(depth: int, seconds: float, steps: int = 40, batch: int = 2, rng=None, tail: int = 5,
            outliers: float = 0.0) -> list[tuple[int, int, float]]:
    """A rollout's steps at `depth`: `steps` at the full batch around `seconds` (±5% uniform, a share
    `outliers` of them 10x slower), then a draining tail at batch 1 that runs 3x faster."""
    rng = rng or random.Random(0)
    full = [(depth, batch, seconds * (10.0 if rng.random() < outliers else rng.uniform(0.95, 1.05)))
            for _ in range(steps)]
    return full + [(depth, 1, seconds / 3) for _ in range(tail)]


def test_a_depths_cost_is_the_median_at_the_full_batch_unmoved_by_slow_steps():
    costs = RecentCosts(PRIOR)
    steps = rollout(1, 2.0, steps=200, outliers=0.1, rng=random.Random(1))
    costs.add_rollout(steps)
    value, count = costs.measured()[1]
    assert count == 200  # the batch-1 tail is left out
    assert value == pytest.approx(2.0, abs=0.02)  # the median of ±5% noise with 10% outliers
    assert mean(s for _, b, s in steps if b == 2) > 2.5  # where a mean would have been


def test_only_the_last_window_of_rollouts_at_a_depth_counts():
    recent, everything = RecentCosts(PRIOR, window=4), RecentCosts(PRIOR, window=100)
    for seconds in (1.0,) * 4 + (3.0,) * 4:  # the engine got slower (longer responses, say)
        for costs in (recent, everything):
            costs.add_rollout(rollout(2, seconds))
    assert len(recent.rollouts[2]) == 4
    assert recent.measured()[2][0] == pytest.approx(3.0, rel=0.05)  # the last 4 rollouts only
    assert everything.measured()[2][0] < 2.5  # pooled with the older ones it would not be


def test_an_unmeasured_depth_takes_the_start_up_cost_at_the_measured_scale():
    costs = RecentCosts(PRIOR, min_steps=8)
    assert costs.costs() == PRIOR  # nothing measured yet
    costs.add_rollout([(1, 2, 2.2)] * 10 + [(3, 2, 5.0)] * 7)  # depth 3: too few steps to count
    got = costs.costs().seconds
    assert got[1] == 2.2  # measured
    assert got[0] == pytest.approx(2.0) and got[2] == pytest.approx(2.4) and got[3] == pytest.approx(2.6)  # 2x
    costs.add_rollout([(3, 2, 2.8)] * 8)
    got = costs.costs().seconds
    assert got[3] == 2.8 and got[2] == pytest.approx(1.2 * median_ratio(2.2 / 1.1, 2.8 / 1.3))


def median_ratio(a: float, b: float) -> float:
    return (a + b) / 2  # the median of two


def test_steps_are_compared_at_one_batch_across_depths():
    # depth 1 ran only at batch 1 lately, depth 3 at batch 2: depth 1 is then not measured at the reference
    # batch (2) and keeps the start-up cost at depth 3's scale, rather than a batch-1 time that looks 3x cheaper
    costs = RecentCosts(PRIOR)
    costs.add_rollout([(1, 1, 0.5)] * 20)
    costs.add_rollout([(3, 2, 2.6)] * 20)
    assert set(costs.measured()) == {3}
    assert costs.costs().seconds[1] == pytest.approx(1.1 * 2.0)


def test_recent_medians_spread_less_than_one_start_up_measurement():
    """Engine time drifts from moment to moment (a factor per measurement, sd 10%): the start-up measurement
    reads each depth at one moment, the recent costs pool each depth over 4 rollouts' medians. Over 400
    simulated runs, the cost ratio depth 3 / depth 1 that decides between them spreads at least 1.5x less
    (4 moments per depth: sqrt(4) = 2x less spread in expectation)."""
    rng = random.Random(3)
    true = {1: 1.0, 3: 1.3}
    one, recent = [], []
    for _ in range(400):
        moment = {d: rng.gauss(1.0, 0.1) for d in true}
        one.append(true[3] * moment[3] / (true[1] * moment[1]))
        costs = RecentCosts(CycleCosts((0.9, 1.0, 1.15, 1.3)))
        for _ in range(4):
            for depth in true:
                costs.add_rollout(rollout(depth, true[depth] * rng.gauss(1.0, 0.1), rng=rng))
        measured = costs.measured()
        recent.append(measured[3][0] / measured[1][0])
    assert pstdev(one) > 1.5 * pstdev(recent), (pstdev(one), pstdev(recent))
    assert mean(recent) == pytest.approx(1.3, rel=0.02)


def test_bad_steps_are_refused_by_name():
    costs = RecentCosts(PRIOR)
    for step in ((4, 2, 1.0), (1, 0, 1.0), (1, 2, 0.0), (1, 2, float("nan"))):
        with pytest.raises(ValueError, match="a step must be"):
            costs.add_rollout([step])
