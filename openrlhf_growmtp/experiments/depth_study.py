"""`make depth-study`: the drafting depth chosen each RL step (`--growmtp_depth auto`) against a fixed K and
against autoregressive decoding, in the speed world, seed by seed, side by side.

    python -m openrlhf_growmtp.experiments.depth_study --seeds 11 12 13      # 3 arms per seed
    python -m openrlhf_growmtp.experiments.depth_study --seeds 11 --arms ar fixed

Each arm is the project's training CLI on the speed world's full recipe (the demo's), with the seed given:
`ar` (`--growmtp_k 0`), `fixed` (`--growmtp_k K`) and `auto` (the same with `--growmtp_depth auto`). An arm
whose directory already holds its wall time is kept (so arms can run in separate invocations); `--redo`
runs it again. Writes runs/<name>/summary.json and table.md: per seed and arm, against the same seed's
autoregressive arm, the per-step time ratios over the first 30% of the steps, the largest after the first
step, `crossover_step`, `net_wall_ratio`, τ final and `rollout_speedup_last10`; and time.png, the step
times of every arm with the depth auto chose.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from dataclasses import replace
from pathlib import Path
from statistics import mean

from openrlhf_growmtp.experiments import report
from openrlhf_growmtp.experiments.demo import run_arm
from openrlhf_growmtp.experiments.recipes import WORLDS, train_command

ARMS = ("ar", "fixed", "auto")
EARLY_SHARE = 0.3  # "the first 30% of the steps"
WALL_FILE = "wall.json"


def arm_command(world, arm_dir: Path, preset, arm: str, reward: Path, seed: int) -> list[str]:
    cmd = train_command(world, arm_dir, preset, 0 if arm == "ar" else preset.k, reward, seed=seed)
    return cmd + (["--growmtp_depth", "auto"] if arm == "auto" else [])


def early_steps(steps: int) -> int:
    """How many steps "the first 30%" holds (at least 2: the first step is engine warm-up)."""
    return max(2, math.ceil(EARLY_SHARE * steps))


def compare(arm: list[dict], ar: list[dict], arm_wall: float, ar_wall: float) -> dict:
    """One arm against the same seed's autoregressive arm (report.summarize's definitions where it has them)."""
    theirs = {row["step"]: row["step_s"] for row in ar}
    ratios = [row["step_s"] / theirs[row["step"]] for row in arm if row["step"] in theirs]
    early = ratios[:early_steps(len(ratios))]
    out = {
        "step_ratio_first30_mean": mean(early[1:]),  # after the first step (engine warm-up), as report does
        "step_ratio_first30_max": max(early[1:]),
        "step_ratio_max_after_first": max(ratios[1:]),
        "steps_over_1_10_after_first": sum(r > 1.10 for r in ratios[1:]),
        "crossover_step": report.crossover_step(arm, ar),
        "net_wall_ratio": arm_wall / ar_wall,
        "rollout_speedup_last10": report.speedup_last(ar, arm, "rollout_s"),
        "step_speedup_last10": report.speedup_last(ar, arm, "step_s"),
        "reward_final": mean(row["reward"] for row in arm[-report.final_window(len(arm)):]),
    }
    if arm and "tau" in arm[0]:
        out["tau_final"] = mean(row["tau"] for row in arm[-report.final_window(len(arm)):])
        out["tau_first"] = arm[0]["tau"]
    if arm and "depth" in arm[0]:
        out["depths"] = [int(row["depth"]) for row in arm]
    return out


def table(summary: dict) -> str:
    heads = ("seed", "arm", "first 30% ratio (mean / max)", "max after step 1", "crossover", "net wall",
             "τ final", "rollout ×, last 10", "step ×, last 10", "reward")
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for seed, arms in summary["seeds"].items():
        for arm, c in arms.items():
            lines.append(f"| {seed} | {arm} | {c['step_ratio_first30_mean']:.3f} / {c['step_ratio_first30_max']:.3f} | "
                         f"{c['step_ratio_max_after_first']:.3f} | {c['crossover_step']} | {c['net_wall_ratio']:.3f} | "
                         f"{c.get('tau_final', 1.0):.2f} | {c['rollout_speedup_last10']:.3f} | "
                         f"{c['step_speedup_last10']:.3f} | {c['reward_final']:.3f} |")
    return "\n".join(lines)


def plot(out: Path, rows: dict) -> Path:
    """time.png: per seed, every arm's step time, and the depth auto chose (right axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(6 * len(rows), 4), squeeze=False)
    for ax, (seed, arms) in zip(axes[0], rows.items()):
        for i, (arm, arm_rows) in enumerate(arms.items()):
            ax.plot([r["step"] for r in arm_rows], [r["step_s"] for r in arm_rows], color=f"C{i}", label=arm)
        ax.set(title=f"seed {seed}: seconds per RL step", xlabel="RL step", ylabel="seconds", yscale="log")
        if "auto" in arms and arms["auto"] and "depth" in arms["auto"][0]:
            depth_ax = ax.twinx()
            depth_ax.step([r["step"] for r in arms["auto"]], [r["depth"] for r in arms["auto"]], where="mid",
                          color="grey", lw=0.8, ls=":", label="auto's depth")
            depth_ax.set(ylabel="depth drafted (auto)")
            depth_ax.legend(loc="lower right", fontsize="small")
        ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    path = out / "time.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m openrlhf_growmtp.experiments.depth_study", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", required=True)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--name", default="depth-study")
    parser.add_argument("--runs-dir", default="runs")
    parser.add_argument("--steps", type=int, help="RL steps per arm (default: the speed world's full recipe)")
    parser.add_argument("--quick", action="store_true", help="the speed world's quick recipe")
    parser.add_argument("--redo", action="store_true", help="run arms again that already finished")
    args = parser.parse_args(argv)

    demo = WORLDS["speed"]
    preset = demo.recipes["quick" if args.quick else "full"]
    if args.steps is not None:
        preset = replace(preset, steps=args.steps)
    out = Path(args.runs_dir) / args.name
    world = demo.build(Path(args.runs_dir) / ".cache")
    for seed in args.seeds:
        for arm in args.arms:
            arm_dir = out / f"seed{seed}" / arm
            if (arm_dir / WALL_FILE).exists() and not args.redo:
                continue
            if arm_dir.exists():
                shutil.rmtree(arm_dir)
            wall = run_arm(arm_command(world, arm_dir, preset, arm, demo.reward, seed), arm_dir,
                           f"seed {seed} {arm}", preset.steps)
            (arm_dir / WALL_FILE).write_text(json.dumps({"wall_s": wall}) + "\n")

    summary, rows = {"settings": {"steps": preset.steps, "k": preset.k, "seeds": args.seeds}, "seeds": {}}, {}
    for seed in args.seeds:
        arms = {arm: out / f"seed{seed}" / arm for arm in ARMS if (out / f"seed{seed}" / arm / WALL_FILE).exists()}
        if "ar" not in arms:
            continue
        rows[seed] = {arm: report.read_arm(d / "tensorboard", arm, 0 if arm == "ar" else preset.k)
                      for arm, d in arms.items()}
        walls = {arm: json.loads((d / WALL_FILE).read_text())["wall_s"] for arm, d in arms.items()}
        summary["seeds"][seed] = {arm: compare(rows[seed][arm], rows[seed]["ar"], walls[arm], walls["ar"])
                                  for arm in arms}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "table.md").write_text(table(summary) + "\n")
    if rows:
        plot(out, rows)
    print(table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
