"""The drafting-depth flags (`--growmtp_depth` and what goes with it) and their startup checks; the package
(`args/__init__.py`) registers them with the other `--growmtp_*` flags and runs the checks with its own."""

from __future__ import annotations

import math

DEPTH_MODES = ("fixed", "auto")


def add_depth_args(group, flag) -> None:
    """Register the depth flags on `group` (`flag(name, **kwargs)` registers both spellings of a valued flag)."""
    flag("depth", type=str, default="fixed", choices=DEPTH_MODES,
         help="fixed: every cycle drafts K tokens; auto: before each rollout the depth (1..K for a training head, "
              "0..K under --growmtp_mode frozen) with the "
              "highest predicted tokens per second, from the last rollout's acceptance and the engines' step times "
              "per depth (measured at the start, then the medians of recent rollouts' own steps; core/depth.py "
              "states the rule). Default: %(default)s")
    flag("cycle_costs", type=str, default=None,
         help="with --growmtp_depth auto: seconds of one engine step at each depth 0..K, comma-separated, instead "
              "of measuring them (the depth choices are then the same run after run)")
    group.add_argument("--growmtp_committed_loss", "--growmtp.committed_loss", dest="growmtp.committed_loss",
                       action="store_true", default=False,
                       help="with --growmtp_depth auto: a rollout drafted at depth d < K also trains the head's "
                            "positions d+1..K along the committed sequence (core/committed.py). Off by default: on "
                            "one seed it lowered the head's held-out acceptance at depth K (docs/depth.md)")
    group.add_argument("--growmtp_no_committed_loss", "--growmtp.no_committed_loss", dest="growmtp.committed_loss",
                       action="store_false",
                       help="positions past a rollout's depth learn only when drafted (the default)")


def cycle_costs(text: str | None) -> list[float] | None:
    """--growmtp_cycle_costs as seconds per depth 0..K (None where not given)."""
    return None if text is None else [float(part) for part in text.split(",")]


def check_depth(g: dict, k: int, async_train: bool) -> list[str]:
    """The depth flags' problems, for a run with K = k >= 1 (g: the growmtp options)."""
    if g.get("depth", "fixed") != "auto":  # argparse keeps it to DEPTH_MODES
        errors = [] if g.get("cycle_costs") is None else ["--growmtp_cycle_costs needs --growmtp_depth auto"]
        if g.get("committed_loss", False):
            errors.append("--growmtp_committed_loss needs --growmtp_depth auto (a fixed K drafts every position)")
        return errors
    errors = [] if not async_train else [
        "--growmtp_depth auto chooses each rollout's depth from the last one's acceptance: it needs the synchronous "
        "controller (not --train.async_enable)"]
    if g.get("committed_loss", False) and g.get("mode") == "joint":
        # joint mode's draft-path backward reaches the policy before the committed pass is scored: a non-finite
        # committed pass would skip the head's step with the policy's gradient already holding that share
        errors.append("--growmtp_committed_loss is not supported with --growmtp_mode joint (a non-finite committed "
                      "pass, scored after the draft paths' gradient reached the policy, could not take it back)")
    try:
        costs = cycle_costs(g.get("cycle_costs"))
    except ValueError:
        costs = []
    if costs is not None and (len(costs) != k + 1 or not all(0 < c < math.inf for c in costs)):
        errors.append(f"--growmtp_cycle_costs must be {k + 1} positive seconds (depths 0..{k}), comma-separated; "
                      f"got {g.get('cycle_costs')!r}")
    return errors
