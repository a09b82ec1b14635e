"""`make speed-study`: GrowMTP against autoregressive decoding over whole RL runs, replicated, in the speed world.

    python -m growmtp_lab.speed_study                   # the design below
    python -m growmtp_lab.speed_study --seeds 21 --repeat none --arms ar fixed  # a part of it
    python -m growmtp_lab.speed_study --keep docs/data/speed-study   # also the repository's record

The design, fixed before any of its runs:
- arms: `ar` (`--growmtp_k 0`, upstream's run), `fixed` (`--growmtp_k 3`) and `auto` (the same with
  `--growmtp_depth auto`), each the speed world's full recipe (the demo's: 50 RL steps) with the run's seed;
- runs: one per evaluation seed (`SEEDS`, none of them used while the code was built), plus the first seed run
  again (`REPEAT`) to show the run-to-run noise of identical settings;
- order: the arms of one run back to back, their order reversed from one run to the next (ABC, CBA, ...), so a
  slow drift of the machine weighs on every arm alike;
- checkpoints: every arm saves one every `CHECKPOINT_EVERY` steps; after a GrowMTP arm finishes, its checkpoints
  at `PAIRED_STEPS` get the paired rollout measurement (`growmtp_lab/paired.py`, 3 fresh measurement
  processes each), then are deleted;
- the machine: calibrated before every arm and after its measurements (`measure/calibration.py`).

Per run and arm, against the same run's `ar` arm: the net wall ratio (the whole arm: start-up, every step, the
final export), the same per generated token (each arm's wall over the tokens its rollouts generated: the arms'
policies diverge, and with them their response lengths), the per-step and per-token rollout ratios over the
first 30% and the last 30% of the steps, the cumulative crossover, τ final, and the paired speedups. Across runs:
each figure's mean over the evaluation seeds (a seed run twice counts once, as the mean of its runs) with its
Student-t 95% interval, the spread between the two runs of the repeated seed, the smallest difference the
design detects (`intervals.detectable_difference`: how large a difference a tie may hide), and the verdict
(`intervals.verdict`: below or above 1 where the interval excludes it, else a tie). Per run: the cumulative
wall of the RL steps, GrowMTP / autoregressive at every step (`cumulative.png`), its value at the end with a
batch-means interval over the steps (`intervals.batch_ratio_interval`), and the crossover.

The same module runs a single long run (`--steps 150 --seeds 42 --repeat none --arms ar fixed
--checkpoint-every 25 --paired-steps 25,50,75,100,125,150`): the design's numbers are its defaults.

An arm whose directory already holds `arm.json` is kept, so the study resumes where it stopped; a trained arm
(`trained.json`) is not trained again, and a measured checkpoint not measured again. `--stop-after-training`
ends after the next arm's training (a study cut into pieces). `--keep DIR` copies what the docs quote (every
arm's per-step rows and paired results, the summary, the provenance) to DIR.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from statistics import mean

from growmtp_lab import paired, report
from growmtp_lab.demo import run_arm
from growmtp_lab.recipes import WORLDS, train_command
from openrlhf_growmtp.measure.calibration import calibrate
from openrlhf_growmtp.measure.intervals import detectable_difference, mean_interval, sample_sd, verdict
from openrlhf_growmtp.measure.provenance import provenance

ARMS = ("ar", "fixed", "auto")
SEEDS = (21, 22, 23)
REPEAT = 21
CHECKPOINT_EVERY = 10
PAIRED_STEPS = (10, 50)  # as make demo's: early and final (fixed before the runs, for time: ~70 min in all)
PAIRS = 6
WINDOW_SHARE = 0.3  # "the first 30%" and "the last 30%" of the steps
ARM_FILE = "arm.json"
TRAINED_FILE = "trained.json"  # an arm trained, its checkpoints not all measured yet


@dataclass(frozen=True)
class Design:
    checkpoint_every: int = CHECKPOINT_EVERY
    paired_steps: tuple[int, ...] = PAIRED_STEPS
    pairs: int = PAIRS


def schedule(seeds: list[int], repeat: int | None, arms: list[str]) -> list[tuple[str, int, list[str]]]:
    """(run name, seed, arms in the order they run): the arms' order reversed from one run to the next."""
    runs = [(f"seed{seed}", seed) for seed in seeds]
    if repeat is not None:
        runs.append((f"seed{repeat}-repeat", repeat))
    return [(name, seed, list(arms) if i % 2 == 0 else list(arms)[::-1]) for i, (name, seed) in enumerate(runs)]


