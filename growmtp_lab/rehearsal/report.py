"""What a rehearsal run logged, step by step, and whether it passed.

Reads the TensorBoard events the run wrote through upstream's own logger (`--logger.tensorboard_dir`),
so the GrowMTP and the autoregressive (K = 0, upstream controller) runs are read the same way.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

PREFIX = "train/"
# How many standard errors a native head's step tau may fall below the build's before the step fails: a
# one-sided normal tail of 3.2e-5 per step, so about 1.3e-3 over the ~40 native-head steps of `make rehearse`.
MARGIN_STANDARD_ERRORS = 4.0


class RehearsalFailed(RuntimeError):
    """The run finished but its log shows it did not do what a rehearsal must show."""


@dataclass
class Step:
    step: int
    values: dict[str, float] = field(default_factory=dict)

    def get(self, key: str) -> float:
        return self.values.get(key, math.nan)


@dataclass(frozen=True)
class MeasuredTau:
    """The world build's realised tau of its frozen native head at one depth K (native_head.measure_tau).

    `accepted_variance` is the variance of one cycle's accepted count (0..K); `design_effect` is how much
    more the mean of a response's cycles varies than independent cycles would (cycles of one response
    share its loops), measured over the build's responses, at least 1.
    """

    k: int
    tau: float
    cycles: int
    accepted_variance: float
    design_effect: float

    def margin(self, cycles: float) -> float:
        """How far below `tau` a step of `cycles` cycles may land by chance alone: MARGIN_STANDARD_ERRORS
        times the standard error of (step tau - build tau), each a mean of clustered cycles."""
        return MARGIN_STANDARD_ERRORS * math.sqrt(self.accepted_variance * self.design_effect
                                                  * (1.0 / cycles + 1.0 / self.cycles))


def read_measured_tau(world_model_dir: str | Path, k: int) -> MeasuredTau | None:
    """The build's measured tau at depth k from <world_model_dir>/rehearsal.json; None where it measured
    none at that depth (a model without a native head, or a K that no script of that model uses)."""
    info = json.loads((Path(world_model_dir) / "rehearsal.json").read_text())
    measured = info.get("native_head", {}).get("tau", {}).get(str(k))
    return None if measured is None else MeasuredTau(k=k, **measured)


def read_steps(tensorboard_dir: str | Path) -> list[Step]:
    """Every train/* scalar of the newest run under tensorboard_dir, grouped by global step."""
    runs = sorted({p.parent for p in Path(tensorboard_dir).rglob("events.out.tfevents.*")},
                  key=lambda d: max(f.stat().st_mtime for f in d.glob("events.out.tfevents.*")))
    if not runs:
        raise RehearsalFailed(f"{tensorboard_dir}: no TensorBoard events; the run logged no step")
    events = EventAccumulator(str(runs[-1]), size_guidance={"scalars": 0})
    events.Reload()
    steps: dict[int, Step] = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            steps.setdefault(event.step, Step(event.step)).values[tag.removeprefix(PREFIX)] = event.value
    return [steps[s] for s in sorted(steps)]


def check(steps: list[Step], expected_steps: int, k: int, trains_head: bool, random_head: bool,
          measured: MeasuredTau | None = None) -> list[str]:
    """What is wrong with the logged steps (empty when the rehearsal passed).

    A native head must draft in every step about as well as the world's build measured it (`measured`, at
    this K): a step fails whose tau is below the build's by more than `MeasuredTau.margin` of its cycle
    count. A native head at a K the build did not measure is held to tau > 1 at the last step. A head that
    starts random is not held to tau > 1: on a peaked policy over 151,936 tokens a random head's
    samples are almost never accepted (the paper's Qwen3-4B run starts at the autoregressive floor, 1.00),
    and the first 3 steps of its learning-rate warm-up do not move it there. Its run must still draft,
    record and update the head finitely at every step.
    """
    problems = []
    if [s.step for s in steps] != list(range(1, expected_steps + 1)):
        problems.append(f"logged steps {[s.step for s in steps]}, expected 1..{expected_steps}")
    for s in steps:
        bad = sorted(key for key, value in s.values.items() if not math.isfinite(value))
        if bad:
            problems.append(f"step {s.step}: non-finite {bad}")
        if not math.isfinite(s.get("rollout/reward_mean")):
            problems.append(f"step {s.step}: no reward logged")
        if k and not s.get("growmtp/cycles") > 0:
            problems.append(f"step {s.step}: no drafting cycle recorded")
        if k and trains_head and s.get("growmtp/head_finite") != 1.0:
            problems.append(f"step {s.step}: the head update was skipped (non-finite head loss)")
    if k and not random_head and measured is not None:
        for s in steps:
            floor = measured.tau - measured.margin(s.get("growmtp/cycles"))
            if not s.get("growmtp/tau") >= floor:
                problems.append(f"step {s.step}: tau {s.get('growmtp/tau'):.3f} is below {floor:.3f}, the world's "
                                f"measured tau {measured.tau:.3f} at K={k} less "
                                f"{measured.margin(s.get('growmtp/cycles')):.3f} "
                                f"({MARGIN_STANDARD_ERRORS:g} standard errors at {s.get('growmtp/cycles'):.0f} cycles)")
    elif k and not random_head and steps and not steps[-1].get("growmtp/tau") > 1.0:
        problems.append(f"tau {steps[-1].get('growmtp/tau'):.3f} in the last step: no draft was ever accepted")
    return problems


def table(steps: list[Step], k: int) -> str:
    """One line per step: tau, alpha_1..K, reward, and the step's times."""
    lines = []
    for s in steps:
        parts = [f"step {s.step}:"]
        if k:
            alpha = " ".join(f"{s.get(f'growmtp/alpha_{i}'):.2f}" for i in range(1, k + 1))
            parts += [f"tau {s.get('growmtp/tau'):.3f}", f"alpha [{alpha}]", f"cycles {s.get('growmtp/cycles'):.0f}",
                      f"dropped {s.get('growmtp/dropped_cycles'):.0f}"]
        trained = "growmtp/head_loss" in s.values  # a frozen head is never updated: no head columns
        if trained:
            parts.append(f"head_loss {s.get('growmtp/head_loss'):.4f}")
        parts += [f"reward {s.get('rollout/reward_mean'):.3f}",
                  f"response_len {s.get('rollout/response_length_mean'):.0f}",
                  f"generation {s.get('timing/generation'):.1f}s", f"ppo_train {s.get('timing/ppo_train'):.1f}s"]
        if trained:
            parts.append(f"head_update {s.get('growmtp/head_update_s'):.1f}s")
        parts.append(f"step {s.get('timing/step_total'):.1f}s")
        lines.append(" ".join(parts))
    return "\n".join(lines)
