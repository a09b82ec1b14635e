"""The depth rule (`core/depth.py`) against independent references: Monte-Carlo chains for the cost model's
optimum, a simulated run whose acceptance rises for the exploration rule."""

import pytest
import torch

from openrlhf_growmtp.core.depth import CycleCosts, DepthRule, conditional_rates, expected_tau
from openrlhf_growmtp.core.metrics import acceptance_summary

# A cost line of the speed world's shape: a verify of K + 1 about one decode, a draft step ~0.1 of it.
COSTS = CycleCosts((1.0, 1.15, 1.3, 1.45, 1.6))


def sampled_alpha(rates: list[float], depth: int, cycles: int, generator: torch.Generator) -> list[float]:
    """The realised alpha_1..alpha_depth of `cycles` chains drafted at `depth` with conditional rates
    `rates`: each draft accepted with its rate until the first rejection (as the engine counts)."""
    accepted = torch.rand(cycles, depth, generator=generator) < torch.tensor(rates[:depth])
    counts = accepted.long().cumprod(dim=1).sum(dim=1)
    return acceptance_summary(counts, depth).alpha


def test_the_cost_models_optimum_is_the_best_depth_of_monte_carlo_chains():
    """Known costs and rates: the rule's depth is the one whose sampled tokens per second is highest (chains
    drawn draft by draft, not the closed form), and its predicted tau matches the sampled one."""
    rates, costs = [0.9, 0.8, 0.3, 0.3], CycleCosts((1.0, 1.25, 1.5, 1.75, 2.0))
    rule = DepthRule(4, memory=0)
    rule.observe([0.9, 0.72, 0.216, 0.0648])  # alpha_k = prod a_i, drafted at K
    choice = rule.choose(costs)
    g = torch.Generator().manual_seed(0)
    sampled = []
    for depth in range(5):
        tau = 1.0 + sum(sampled_alpha(rates, 4, 200_000, g)[:depth])
        sampled.append(tau / costs.seconds[depth])
        assert expected_tau(list(choice.rates), depth) == pytest.approx(tau, abs=0.01)  # 5 sigma of 200k chains
    best = max(range(5), key=lambda d: sampled[d])
    assert choice.depth == best == 2  # 2.62/1.5 = 1.75 against 2.84/1.75 = 1.62 at depth 3: far beyond the noise


def test_break_even_ends_choose_the_shallowest_and_the_deepest():
    hopeless, certain = DepthRule(4, min_depth=0), DepthRule(4, min_depth=0)
    hopeless.observe([0.02, 0.0, 0.0, 0.0])
    certain.observe([0.99, 0.98, 0.97, 0.96])
    assert hopeless.choose(COSTS).depth == 0
    assert certain.choose(COSTS).depth == 4
    learning = DepthRule(4, min_depth=1)  # a head that trains keeps drafting
    learning.observe([0.02, 0.0, 0.0, 0.0])
    assert learning.choose(COSTS).depth == 1


def test_the_depth_follows_a_rising_alpha():
    """A head whose every position's rate rises from 0.05 to 0.95 over 40 rollouts, drafted at the rule's depth
    each time and observed only there (sampled chains): the first depth is 1, and the rule drafts K within
    MEMORY + 1 rollouts of the step from which K pays under the true rates."""
    g = torch.Generator().manual_seed(1)
    rule, depths = DepthRule(4), []
    for step in range(40):
        rate = 0.05 + 0.9 * step / 39
        depth = rule.choose(COSTS).depth
        depths.append(depth)
        rule.observe(sampled_alpha([rate] * 4, depth, 2_000, g))
    assert depths[0] == 1
    assert depths[-1] == 4
    # where K pays under the true rates (tau(4)/cost(4) highest), the rule drafts K within MEMORY + 1 steps
    true_best = [max(range(5), key=lambda d: expected_tau([0.05 + 0.9 * s / 39] * 4, d) / COSTS.seconds[d])
                 for s in range(40)]
    first_k = true_best.index(4)
    assert 4 in depths[first_k:first_k + 6], (true_best, depths)
    assert depths[:5] == [1] * 5  # rates below break-even: depth 1, the least a learning head drafts


def test_a_deeper_depth_that_does_worse_is_left_and_probed_again_within_memory():
    """Position 1 accepts 0.9, deeper ones 0.05: the optimistic continuation tries K once, measures the
    deeper positions, returns to 1, and probes deeper again no more often than once per MEMORY + 1 rollouts."""
    g = torch.Generator().manual_seed(2)
    rule, depths = DepthRule(4, memory=4), []
    for _ in range(21):
        depth = rule.choose(COSTS).depth
        depths.append(depth)
        rule.observe(sampled_alpha([0.9, 0.05, 0.05, 0.05], depth, 2_000, g))
    probes = [i for i, d in enumerate(depths) if d > 1]
    assert depths[0] == 1 and probes and probes[0] == 1
    assert all(b - a >= 5 for a, b in zip(probes, probes[1:])), depths
    assert len(probes) >= 3, depths  # it keeps probing: a head that later learns position 2 is found


def test_costs_from_points_and_steps():
    # depth 0 (slower than depth 1 here, as vLLM's depth-0 path measured) keeps its reading and does not tilt
    # the line through the drafting depths: a fit through all three would put depth 2 at 1.36, depth 4 at 1.43
    line = CycleCosts.from_points({0: 1.4, 1: 1.15, 3: 1.45}, 4)
    assert line.seconds == pytest.approx((1.4, 1.15, 1.3, 1.45, 1.6))
    assert CycleCosts.from_points({0: 1.4, 1: 1.15}, 1).seconds == (1.4, 1.15)  # nothing to fill
    # steps (depth, requests, seconds): the median at each depth's largest batch; smaller batches ignored
    steps = [(0, 2, 1.0), (0, 2, 1.2), (0, 2, 0.9), (0, 1, 0.1), (1, 2, 1.3), (1, 2, 1.1), (3, 2, 1.6)]
    costs = CycleCosts.from_steps(steps, 3)
    assert costs.seconds[0] == 1.0 and costs.seconds[1] == pytest.approx(1.2) and costs.seconds[3] == 1.6
    assert costs.seconds[1] < costs.seconds[2] < costs.seconds[3]
    with pytest.raises(ValueError, match="two measured drafting depths"):
        CycleCosts.from_points({0: 0.9, 1: 1.0}, 3)
    with pytest.raises(ValueError, match="finite and positive"):
        CycleCosts((1.0, float("nan")))


def test_conditional_rates_and_bad_input():
    assert conditional_rates([0.5, 0.25, 0.0, 0.0]) == [0.5, 0.5, 0.0, 0.0]
    rule = DepthRule(3)
    with pytest.raises(ValueError, match="at most K = 3"):
        rule.observe([0.5, 0.4, 0.3, 0.2])
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        rule.observe([1.5])
    with pytest.raises(ValueError, match="costs cover depths 0..4"):
        rule.choose(COSTS)