def arm_command(world, arm_dir: Path, preset, arm: str, reward: Path, seed: int,
                design: Design = Design()) -> list[str]:
    cmd = train_command(world, arm_dir, preset, 0 if arm == "ar" else preset.k, reward, seed=seed)
    cmd += paired.checkpoint_flags(design.checkpoint_every)
    return cmd + (["--growmtp_depth", "auto"] if arm == "auto" else [])


def window(rows: list[dict], share: float, last: bool) -> list[dict]:
    """The first (or last) `share` of the steps, at least 2; the first window leaves out step 1 (each engine's
    one-off warm-up)."""
    size = max(2, math.ceil(share * len(rows)))
    return rows[-size:] if last else rows[1:size]


def per_token(rows: list[dict], field: str, samples: int) -> float:
    """Seconds of `field` per generated token over `rows`."""
    return sum(r[field] for r in rows) / sum(report.tokens_per_step(rows, samples))


def compare(arm: dict, ar: dict, samples: int) -> dict:
    """One GrowMTP arm against the same run's autoregressive arm (GrowMTP / AR: below 1 is faster)."""
    rows, ar_rows = arm["rows"], ar["rows"]
    tokens, ar_tokens = (sum(report.tokens_per_step(r, samples)) for r in (rows, ar_rows))
    out = {
        "net_wall_ratio": arm["wall_s"] / ar["wall_s"],
        "net_wall_per_token_ratio": (arm["wall_s"] / tokens) / (ar["wall_s"] / ar_tokens),
        "crossover_step": report.crossover_step(rows, ar_rows),
        "tau_final": mean(r["tau"] for r in rows[-report.final_window(len(rows)):]),
        "reward_final": mean(r["reward"] for r in rows[-report.final_window(len(rows)):]),
        "reward_final_ar": mean(r["reward"] for r in ar_rows[-report.final_window(len(ar_rows)):]),
    }
    for name, last in (("early", False), ("late", True)):
        mine, theirs = window(rows, WINDOW_SHARE, last), window(ar_rows, WINDOW_SHARE, last)
        out[f"step_ratio_{name}"] = sum(r["step_s"] for r in mine) / sum(r["step_s"] for r in theirs)
        out[f"rollout_ratio_{name}"] = sum(r["rollout_s"] for r in mine) / sum(r["rollout_s"] for r in theirs)
        out[f"rollout_per_token_ratio_{name}"] = (per_token(mine, "rollout_s", samples)
                                                 / per_token(theirs, "rollout_s", samples))
    if "depth" in rows[0]:
        out["depths"] = [int(r["depth"]) for r in rows]
    out["paired"] = {str(p["step"]): p["speedup"] for p in arm.get("paired", [])}
    out["paired_tau"] = {str(p["step"]): p["tau"] for p in arm.get("paired", [])}
    out["paired_per_process"] = {str(p["step"]): p["speedup_per_process"] for p in arm.get("paired", [])
                                 if "speedup_per_process" in p}
    out["cumulative"] = report.cumulative(rows, ar_rows)
    return out


FIGURES = ("net_wall_ratio", "net_wall_per_token_ratio", "step_ratio_early", "step_ratio_late",
           "rollout_per_token_ratio_early", "rollout_per_token_ratio_late", "tau_final", "reward_final")


def across_runs(runs: dict[str, dict], seeds: dict[str, int], arm: str, design: Design = Design()) -> dict:
    """Each figure of `arm` over the evaluation seeds: per seed the mean of its runs, then the mean with its
    t interval, the detectable difference, and the repeated seed's two runs' difference."""
    out = {}
    figures = list(FIGURES) + [f"paired_{step}" for step in design.paired_steps]
    for figure in figures:
        per_seed: dict[int, list[float]] = {}
        for name, arms in runs.items():
            c = arms.get(arm)
            if c is None:
                continue
            value = c["paired"].get(figure[7:], {}).get("estimate") if figure.startswith("paired_") else c[figure]
            if value is not None:
                per_seed.setdefault(seeds[name], []).append(value)
        if not per_seed:
            continue
        values = [mean(v) for v in per_seed.values()]
        interval = mean_interval(values)
        repeats = [v for v in per_seed.values() if len(v) > 1]
        out[figure] = {**interval.as_dict(), "per_seed": {str(s): v for s, v in per_seed.items()},
                       "detectable": detectable_difference(sample_sd(values), len(values)) if len(values) > 1
                       else None,
                       "repeat_difference": abs(repeats[0][1] - repeats[0][0]) if repeats else None}
    return out


def summarize(out: Path, plan: list, preset, design: Design = Design()) -> dict:
    samples = preset.prompts_per_step * preset.samples_per_prompt
    runs, seeds = {}, {}
    for name, seed, arms in plan:
        kept = {arm: json.loads((out / name / arm / ARM_FILE).read_text()) for arm in arms
                if (out / name / arm / ARM_FILE).exists()}
        if "ar" not in kept:
            continue
        seeds[name] = seed
        runs[name] = {arm: compare(kept[arm], kept["ar"], samples) for arm in kept if arm != "ar"}
        runs[name]["_order"] = arms
        runs[name]["_wall_s"] = {arm: kept[arm]["wall_s"] for arm in kept}
    arms = sorted({arm for r in runs.values() for arm in r if not arm.startswith("_")}, key=ARMS.index)
    summary = {"design": {"seeds": sorted(set(seeds.values())), "runs": list(runs), "arms": list(ARMS),
                          "steps": preset.steps, "k": preset.k, "checkpoint_every": design.checkpoint_every,
                          "paired_steps": list(design.paired_steps), "pairs": design.pairs,
                          "paired_processes": paired.PROCESSES,
                          "paired_prompts": paired.PROMPTS, "paired_samples": paired.SAMPLES,
                          "recipe": asdict(preset)},
               "runs": runs, "across": {arm: across_runs({n: {a: c for a, c in r.items() if not a.startswith("_")}
                                                          for n, r in runs.items()}, seeds, arm, design)
                                        for arm in arms}}
    if {"fixed", "auto"} <= set(arms):
        ratios = {}
        for name, r in runs.items():
            if "fixed" in r and "auto" in r:
                ratios.setdefault(seeds[name], []).append(r["auto"]["net_wall_ratio"] / r["fixed"]["net_wall_ratio"])
        values = [mean(v) for v in ratios.values()]
        if values:
            summary["auto_over_fixed_net_wall"] = {
                **mean_interval(values).as_dict(),
                "detectable": detectable_difference(sample_sd(values), len(values)) if len(values) > 1 else None}
    return summary


def table(summary: dict) -> str:
    """The across-seeds table: per arm, each figure's mean with its interval, the detectable difference and the
    repeated seed's spread."""
    lines = ["| arm | figure | mean [95% interval] | per seed | detectable | repeat spread | verdict vs 1 |",
             "|---|---|---|---|---|---|---|"]
    for arm, figures in summary["across"].items():
        for name, f in figures.items():
            per_seed = ", ".join(f"{s}: {'/'.join(f'{v:.3f}' for v in vs)}" for s, vs in f["per_seed"].items())
            detect = f"{f['detectable']:.3f}" if f.get("detectable") is not None and math.isfinite(
                f["detectable"]) else "-"
            spread = f"{f['repeat_difference']:.3f}" if f.get("repeat_difference") is not None else "-"
            judged = verdict(f) if "ratio" in name or name.startswith("paired") else ""
            lines.append(f"| {arm} | {name} | {f['estimate']:.3f} [{f['low']:.3f}, {f['high']:.3f}] | {per_seed} | "
                         f"{detect} | {spread} | {judged} |")
    return "\n".join(lines)


