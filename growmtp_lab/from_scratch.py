"""The from-scratch study (docs/from_scratch.md): its settings, the runs still to make, and its export.

Every setting is a set of runs of `make ablations`' driver (`growmtp_lab.ablations`), kept under
runs/from_scratch/kept/ (with `--docs`: with the repository's other runs under docs/data/ablations/runs/) and
resumable as they are. Settings, seeds and the decision rule are the ones
docs/from_scratch.md fixed before any run; two settings add seeds only on a condition stated there, which
`runs` evaluates on the kept results of the seed before.

    python -m growmtp_lab.from_scratch next      # the driver command of the next run to make
    python -m growmtp_lab.from_scratch export    # runs/from_scratch/export/from_scratch.json
    python -m growmtp_lab.from_scratch export --docs   # docs/data/from_scratch/from_scratch.json

`make from-scratch` makes every run in turn, then exports (`make from-scratch ARGS=--docs`: the repository's).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from statistics import mean

from growmtp_lab import ablation_arms
from growmtp_lab.ablations import DOCS_KEEP, world_facts
from growmtp_lab.recipes import WORLDS

KEEP = Path("runs/from_scratch/kept")
OUT = Path("runs/from_scratch/export/from_scratch.json")
DOCS_OUT = Path("docs/data/from_scratch/from_scratch.json")  # --docs: the repository's record (and ablations.DOCS_KEEP)
# the estimate bench_alpha_estimate.py's rule chose for paper/unbiased-alpha (docs/from_scratch.md): mean |gap| at
# the first draft position over the random and the K = 1 CE head at top-64, residual 0.053 against topk 0.071
UNBIASED_ALPHA = "residual"
WORLD_PREFIX = {"demo": "world", "paper": "paper", "reasoning": "reasoning"}  # cache directory names
# the decision rule's margins (docs/from_scratch.md): never more than this below DCA + VGM ...
NOT_BELOW = 0.02
# ... and, on every seed of at least one world, more than this above it
ABOVE = 0.04


@dataclass(frozen=True)
class Setting:
    world: str
    arms: tuple[str, ...]
    seeds: tuple[int, ...]
    start: str = "random"
    tag: str | None = None
    head_lr: str | None = None
    alpha_estimate: str | None = None
    steps: int | None = None
    more_seeds: tuple[int, ...] = ()  # run only where `wants_more_seeds` holds after `seeds`
    condition: str = ""  # which test decides `more_seeds`: "order" (vs the 1.5e-3 runs) or "horizon"


SETTINGS = {  # in the order `next` makes their runs: the new world's first (the regime the question is about),
    # then the table's order in docs/from_scratch.md; a setting with a condition after what the condition reads
    # its arms in the order that answers the question soonest: the default, CE and the hybrid first
    "reasoning": Setting("reasoning", ("growmtp", "ce", "hybrid", "tv", "dca_no_vgm", "ar"), (42, 43, 44)),
    "paper/unbiased-alpha": Setting("paper", ("growmtp", "ce", "hybrid"), (42, 43, 44), tag=f"alpha-{UNBIASED_ALPHA}",
                                    alpha_estimate=UNBIASED_ALPHA),
    "paper/lr-5e-4": Setting("paper", ("growmtp", "ce"), (42,), tag="lr-5e-4", head_lr="5e-4", more_seeds=(43, 44),
                             condition="order"),
    "reasoning/120-steps": Setting("reasoning", ("growmtp", "ce", "hybrid"), (42,), tag="120-steps", steps=120,
                                   more_seeds=(43, 44), condition="horizon"),
    "demo/held-out": Setting("demo", ("growmtp", "hybrid"), (45, 46, 47)),
    "paper/held-out": Setting("paper", ("growmtp", "hybrid"), (45, 46, 47)),
    "reasoning/held-out": Setting("reasoning", ("growmtp", "hybrid"), (45, 46, 47)),
    "paper/from-ce_k1/held-out": Setting("paper", ("growmtp", "hybrid"), (45, 46, 47), start="ce_k1"),
}


def kept_dir(setting: Setting, keep: Path = KEEP) -> Path | None:
    """The keep directory of the setting's world build (the one directory whose name fits)."""
    suffix = ("" if setting.start == "random" else f"-from-{setting.start}")
    suffix += f"-{setting.tag}" if setting.tag else ""
    pattern = re.compile(rf"{WORLD_PREFIX[setting.world]}-[0-9a-f]{{12}}{re.escape(suffix)}")
    found = sorted(p for p in keep.glob(f"{WORLD_PREFIX[setting.world]}-*") if pattern.fullmatch(p.name))
    if len(found) > 1:
        raise RuntimeError(f"{len(found)} builds of the {setting.world} world kept under {keep}: {found}")
    return found[0] if found else None


def seed_result(setting: Setting, arm: str, seed: int, keep: Path = KEEP) -> dict | None:
    """The kept run's `ablation_arms.seed_summary`, or None where it has not run."""
    folder = kept_dir(setting, keep)
    path = folder / f"{arm}-s{seed}.json" if folder else None
    if path is None or not path.exists():
        return None
    warmup = WORLDS[setting.world].recipes["full"].head_warmup_steps
    return ablation_arms.seed_summary(json.loads(path.read_text())["rows"], warmup)


def _tau_over(setting: Setting, arm: str, seed: int, steps: range, keep: Path) -> float:
    rows = json.loads((kept_dir(setting, keep) / f"{arm}-s{seed}.json").read_text())["rows"]
    return mean(r["tau"] for r in rows if r["step"] in steps)


def _order(taus: dict[str, float]) -> list[str]:
    return sorted(taus, key=taus.get, reverse=True)


def wants_more_seeds(setting: Setting, keep: Path = KEEP) -> bool | None:
    """The condition of docs/from_scratch.md on the first seed's runs; None until they are all kept."""
    seed = setting.seeds[0]
    if any(seed_result(setting, arm, seed, keep) is None for arm in setting.arms):
        return None
    if setting.condition == "order":  # against the same arms at the recipe's head LR (the original ablations)
        baseline = Setting(setting.world, setting.arms, setting.seeds)
        if any(seed_result(baseline, arm, seed, keep) is None for arm in setting.arms):
            return None
        here = {arm: seed_result(setting, arm, seed, keep)["tau_final"] for arm in setting.arms}
        there = {arm: seed_result(baseline, arm, seed, keep)["tau_final"] for arm in setting.arms}
        return _order(here) != _order(there)
    if setting.condition == "horizon":  # the same runs' order over steps 36-40 and over their last 5
        steps = setting.steps or WORLDS[setting.world].recipes["full"].steps
        early = {arm: _tau_over(setting, arm, seed, range(36, 41), keep) for arm in setting.arms}
        late = {arm: _tau_over(setting, arm, seed, range(steps - 4, steps + 1), keep) for arm in setting.arms}
        return _order(early) != _order(late)
    raise ValueError(f"unknown condition {setting.condition!r}")


def runs(setting: Setting, keep: Path = KEEP) -> list[tuple[str, int]]:
    """(arm, seed) of every run the setting makes, as far as its conditions are decided."""
    seeds = list(setting.seeds)
    if setting.more_seeds and wants_more_seeds(setting, keep):
        seeds += setting.more_seeds
    return [(arm, seed) for seed in seeds for arm in setting.arms]


def command(setting: Setting, arm: str, seed: int, keep: Path = KEEP) -> list[str]:
    """The driver command that makes (or reads back) one run of the setting."""
    cmd = [sys.executable, "-m", "growmtp_lab.ablations", "--worlds", setting.world, "--arms", arm,
           "--seeds", str(seed), "--start", setting.start, "--keep", str(keep), "--no-ceiling",
           "--name", "from_scratch"]
    for flag, value in (("--tag", setting.tag), ("--head-lr", setting.head_lr),
                        ("--alpha-estimate", setting.alpha_estimate), ("--steps", setting.steps)):
        if value is not None:
            cmd += [flag, str(value)]
    return cmd


def missing_runs(keep: Path = KEEP) -> list[tuple[str, str, int]]:
    """(setting, arm, seed) of every run not kept yet, in the order `next` makes them (a setting whose condition
    is undecided lists its first seeds' runs)."""
    return [(name, arm, seed) for name, setting in SETTINGS.items() for arm, seed in runs(setting, keep)
            if seed_result(setting, arm, seed, keep) is None]


def next_command(keep: Path = KEEP) -> list[str] | None:
    missing = missing_runs(keep)
    if not missing:
        return None
    name, arm, seed = missing[0]
    return command(SETTINGS[name], arm, seed, keep)


def export(keep: Path = KEEP) -> dict:
    """docs/from_scratch.json's document: per setting, the world's statistics and every arm's τ and α gap."""
    worlds = {}
    for name, setting in SETTINGS.items():
        folder = kept_dir(setting, keep)
        recipe = WORLDS[setting.world].recipes["full"]
        text = json.loads((folder / "sampled_text.json").read_text()) if folder and (
            folder / "sampled_text.json").exists() else {}
        arms = {}
        for arm, seed in runs(setting, keep):
            result = seed_result(setting, arm, seed, keep)
            if result is None or "tau_final" not in result:
                continue
            entry = arms.setdefault(arm, {"tau_final": {}, "alpha_gap": {}})
            entry["tau_final"][str(seed)] = result["tau_final"]
            if "alpha_gap_final" in result:
                entry["alpha_gap"][str(seed)] = result["alpha_gap_final"]
        head_lr = setting.head_lr or (f"{float(recipe.head_lr) / 3:g}" if setting.start == "ce_k1" else recipe.head_lr)
        facts = world_facts(folder) if folder else {}  # what the kept builds recorded, not a cache
        worlds[name] = {"k": recipe.k, "vocab_size": facts.get("vocab_size"),
                        "policy_layers": facts.get("policy_layers"),
                        "topk_mass": text.get(f"top{recipe.topk}_mass"), "entropy_nats": text.get("entropy_nats"),
                        "alpha_estimate": setting.alpha_estimate or "residual", "start": setting.start,
                        "head_lr": float(head_lr), "steps": setting.steps or recipe.steps,
                        "seeds": sorted({seed for _, seed in runs(setting, keep)}), "arms": arms}
    missing = missing_runs(keep)
    # the rule reads every seed of every setting: until all are kept the default stays dca, decided only where
    # a kept seed already has the hybrid more than NOT_BELOW below DCA + VGM (no later run can undo that)
    decided = not missing or min(_differences(worlds), default=0.0) < -NOT_BELOW
    return {"worlds": worlds, "default": "dca" if missing else decide(worlds), "decided": decided,
            "runs_missing": len(missing)}


def decide(worlds: dict) -> str:
    """The rule of docs/from_scratch.md: `hybrid` only if it is never more than NOT_BELOW below DCA + VGM on
    any seed of any setting where both ran, and more than ABOVE above it on every seed of at least one world."""
    differences = _differences_by_world(worlds)
    every = [d for per_world in differences.values() for d in per_world]
    if every and min(every) >= -NOT_BELOW and any(min(per_world) > ABOVE for per_world in differences.values()):
        return "hybrid"
    return "dca"


def _differences_by_world(worlds: dict) -> dict[str, list[float]]:
    """Per world: hybrid minus DCA + VGM in τ final, every seed of every setting where both ran."""
    differences: dict[str, list[float]] = {}
    for name, setting in worlds.items():
        arms = setting["arms"]
        if "hybrid" not in arms or "growmtp" not in arms:
            continue
        for seed, tau in arms["hybrid"]["tau_final"].items():
            if seed in arms["growmtp"]["tau_final"]:
                differences.setdefault(name.split("/")[0], []).append(tau - arms["growmtp"]["tau_final"][seed])
    return differences


def _differences(worlds: dict) -> list[float]:
    return [d for per_world in _differences_by_world(worlds).values() for d in per_world]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m growmtp_lab.from_scratch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("next", "export"))
    parser.add_argument("--keep", type=Path, help=f"where the runs are kept (default {KEEP})")
    parser.add_argument("--out", type=Path, help=f"the export (default {OUT})")
    parser.add_argument("--docs", action="store_true", help=f"the repository's record: --keep {DOCS_KEEP} "
                                                            f"--out {DOCS_OUT}")
    args = parser.parse_args(argv)
    if args.docs and (args.keep or args.out):
        parser.error("--docs sets --keep and --out itself: drop them, or --docs")
    args.keep = DOCS_KEEP if args.docs else args.keep or KEEP
    args.out = DOCS_OUT if args.docs else args.out or OUT
    if args.what == "next":
        cmd = next_command(args.keep)
        if cmd is not None:
            print(" ".join(cmd))
        return 0
    doc = export(args.keep)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    for name, world in doc["worlds"].items():
        print(f"{name}: " + ", ".join(f"{arm} " + " ".join(f"{tau:.3f}" for tau in entry["tau_final"].values())
                                      for arm, entry in world["arms"].items()))
    print(f"default: {doc['default']}" + ("" if doc["decided"] else
                                          f" (undecided: {doc['runs_missing']} runs not made yet)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
