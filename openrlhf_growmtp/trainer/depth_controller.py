"""`--growmtp_depth auto` on the controller's side (upstream: none): before each rollout, the depth of its
cycles, chosen by `core.depth.DepthRule` and set on every engine (`GrowMTPRolloutActor.growmtp_set_depth`).

The costs: engine 0's seconds per step at each depth, measured once before the first rollout at the running
batch the rollouts run at, after a warm-up generate (`growmtp_cycle_costs`); then, after each rollout, every
engine's own steps of that rollout (`growmtp_step_times`) replace them depth by depth with recent medians
(`core.step_costs.RecentCosts`). `--growmtp_cycle_costs` gives fixed costs instead (the choices are then the
same run after run). The acceptance is the last training rollout's, read from its samples' accepted counts at
the depth it drafted; evaluation's rollouts never reach it (`samples_generator.generate_eval_samples`).
"""

from __future__ import annotations

import ray

from ..core.depth import CycleCosts, DepthChoice, DepthRule
from ..core.metrics import acceptance_summary
from ..core.step_costs import RecentCosts
from .args.depth import cycle_costs
from .keys import accepted_counts

DEFAULT_CALIBRATION_REQUESTS = 16  # the running batch measured where --vllm.max_num_seqs is not set


class DepthController:
    def __init__(self, engines: list, args):
        g = args.growmtp
        self.engines, self.k = engines, int(g.k)
        # a learning head keeps drafting (core/depth.py, rule 3)
        self.rule = DepthRule(self.k, min_depth=0 if g.mode == "frozen" else 1)
        given = cycle_costs(g.cycle_costs)
        self.costs = None if given is None else CycleCosts(tuple(given))  # what the last choice read
        self.recent: RecentCosts | None = None  # measured costs (none where given)
        self.cost_steps: dict[int, int] = {}  # depth -> rollout steps behind the cost the last choice read
        self.requests = args.vllm.max_num_seqs or DEFAULT_CALIBRATION_REQUESTS
        self.choice: DepthChoice | None = None
        self.depth = self.k

    def before_rollout(self) -> int:
        """Choose this rollout's depth and set it on every engine."""
        if self.costs is None:
            prior = CycleCosts(tuple(ray.get(self.engines[0].growmtp_cycle_costs.remote(self.requests))))
            self.recent = RecentCosts(prior)
        if self.recent is not None:
            self.costs = self.recent.costs()
            self.cost_steps = {d: steps for d, (_, steps) in self.recent.measured().items()}
        self.choice = self.rule.choose(self.costs)
        self.depth = self.choice.depth
        ray.get([engine.growmtp_set_depth.remote(self.depth) for engine in self.engines])
        return self.depth

    def after_rollout(self, experiences) -> None:
        """The rollout's realised acceptance, α_1..α_depth (none at depth 0), and its engines' step seconds."""
        summary = acceptance_summary(accepted_counts(experiences), self.depth)
        self.rule.observe(summary.alpha if summary.cycles else [])
        if self.recent is not None:
            steps = ray.get([engine.growmtp_step_times.remote() for engine in self.engines])
            self.recent.add_rollout([tuple(step) for engine_steps in steps for step in engine_steps])

    def drop_engine_steps(self) -> None:
        """Read and drop the engines' steps since the last read (an evaluation's: never a cost of training's)."""
        if self.recent is not None:
            ray.get([engine.growmtp_step_times.remote() for engine in self.engines])

    def metrics(self) -> dict[str, float]:
        """The depth drafted, its predicted speed-up, the conditional rates a_j it was predicted with
        (`depth_rate_j`), the costs it was chosen with and, where measured, how many rollout steps each depth's
        cost is the median of (0: the start-up measurement's, scaled)."""
        metrics = {"growmtp/depth": float(self.depth)}
        if self.choice is not None:
            metrics["growmtp/predicted_speedup"] = self.choice.predicted_speedup
            metrics.update({f"growmtp/depth_rate_{j}": rate for j, rate in enumerate(self.choice.rates, start=1)})
        metrics.update({f"growmtp/cycle_s_{d}": s for d, s in enumerate(self.costs.seconds)} if self.costs else {})
        if self.recent is not None:
            metrics.update({f"growmtp/cycle_steps_{d}": float(self.cost_steps.get(d, 0)) for d in range(self.k + 1)})
        return metrics
