"""The head's learning-rate schedule: linear warm-up, then cosine decay to min_lr_ratio of the peak.

Steps are counted in the caller's unit: RL steps under the paper's schedule (one head step per RL step),
policy optimizer steps otherwise. The head is updated from the first step (no freeze phase), so warm-up
starts above zero: step 0 runs at peak / warmup_steps. The policy's LR is upstream's, not touched here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_HEAD_LR = {"random": 3e-4, "native": 1e-4}
DEFAULT_WARMUP_STEPS = 10
DEFAULT_MIN_LR_RATIO = 0.1


@dataclass(frozen=True)
class HeadLRSchedule:
    total_steps: int
    warmup_steps: int = DEFAULT_WARMUP_STEPS
    min_lr_ratio: float = DEFAULT_MIN_LR_RATIO

    def __post_init__(self):
        if self.total_steps < 1 or self.warmup_steps < 0 or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"bad head LR schedule: {self}")

    def __call__(self, step: int) -> float:
        """LR multiplier (of the peak) for the update at 0-based `step`; a pure function of step."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        decay_steps = max(1, self.total_steps - self.warmup_steps - 1)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine
