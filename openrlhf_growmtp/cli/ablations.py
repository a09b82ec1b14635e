"""`make ablations`: the paper's ablations on the demo world, every arm with the same seed, data and GRPO settings.

    python -m openrlhf_growmtp.cli.ablations --export docs   # ~1 h on 2 cores: 9 arms x 2 seeds, ceiling, lag
    python -m openrlhf_growmtp.cli.ablations --quick         # a few steps per arm, one seed (the smoke test's run)

Arms (`openrlhf_growmtp.demo.ablations.ARMS`): GrowMTP (DCA + VGM, logging the lag), CE, KL, TV, DCA without
VGM, teacher forcing, joint, frozen random head, and the autoregressive baseline; on request (`--arms`), GrowMTP
with async training (`async`). Each arm is a run of the
demo's training command (`cli.demo.train_command`) with its flags added. After the arms:
- the ceiling (`openrlhf_growmtp.demo.ceiling`): the head trained offline to convergence for the first
  seed's final GrowMTP policy, τ on held-out prompts;
- the lag, from the GrowMTP arm's `growmtp/lag_alpha_k` (see `demo.ablations.lag`).
Outputs under runs/<name>/: per arm and seed the demo's files, `summary.json`, `tau.png`, `alpha.png`,
`reward.png`; `--export DIR` also writes DIR/ablations.json and the plots as DIR/ablations_<plot>.png.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from openrlhf_growmtp.cli.demo import PRESETS, TOPK, fresh_run_dir, run_arm, train_command
from openrlhf_growmtp.demo import ablations, report
from openrlhf_growmtp.demo.world import build_world


@dataclass(frozen=True)
class Plan:
    seeds: tuple[int, ...]
    ceiling_flags: tuple[str, ...] = ()


PLANS = {"full": Plan(seeds=(42, 43)),
         "quick": Plan(seeds=(42,), ceiling_flags=("--rounds", "1", "--train-prompts", "32", "--eval-prompts", "32",
                                                   "--epochs", "2"))}
QUICK_STEPS = 3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m openrlhf_growmtp.cli.ablations", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps per arm, one seed, a short ceiling")
    parser.add_argument("--arms", default=",".join(ablations.PAPER_ARMS),
                        help=f"comma-separated arms (default: the paper's; also: "
                             f"{', '.join(a for a in ablations.ARMS if a not in ablations.PAPER_ARMS)})")
    parser.add_argument("--no-ceiling", action="store_true", help="skip the ceiling (it runs when growmtp is an arm)")
    parser.add_argument("--seeds", help="comma-separated --train.seed values (default 42,43; quick: 42)")
    parser.add_argument("--steps", type=int, help="RL steps per arm (overrides the preset)")
    parser.add_argument("--name", help="outputs go to <runs-dir>/<name>/ (default: ablations or ablations-quick)")
    parser.add_argument("--runs-dir", default="runs")
    parser.add_argument("--cache-dir", default=None, help="where the world is cached (default: <runs-dir>/.cache)")
    parser.add_argument("--export", type=Path, help="also write ablations.json and the plots into this directory")
    args = parser.parse_args(argv)

    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ablations.ARMS]
    if unknown or not arms:
        parser.error(f"unknown arm(s) {unknown}; choose from {', '.join(ablations.ARMS)}")
    plan = PLANS["quick" if args.quick else "full"]
    seeds = tuple(int(s) for s in args.seeds.split(",")) if args.seeds else plan.seeds
    preset = PRESETS["quick" if args.quick else "full"]
    preset = replace(preset, steps=args.steps or (QUICK_STEPS if args.quick else preset.steps))
    if preset.steps < 2:
        parser.error("--steps must be at least 2")
    out = fresh_run_dir(Path(args.runs_dir) / (args.name or ("ablations-quick" if args.quick else "ablations")))
    began = time.perf_counter()

    world = build_world(args.cache_dir or Path(args.runs_dir) / ".cache")
    rows: dict[str, dict[int, list[dict]]] = {arm: {} for arm in arms}
    wall: dict[str, dict[int, float]] = {arm: {} for arm in arms}
    failed: dict[str, dict[int, str]] = {}
    for seed in seeds:
        for arm in arms:
            spec = ablations.ARMS[arm]
            k = preset.k if spec.drafts else 0
            arm_dir = out / f"{arm}-s{seed}"
            cmd = train_command(world, arm_dir, preset, k, seed=seed, one_policy_step=spec.one_policy_step)
            cmd += list(spec.flags)
            try:  # one arm's failure is reported (and fails the command) without losing the other arms
                wall[arm][seed] = run_arm(cmd, arm_dir, f"{arm} (seed {seed})", preset.steps)
                logged = report.read_arm(arm_dir / "tensorboard", arm, k)
                if len(logged) != preset.steps:
                    raise RuntimeError(f"logged {len(logged)} steps, expected {preset.steps}")
            except (RuntimeError, FileNotFoundError) as err:
                failed.setdefault(arm, {})[seed] = str(err).splitlines()[0]
                print(f"{arm} (seed {seed}) FAILED: {failed[arm][seed]}", flush=True)
                continue
            rows[arm][seed] = logged
            report.write_metrics(arm_dir / "metrics.jsonl", logged)
    rows = {arm: by_seed for arm, by_seed in rows.items() if by_seed}

    per_seed = {arm: {seed: ablations.seed_summary(runs, preset.head_warmup_steps) for seed, runs in by_seed.items()}
                for arm, by_seed in rows.items()}
    stats = ablations.compare(per_seed)
    extra = {"preset": "quick" if args.quick else "full", "settings": asdict(preset), "seeds": list(seeds),
             "world": world.info, "arm_wall_s": wall, "failed": failed}
    if "growmtp" in rows:
        extra["lag"] = {str(seed): summary["lag"] for seed, summary in per_seed["growmtp"].items()}
    if "growmtp" in rows and seeds[0] in rows["growmtp"] and not args.no_ceiling:
        reference = out / f"growmtp-s{seeds[0]}" / "final"
        ceiling_file = out / "ceiling.json"
        ceiling_began = time.perf_counter()
        code = subprocess.run([sys.executable, "-m", "openrlhf_growmtp.demo.ceiling", "--policy", str(reference),
                               "--head", str(reference / "growmtp_head"), "--prompts", str(world.prompts),
                               "--k", str(preset.k), "--topk", str(TOPK), "--out", str(ceiling_file),
                               *plan.ceiling_flags]).returncode
        if code == 0:
            ceiling = json.loads(ceiling_file.read_text())
            online = per_seed["growmtp"][seeds[0]]["tau_final"]
            extra.update(ceiling_tau=ceiling["ceiling_tau"], ceiling=ceiling, online_tau=online,
                         online_over_ceiling=online / ceiling["ceiling_tau"],
                         ceiling_wall_s=time.perf_counter() - ceiling_began)
        else:
            failed["ceiling"] = {seeds[0]: f"exit {code}"}
    extra["total_wall_s"] = time.perf_counter() - began
    ablations.write_json(out / "summary.json", per_seed, stats, extra)
    plots = ablations.plot(out, rows, preset.k)
    if args.export:
        ablations.write_json(args.export / "ablations.json", per_seed, stats, extra)
        for path in plots:
            shutil.copyfile(path, args.export / f"ablations_{path.name}")

    print()
    print(ablations.table(per_seed, stats))
    if "ceiling_tau" in extra:
        print(f"\nceiling τ {extra['ceiling_tau']:.3f} (online τ_final {extra['online_tau']:.3f}, "
              f"{100 * extra['online_over_ceiling']:.0f}% of it)")
    for seed, lag in extra.get("lag", {}).items():
        if lag["steps"]:
            print(f"lag (seed {seed}, {lag['steps']} steps): α on the trained-for policy "
                  f"[{' '.join(f'{a:.3f}' for a in lag['alpha_trained_policy'])}], on the next "
                  f"[{' '.join(f'{a:.3f}' for a in lag['alpha_next_policy'])}]")
    print(f"\nwrote {out}/summary.json and {', '.join(p.name for p in plots)} in {extra['total_wall_s'] / 60:.1f} min")
    if failed:
        print(f"FAILED arms: {failed} (their logs: {out}/<arm>-s<seed>/train.log)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
