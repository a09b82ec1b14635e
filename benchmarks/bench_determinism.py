"""What reproducibility costs, ingredient by ingredient (`openrlhf_growmtp/reproducibility.py`).

The toy demo world's GrowMTP arm (`--world demo`'s recipe, fewer RL steps) is run twice per configuration with
one seed; the configurations run one after another in one invocation, so their times compare:

  upstream      `--train.full_determinism_enable` as upstream's flag alone would set torch up: every new
                tensor filled, DeepSpeed's gradient bucket included
  ours          the flag as this project runs it (the default)
  none          without the flag
  -<name>       ours with that one ingredient switched off

Per configuration it prints, for each run the median over the RL steps after the first, and then the mean of
the two runs' medians, of: the rollout (generation),
the experience (the policy's log-probs of the samples), the policy's training (upstream's `ppo_train`
less the head's update), the head's update, the weight sync into the engine, and the whole RL step;
the step time as a ratio of `none`'s; and whether the two runs agree in every logged number (wall-clock
times aside) and every exported tensor (`make reproduce`'s comparison). One pair of runs that agrees
does not prove an ingredient unneeded (a rare difference may not show in two runs); a pair that differs
proves it needed.

    python -m benchmarks.bench_determinism [--steps 4] [--only ours,none] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from growmtp_lab.demo import fresh_run_dir, run_arm
from growmtp_lab.recipes import WORLDS, train_command
from growmtp_lab.reproduce import compare_exports, compare_scalars, logged_scalars
from openrlhf_growmtp.reproducibility import INGREDIENTS, OVERRIDE_ENV

DETERMINISM_FLAG = "--train.full_determinism_enable"
# (label, whether the run has the flag, $GROWMTP_DETERMINISM)
CONFIGS = [("upstream", True, "fill_gradient_bucket=1"), ("ours", True, ""), ("none", False, "")] + [
    (f"-{name}", True, f"{name}=0") for name in INGREDIENTS if name != "fill_gradient_bucket"]
# (column, how it is read from the run's TensorBoard scalars at one step)
PHASES = [
    ("rollout", lambda s: s["train/growmtp/rollout_s"]),
    ("experience", lambda s: s["train/timing/make_experience"]),
    ("policy", lambda s: s["train/timing/ppo_train"] - s["train/growmtp/head_update_s"]),
    ("head", lambda s: s["train/growmtp/head_update_s"]),
    ("sync", lambda s: s["train/timing/broadcast"]),
    ("step", lambda s: s["train/growmtp/step_s"]),
]


def phase_medians(scalars: dict[str, dict[int, float]]) -> dict[str, float]:
    """Each phase's median over the RL steps after the first (the first also warms every cache up)."""
    steps = sorted(scalars["train/growmtp/rollout_s"])[1:]
    at = lambda step: {tag: values[step] for tag, values in scalars.items() if step in values}  # noqa: E731
    return {name: statistics.median(read(at(step)) for step in steps) for name, read in PHASES}


def run_config(world, out: Path, label: str, flag: bool, override: str, steps: int) -> dict:
    demo = WORLDS["demo"]
    recipe = replace(demo.recipes["full"], steps=steps)
    runs = [out / f"{label}-{n}" for n in (1, 2)]
    saved = os.environ.get(OVERRIDE_ENV)
    os.environ[OVERRIDE_ENV] = override  # every process of the run reads it (Ray workers inherit it)
    try:
        for n, run_dir in enumerate(runs, start=1):
            cmd = train_command(world, run_dir, recipe, recipe.k, demo.reward)
            if not flag:
                cmd.remove(DETERMINISM_FLAG)
            run_arm(cmd, run_dir, f"{label} run {n}", steps)
    finally:
        if saved is None:
            os.environ.pop(OVERRIDE_ENV, None)
        else:
            os.environ[OVERRIDE_ENV] = saved
    scalars = [logged_scalars(run / "tensorboard") for run in runs]
    numbers, number_diffs = compare_scalars(*scalars)
    tensors, tensor_diffs = compare_exports(*(run / "final" for run in runs))
    per_run = [phase_medians(s) for s in scalars]
    phases = {name: statistics.mean(run[name] for run in per_run) for name, _ in PHASES}
    return {"label": label, "flag": flag, "override": override, "seconds": phases,
            "agree": not (number_diffs or tensor_diffs), "numbers": numbers, "tensors": tensors,
            "differences": number_diffs + tensor_diffs}


def table(rows: list[dict]) -> str:
    none = next((row for row in rows if row["label"] == "none"), None)
    head = f"{'configuration':<28}" + "".join(f"{name:>11}" for name, _ in PHASES) + f"{'x none':>8}  two runs agree"
    lines = [head, "-" * len(head)]
    for row in rows:
        ratio = row["seconds"]["step"] / none["seconds"]["step"] if none else float("nan")
        agree = "yes" if row["agree"] else f"NO ({len(row['differences'])} differ)"
        lines.append(f"{row['label']:<28}" + "".join(f"{row['seconds'][name]:>10.2f}s" for name, _ in PHASES)
                     + f"{ratio:>7.2f}x  {agree}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="RL steps per run (the first is not timed)")
    parser.add_argument("--only", help="comma-separated configuration labels (default: all)")
    parser.add_argument("--runs-dir", default="runs/bench_determinism")
    parser.add_argument("--cache-dir", default="runs/.cache", help="where the toy demo world is cached")
    parser.add_argument("--json", action="store_true", help="print the results as JSON on the last line")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first RL step is not timed")
    chosen = [c for c in CONFIGS if not args.only or c[0] in args.only.split(",")]
    unknown = set(args.only.split(",")) - {c[0] for c in CONFIGS} if args.only else set()
    if unknown or not chosen:
        parser.error(f"--only: unknown {sorted(unknown)}; the configurations are {[c[0] for c in CONFIGS]}")
    out, world = Path(args.runs_dir), WORLDS["demo"].build(Path(args.cache_dir))
    rows = [run_config(world, fresh_run_dir(out / label), label, flag, override, args.steps)
            for label, flag, override in chosen]
    print(table(rows))
    for row in rows:
        for line in row["differences"]:
            print(f"  {row['label']}: {line}")
    if args.json:
        print(json.dumps({"steps": args.steps, "configs": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