def plot(out: Path, summary: dict, rows: dict) -> Path:
    """paired.png: per GrowMTP arm and run, the paired speedup at each checkpoint with its interval (left), and
    τ per RL step (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (run, arms) in enumerate(summary["runs"].items()):
        for j, arm in enumerate(a for a in ARMS if a in arms and a != "ar"):
            found = arms[arm]["paired"]
            steps = sorted(int(s) for s in found)
            estimate = [found[str(s)]["estimate"] for s in steps]
            error = [[found[str(s)]["estimate"] - found[str(s)]["low"] for s in steps],
                     [found[str(s)]["high"] - found[str(s)]["estimate"] for s in steps]]
            left.errorbar([s + 0.4 * i for s in steps], estimate, yerr=error, color=f"C{j}", marker="o", ms=3,
                          capsize=2, lw=0.8, label=arm if i == 0 else None)
            arm_rows = rows[run][arm]
            right.plot([r["step"] for r in arm_rows], [r["tau"] for r in arm_rows], color=f"C{j}", lw=0.8,
                       label=arm if i == 0 else None)
    left.axhline(1.0, color="grey", lw=0.8, ls=":")
    left.set(title="paired rollout speedup per generated token (median, 95% interval)", xlabel="checkpoint (RL step)",
             ylabel="autoregressive / speculative s per token")
    right.set(title="τ per RL step, every run", xlabel="RL step", ylabel="τ")
    return save_two_panels(fig, left, right, out / "paired.png")


def save_two_panels(fig, left, right, path: Path) -> Path:
    """A two-panel figure's legends, layout and file (closed after)."""
    import matplotlib.pyplot as plt

    left.legend(fontsize="small")
    right.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_cumulative(out: Path, summary: dict, rows: dict) -> Path:
    """cumulative.png: per run, each arm's cumulative RL-step wall (left) and GrowMTP / autoregressive of it at
    every step (right; below 1 the GrowMTP arm is ahead)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = {run: style for run, style in zip(summary["runs"], ("-", "--", ":", "-."))}
    for run, arms in summary["runs"].items():
        for j, arm in enumerate(a for a in ARMS if a in rows.get(run, {})):
            steps = [r["step"] for r in rows[run][arm]]
            totals = [sum(r["step_s"] for r in rows[run][arm][:i + 1]) for i in range(len(steps))]
            left.plot(steps, totals, color=f"C{j}", ls=styles.get(run, "-"), lw=0.9, label=f"{run} {arm}")
        for j, arm in enumerate(a for a in ARMS if a in arms and a != "ar" and not a.startswith("_")):
            c = arms[arm]["cumulative"]
            right.plot(c["steps"], c["ratio"], color=f"C{j + 1}", ls=styles.get(run, "-"), lw=0.9,
                       label=f"{run} {arm}")
            if c["crossover_step"] is not None:
                right.axvline(c["crossover_step"], color=f"C{j + 1}", lw=0.6, ls=":")
    right.axhline(1.0, color="grey", lw=0.8)
    left.set(title="cumulative wall of the RL steps", xlabel="RL step", ylabel="seconds")
    right.set(title="cumulative wall, GrowMTP / autoregressive (dotted: the crossover)", xlabel="RL step",
              ylabel="ratio")
    return save_two_panels(fig, left, right, out / "cumulative.png")


def run_study(out: Path, plan: list, preset, demo, world, design: Design = Design(), stop_after_training: bool = False,
              log=print) -> bool:
    """Every arm of `plan` not kept yet; returns False where it stopped after a training (`stop_after_training`)."""
    for name, seed, arms in plan:
        for arm in arms:
            arm_dir = out / name / arm
            if (arm_dir / ARM_FILE).exists():
                continue
            if not (arm_dir / TRAINED_FILE).exists():
                if arm_dir.exists():
                    shutil.rmtree(arm_dir)
                calibration = calibrate()
                cmd = arm_command(world, arm_dir, preset, arm, demo.reward, seed, design)
                wall = run_arm(cmd, arm_dir, f"{name} {arm}", preset.steps)
                rows = report.read_arm(arm_dir / "tensorboard", arm, 0 if arm == "ar" else preset.k)
                if len(rows) != preset.steps:
                    raise RuntimeError(f"{name} {arm} logged {len(rows)} steps, expected {preset.steps}")
                (arm_dir / TRAINED_FILE).write_text(json.dumps({
                    "wall_s": wall, "rows": rows, "calibration_before": calibration,
                    "engines": report.engine_facts(arm_dir / "train.log")}) + "\n")
                if stop_after_training:
                    log(f"{name} {arm}: trained; stopping here (--stop-after-training)")
                    return False
            trained = json.loads((arm_dir / TRAINED_FILE).read_text())
            results = []
            if arm != "ar":
                log(f"{name} {arm}: paired rollout measurement at steps {', '.join(map(str, design.paired_steps))}")
                plan_paired = paired.PairedPlan(steps=design.paired_steps, pairs=design.pairs,
                                                every=design.checkpoint_every)
                results = paired.measure_run(arm_dir, trained["rows"], world.prompts, preset, plan_paired, preset.k,
                                             log=log)
            shutil.rmtree(arm_dir / "ckpt", ignore_errors=True)  # the checkpoints: measured, and large
            (arm_dir / ARM_FILE).write_text(json.dumps(
                {"run": name, "seed": seed, "arm": arm, "order": arms.index(arm), "wall_s": trained["wall_s"],
                 "rows": trained["rows"], "paired": results, "command": (arm_dir / "command.txt").read_text().strip(),
                 "calibration_before": trained["calibration_before"], "engines": trained.get("engines"),
                 "provenance": provenance(calibrate=True)}, indent=1) + "\n")
    return True


def keep(out: Path, dest: Path, plan: list) -> None:
    """What the docs quote, into `dest`: the summary, the table, and every arm's file (its per-step rows)."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("summary.json", "table.md", "paired.png", "cumulative.png"):
        if (out / name).exists():
            shutil.copyfile(out / name, dest / name)
    for run, _, arms in plan:
        for arm in arms:
            source = out / run / arm / ARM_FILE
            if source.exists():
                (dest / run).mkdir(exist_ok=True)
                shutil.copyfile(source, dest / run / f"{arm}.json")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m growmtp_lab.speed_study", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--repeat", default=str(REPEAT), help="the seed run a second time, or 'none'")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--name", default="speed-study")
    parser.add_argument("--runs-dir", default="runs")
    parser.add_argument("--steps", type=int, help="RL steps per arm (default: the speed world's full recipe)")
    parser.add_argument("--checkpoint-every", type=int, default=CHECKPOINT_EVERY,
                        help="both arms save a checkpoint every N RL steps (default: %(default)s)")
    parser.add_argument("--paired-steps", default=",".join(map(str, PAIRED_STEPS)),
                        help="the checkpoints measured paired (default: %(default)s)")
    parser.add_argument("--stop-after-training", action="store_true",
                        help="stop after the next arm's training (its measurement resumes on the next call)")
    parser.add_argument("--summarize-only", action="store_true", help="no runs: the summary of those there are")
    parser.add_argument("--keep", type=Path, help="copy the summary and every arm's rows there (docs/data/...)")
    args = parser.parse_args(argv)
    if "ar" not in args.arms:
        parser.error("--arms needs ar: every figure is against the same run's autoregressive arm")
    repeat = None if args.repeat == "none" else int(args.repeat)
    if repeat is not None and repeat not in args.seeds:
        parser.error(f"--repeat {repeat} is not one of --seeds")
    try:
        design = Design(checkpoint_every=args.checkpoint_every, pairs=PAIRS,
                        paired_steps=tuple(sorted({int(v) for v in args.paired_steps.split(",") if v.strip()})))
    except ValueError:
        parser.error(f"--paired-steps {args.paired_steps}: comma-separated RL steps")

    demo = WORLDS["speed"]
    preset = demo.recipes["full"]
    if args.steps is not None:
        preset = replace(preset, steps=args.steps)
    if args.checkpoint_every < 1 or not design.paired_steps or any(
            step < 1 or step > preset.steps or step % design.checkpoint_every and step != preset.steps
            for step in design.paired_steps):
        parser.error(f"the paired checkpoints {design.paired_steps} need steps of at most {preset.steps}, each a "
                     f"multiple of --checkpoint-every {design.checkpoint_every} or the last")
    out = Path(args.runs_dir) / args.name
    plan = schedule(args.seeds, repeat, args.arms)
    if not args.summarize_only:
        world = demo.build(Path(args.runs_dir) / ".cache")
        if not run_study(out, plan, preset, demo, world, design, args.stop_after_training):
            return 0
    summary = summarize(out, plan, preset, design)
    summary["provenance"] = provenance()
    rows = {run: {arm: json.loads((out / run / arm / ARM_FILE).read_text())["rows"] for arm in arms
                  if (out / run / arm / ARM_FILE).exists()} for run, _, arms in plan}
    if summary["runs"]:
        plot(out, summary, rows)
        plot_cumulative(out, summary, rows)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "table.md").write_text(table(summary) + "\n")
    print(table(summary))
    if args.keep:
        keep(out, args.keep, plan)
        print(f"kept under {args.keep}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
