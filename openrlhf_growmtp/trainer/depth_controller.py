"""`--growmtp_depth auto` on the controller's side (upstream: none): before each rollout, the depth of its
cycles, chosen by `core.depth.DepthRule` and set on every engine (`GrowMTPRolloutActor.growmtp_set_depth`).

The costs are engine 0's own seconds per step at each depth, measured once before the first rollout at the
running batch the rollouts run at, after a warm-up generate (`growmtp_cycle_costs`), unless
`--growmtp_cycle_costs` gives them. The
acceptance is the last rollout's, read from its samples' accepted counts at the depth it drafted.
"""

from __future__ import annotations

import ray
import torch

from ..core.depth import CycleCosts, DepthChoice, DepthRule
from ..core.metrics import acceptance_summary
from .args import cycle_costs
from .keys import ACCEPTED_KEY

DEFAULT_CALIBRATION_REQUESTS = 16  # the running batch measured where --vllm.max_num_seqs is not set


class DepthController:
    def __init__(self, engines: list, args):
        g = args.growmtp
        self.engines, self.k = engines, int(g.k)
        # a learning head keeps drafting (core/depth.py, rule 3)
        self.rule = DepthRule(self.k, min_depth=0 if g.mode == "frozen" else 1)
        given = cycle_costs(g.cycle_costs)
        self.costs = None if given is None else CycleCosts(tuple(given))
        self.requests = args.vllm.max_num_seqs or DEFAULT_CALIBRATION_REQUESTS
        self.choice: DepthChoice | None = None
        self.depth = self.k

    def before_rollout(self) -> int:
        """Choose this rollout's depth and set it on every engine."""
        if self.costs is None:
            self.costs = CycleCosts(tuple(ray.get(self.engines[0].growmtp_cycle_costs.remote(self.requests))))
        self.choice = self.rule.choose(self.costs)
        self.depth = self.choice.depth
        ray.get([engine.growmtp_set_depth.remote(self.depth) for engine in self.engines])
        return self.depth

    def after_rollout(self, experiences) -> None:
        """The rollout's realised acceptance, α_1..α_depth (none at depth 0)."""
        accepted = [torch.tensor(a, dtype=torch.long) for e in experiences for a in e.info.get(ACCEPTED_KEY, [])]
        summary = acceptance_summary(torch.cat(accepted) if accepted else torch.zeros(0, dtype=torch.long), self.depth)
        self.rule.observe(summary.alpha if summary.cycles else [])

    def metrics(self) -> dict[str, float]:
        metrics = {"growmtp/depth": float(self.depth)}
        if self.choice is not None:
            metrics["growmtp/predicted_speedup"] = self.choice.predicted_speedup
        metrics.update({f"growmtp/cycle_s_{d}": s for d, s in enumerate(self.costs.seconds)} if self.costs else {})
        return metrics
