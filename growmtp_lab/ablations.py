"""`make ablations`: the paper's ablations in the CPU worlds, every arm with the same seeds, data and GRPO settings.

    python -m growmtp_lab.ablations          # both worlds, 3 seeds; resumes where it stopped
    python -m growmtp_lab.ablations --quick  # a few steps per arm, one seed (the smoke test's run)

Worlds (`growmtp_lab.recipes.WORLDS`): `demo` (the demo's world), `paper` (the paper's proportions) and `reasoning`
(the real regime's statistics; not in the default `--worlds`). Arms
(`growmtp_lab.ablation_arms.ARMS`): GrowMTP (DCA + VGM), CE, KL, TV, DCA without VGM, teacher forcing, joint, a frozen
random head, and autoregressive; every arm under the paper's schedule (one head step per RL step). Each
run writes its result (`<world>/<arm>-s<seed>/result.json`) when it finishes, and a re-run skips the runs
that have one (`--fresh` starts over), so the whole can take several invocations. `--keep DIR` (with `--docs`:
docs/data/ablations/runs) also copies each finished run's result, and each world's ceiling and text statistics, to
DIR/<world's cache name>/, and an invocation restores from there what its runs directory lacks: committed with the
repository, the results carry over to a fresh checkout. A kept result made under other settings, arm flags or K
is not restored (that run goes again). Each result carries its world's digest (`World.digest`, the weights'
sha256) and DIR/<world>/builds.json lists every build's digest: a summary names the runs made on a build other
than this invocation's (`runs_on_other_builds`), whose numbers do not compare like for like. Runs are reproducible
(`--train.full_determinism_enable`) on one machine: the same seed gives the same numbers there, so the spread
is the seeds' (not across machines: two machines' builds of one world may differ, which the digests show).
After the demo world's arms: its ceiling (`growmtp_lab.ceiling`) and the one-step lag (`growmtp_lab.ablation_arms.lag`).
`--start ce_k1` starts every drafting arm from a pretrained head instead of the world's random one, as the paper's
objective ablations do (RQ3): the random head trained offline with CE at K=1 on the world's own policy
(`growmtp_lab.ceiling --k 1 --objective ce`, built once per world under the cache directory), at a third of the
recipe's head LR (the paper's 1e-4 for a pretrained head against 3e-4 for a random one). Its runs, kept
results and exports are named apart (`-from-ce_k1`), so they never mix with the random start's.
Outputs under runs/<name>/: per world and run the demo's files, `summary.json`, and per world `tau.png`,
`alpha.png`, `reward.png`; the export, ablations.json and ablations_<world>_<plot>.png, goes to runs/<name>/export/
(`--export DIR` elsewhere). `--docs` updates the repository's own record instead: ablations.json into
docs/data/ablations/, the plots into docs/figures/, and every result kept under docs/data/ablations/runs/.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from dataclasses import MISSING, asdict, fields, replace
from pathlib import Path

from growmtp_lab.demo import run_arm
from growmtp_lab import ablation_arms, report
from growmtp_lab.recipes import WORLDS, Recipe, train_command
from openrlhf_growmtp.core.objectives import ALPHA_ESTIMATES
from growmtp_lab.worlds.text_stats import world_text_statistics

SEEDS = {"full": (42, 43, 44), "quick": (42,)}
CEILING_QUICK = ("--rounds", "1", "--train-prompts", "32", "--eval-prompts", "32", "--epochs", "2")
STARTS = ("random", "ce_k1")  # the head every drafting arm starts from (module docstring)
# ce_k1's offline training, chosen for time alone before it ever ran: one round of 256 prompts x 4 samples (about
# 110k positions, each with the policy's top-k), 3 epochs of Adam at the ceiling's LR and batch; τ on 64 x 4
CE_K1 = ("--rounds", "1", "--train-prompts", "256", "--eval-prompts", "64", "--epochs", "3")
# --docs: the repository's record (the summary, the plots, every kept result)
DOCS_DATA, DOCS_FIGURES = Path("docs/data/ablations"), Path("docs/figures")
DOCS_KEEP = DOCS_DATA / "runs"


def run_world(name: str, args, out: Path, seeds: tuple[int, ...], arms: list[str]) -> dict:
    """Every arm and seed of one world (finished runs are read back, not run again); its summary."""
    spec = WORLDS[name]
    recipe = spec.recipes["quick" if args.quick else "full"]
    recipe = replace(recipe, steps=args.steps or recipe.steps)
    world = spec.build(args.cache_dir or Path(args.runs_dir) / ".cache")
    kept = args.keep / (world.root.name + _suffix(args.start, args.tag)) if args.keep else None
    world, recipe = start(args.start, world, recipe, kept, args.quick)  # the digest below covers the start's head
    recipe = replace(recipe, head_lr=args.head_lr or recipe.head_lr)
    extra = ("--growmtp_alpha_estimate", args.alpha_estimate) if args.alpha_estimate else ()
    digest = world.digest()
    config = json.loads((world.policy / "config.json").read_text())
    if args.draft_vocab_share:  # that share of this world's vocabulary
        extra += ("--growmtp_draft_vocab", str(max(1, int(args.draft_vocab_share * config["vocab_size"]))))
    facts = {"vocab_size": config["vocab_size"], "policy_layers": config["num_hidden_layers"]}
    if kept:
        note_build(kept / "builds.json", digest, facts)
    made_at = source_commit()
    rows: dict[str, dict[int, list[dict]]] = {arm: {} for arm in arms}
    wall: dict[str, dict[int, float]] = {arm: {} for arm in arms}
    failed: dict[str, dict[int, str]] = {}
    other_builds: list[str] = []  # runs made on another build of this world, or on one of unknown digest
    for seed in seeds:
        for arm in arms:
            arm_spec, run_dir = ablation_arms.ARMS[arm], out / name / f"{arm}-s{seed}"
            k = recipe.k if arm_spec.drafts else 0
            flags = list(arm_spec.flags) + (list(extra) if arm_spec.drafts else [])
            result = run_dir / "result.json"
            made_under = {"settings": asdict(recipe), "flags": flags, "k": k}
            restore(kept, f"{arm}-s{seed}.json", result, made_under)
            if not result.exists():
                if run_dir.exists():  # an unfinished run of an earlier invocation
                    shutil.rmtree(run_dir)
                cmd = train_command(world, run_dir, recipe, k, spec.reward, seed=seed,
                                    one_policy_step=arm_spec.one_policy_step) + flags
                try:  # one run's failure is reported (and fails the command) without losing the others
                    seconds = run_arm(cmd, run_dir, f"{name}: {arm} (seed {seed})", recipe.steps)
                    logged = report.read_arm(run_dir / "tensorboard", arm, k)
                    if len(logged) != recipe.steps:
                        raise RuntimeError(f"logged {len(logged)} steps, expected {recipe.steps}")
                except (RuntimeError, FileNotFoundError) as err:
                    failed.setdefault(arm, {})[seed] = str(err).splitlines()[0]
                    print(f"{name}: {arm} (seed {seed}) FAILED: {failed[arm][seed]}", flush=True)
                    continue
                report.write_metrics(run_dir / "metrics.jsonl", logged)
                # how it was made, beside what restore() compares: the seed, the code, the whole command (the
                # determinism flag included) and the α estimate in effect
                made_how = {"seed": seed, "commit": made_at, "command": [str(part) for part in cmd],
                            "full_determinism": "--train.full_determinism_enable" in cmd,
                            "alpha_estimate": (args.alpha_estimate or "residual") if arm_spec.drafts else None}
                result.write_text(json.dumps({"rows": logged, "wall_s": seconds, "world_digest": digest,
                                              **made_under, **made_how}) + "\n")
                keep(result, kept, f"{arm}-s{seed}.json")
            done = json.loads(result.read_text())
            rows[arm][seed], wall[arm][seed] = done["rows"], done["wall_s"]
            if done.get("world_digest") != digest:
                other_builds.append(f"{arm}-s{seed}")
    rows = {arm: by_seed for arm, by_seed in rows.items() if by_seed}
    per_seed = {arm: {seed: ablation_arms.seed_summary(runs, recipe.head_warmup_steps)
                      for seed, runs in by_seed.items()}
                for arm, by_seed in rows.items()}
    summary = {"k": recipe.k, **facts,
               "topk": recipe.topk, "topk_mass": ablation_arms.mean_topk_mass(rows.get(ablation_arms.REFERENCE, {})),
               "schedule": "rl_step", "start": args.start, "alpha_estimate": args.alpha_estimate or "residual",
               "seeds": list(seeds), "settings": asdict(recipe),
               "world": world.info,
               "sampled_text": _text_statistics(world, recipe, out / name, kept),
               "arms": {arm: {str(seed): s for seed, s in by_seed.items()} for arm, by_seed in per_seed.items()},
               "across_seeds": ablation_arms.compare(per_seed), "arm_wall_s": wall, "failed": failed,
               "world_digest": digest, "runs_on_other_builds": other_builds}
    if ablation_arms.REFERENCE in per_seed:
        summary["lag"] = {str(seed): s["lag"] for seed, s in per_seed[ablation_arms.REFERENCE].items() if "lag" in s}
    if name == "demo" and seeds[0] in rows.get(ablation_arms.REFERENCE, {}) and not args.no_ceiling:
        summary.update(_ceiling(world, out / name, seeds[0], recipe, per_seed, args.quick, kept))
    summary["plots"] = [str(p) for p in ablation_arms.plot(out / name, rows, recipe.k)]
    print(f"\n{name} world ({summary['policy_layers']} layers, V={summary['vocab_size']}, K={recipe.k}):")
    print(ablation_arms.table(per_seed, summary["across_seeds"]))
    return summary


def restore(kept_dir: Path | None, name: str, local: Path, made_under: dict | None = None) -> None:
    """Copy kept_dir/name to `local` where this invocation's runs directory lacks it. A run result, local or kept,
    counts only if it was made under `made_under` (its settings, arm flags and K): a local one made under others
    (another setting's run under the same --name) is removed, a kept one is left where it is; either way the run
    goes again. Nothing is copied without a keep directory."""
    if made_under is not None and local.exists() and not _made_under(local, made_under):
        print(f"{local}: made under other settings or flags; its run goes again", flush=True)
        local.unlink()
    kept = kept_dir / name if kept_dir else None
    if kept is None or local.exists() or not kept.exists():
        return
    if made_under is not None and not _made_under(kept, made_under):
        print(f"{kept}: made under other settings or flags; its run goes again", flush=True)
        return
    local.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(kept, local)


# a Recipe field added after a result was kept is read there as its default, which does what the recipe did
# before the field existed (max_num_seqs None: no --vllm.max_num_seqs, vLLM's own)
RECIPE_DEFAULTS = {f.name: f.default for f in fields(Recipe) if f.default is not MISSING}


def _made_under(result: Path, made_under: dict) -> bool:
    found = json.loads(result.read_text())
    if isinstance(found.get("settings"), dict):
        found["settings"] = {**{k: v for k, v in RECIPE_DEFAULTS.items() if k in made_under.get("settings", {})},
                             **found["settings"]}
    return {key: found.get(key) for key in made_under} == made_under


def note_build(builds: Path, digest: str, facts: dict) -> None:
    """Record in the keep directory that an invocation built this world with these weights (World.digest), and
    the world's facts (`vocab_size`, `policy_layers`) that exports read from here: runs kept by invocations on
    other machines compare only if the digests agree."""
    seen = json.loads(builds.read_text()) if builds.exists() else []
    entry = next((b for b in seen if b["digest"] == digest), None)
    if entry is None:
        entry = {"digest": digest, "first_seen": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        seen.append(entry)
    if any(entry.get(key) != value for key, value in facts.items()):
        entry.update(facts)
        builds.parent.mkdir(parents=True, exist_ok=True)
        builds.write_text(json.dumps(seen, indent=1) + "\n")


def world_facts(kept: Path) -> dict:
    """The facts every build kept under `kept` agrees on (`note_build`); {} where none is recorded."""
    builds = kept / "builds.json"
    seen = json.loads(builds.read_text()) if builds.exists() else []
    keys = {key for b in seen for key in b} - {"digest", "first_seen"}
    return {key: seen[0][key] for key in sorted(keys) if len({json.dumps(b.get(key)) for b in seen}) == 1}


def source_commit() -> str | None:
    """The checkout's commit, `+dirty` when tracked files differ from it; None outside a git checkout."""
    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    try:
        return git("rev-parse", "HEAD") + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return None


def keep(local: Path, kept_dir: Path | None, name: str) -> None:
    """Copy `local` to kept_dir/name (nothing without a keep directory)."""
    if kept_dir:
        kept_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(local, kept_dir / name)


def _text_statistics(world, recipe, out: Path, kept: Path | None) -> dict:
    cached = out / "sampled_text.json"
    restore(kept, cached.name, cached)
    if not cached.exists():
        cached.parent.mkdir(parents=True, exist_ok=True)
        stats = world_text_statistics(world.policy, world.prompts, recipe.topk,
                                      max_new_tokens=recipe.max_new_tokens)
        cached.write_text(json.dumps(stats) + "\n")
    if kept and not (kept / cached.name).exists():  # made by another setting's invocation under the same --name
        keep(cached, kept, cached.name)
    return json.loads(cached.read_text())


def _suffix(start: str, tag: str | None = None) -> str:
    """What names a setting's runs, kept results and exports apart: its start and its tag."""
    return ("" if start == "random" else f"-from-{start}") + (f"-{tag}" if tag else "")


def start(name: str, world, recipe, kept: Path | None, quick: bool):
    """The world and recipe the drafting arms run from: as they are (random), or (ce_k1) with the world's random
    head trained offline with CE at K=1 on the world's policy (growmtp_lab.ceiling), once per world under its cache
    directory, and a third of the head LR. The training's record is kept beside the runs (start_head.json)."""
    if name == "random":
        return world, recipe
    named = "head-ce_k1" + ("-quick" if quick else "")  # a quick build never stands in for the full one
    head, record = world.root / named, world.root / f"{named}.json"
    if not (head / "model.safetensors").exists():
        code = subprocess.run([sys.executable, "-m", "growmtp_lab.ceiling",
                               "--policy", str(world.policy), "--head", str(world.head),
                               "--prompts", str(world.prompts), "--k", "1",
                               "--objective", "ce", "--topk", str(recipe.topk),
                               "--max-tokens", str(recipe.max_new_tokens), "--out", str(record),
                               "--save-head", str(head), *(CEILING_QUICK if quick else CE_K1)]).returncode
        if code != 0 or not (head / "model.safetensors").exists():
            raise RuntimeError(f"the K=1 CE head for {world.root.name} was not built (growmtp_lab.ceiling exit {code}; "
                               "it saves a head only if training raised τ)")
    keep(record, kept, "start_head.json")
    return replace(world, head=head), replace(recipe, head_lr=f"{float(recipe.head_lr) / 3:g}")


def _ceiling(world, out: Path, seed: int, recipe, per_seed, quick: bool, kept: Path | None) -> dict:
    """The head trained offline to convergence for the first seed's final GrowMTP policy (growmtp_lab.ceiling)."""
    ceiling_file = out / "ceiling.json"
    restore(kept, ceiling_file.name, ceiling_file)
    if not ceiling_file.exists():
        reference = out / f"{ablation_arms.REFERENCE}-s{seed}" / "final"
        code = subprocess.run([sys.executable, "-m", "growmtp_lab.ceiling", "--policy", str(reference),
                               "--head", str(reference / "growmtp_head"), "--prompts", str(world.prompts),
                               "--k", str(recipe.k), "--topk", str(recipe.topk), "--out", str(ceiling_file),
                               *(CEILING_QUICK if quick else ())]).returncode
        if code != 0:
            return {"ceiling_failed": f"exit {code}"}
        keep(ceiling_file, kept, ceiling_file.name)
    ceiling = json.loads(ceiling_file.read_text())
    online = per_seed[ablation_arms.REFERENCE][seed]["tau_final"]
    return {"ceiling_tau": ceiling["ceiling_tau"], "ceiling": ceiling, "online_tau": online,
            "online_over_ceiling": online / ceiling["ceiling_tau"]}


def destinations(docs: bool, export: Path | None, keep: Path | None,
                 out: Path) -> tuple[Path, Path, Path | None]:
    """Where an invocation writes its summary and its plots, and keeps its results: the run directory's export/
    (both) and no keep directory unless told; the repository's docs/ only with `--docs`."""
    if docs:
        return DOCS_DATA, DOCS_FIGURES, DOCS_KEEP
    export = export or out / "export"
    return export, export, keep


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m growmtp_lab.ablations", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few steps per arm, one seed, a short ceiling")
    parser.add_argument("--worlds", default="demo,paper", help=f"comma-separated, of {', '.join(WORLDS)}")
    parser.add_argument("--arms", default=",".join(ablation_arms.PAPER_ARMS),
                        help=f"comma-separated arms (default: the paper's; also: "
                             f"{', '.join(a for a in ablation_arms.ARMS if a not in ablation_arms.PAPER_ARMS)})")
    parser.add_argument("--no-ceiling", action="store_true", help="skip the demo world's ceiling")
    parser.add_argument("--seeds", help="comma-separated --train.seed values (default 42,43,44; quick: 42)")
    parser.add_argument("--steps", type=int, help="RL steps per arm (overrides the recipe)")
    parser.add_argument("--start", choices=STARTS, default="random",
                        help="the head every drafting arm starts from (see above; default: %(default)s)")
    parser.add_argument("--head-lr", help="the drafting arms' peak head LR (overrides the recipe's and the start's)")
    parser.add_argument("--alpha-estimate", choices=ALPHA_ESTIMATES,
                        help="--growmtp_alpha_estimate for every drafting arm (default: the CLI's)")
    parser.add_argument("--draft-vocab-share", type=float,
                        help="--growmtp_draft_vocab for every drafting arm: this share of the world's vocabulary")
    parser.add_argument("--tag", help="names this setting's runs, kept results and exports apart (e.g. lr-5e-4); "
                                      "required with --head-lr, --alpha-estimate, --draft-vocab-share or --steps, "
                                      "so that runs of different settings never mix")
    parser.add_argument("--fresh", action="store_true", help="start over: forget the results of earlier invocations")
    parser.add_argument("--name", help="outputs go to <runs-dir>/<name>/ (default: ablations or ablations-quick)")
    parser.add_argument("--runs-dir", default="runs")
    parser.add_argument("--cache-dir", default=None, help="where the worlds are cached (default: <runs-dir>/.cache)")
    parser.add_argument("--export", type=Path, help="write ablations.json and the plots here "
                                                    "(default: <runs-dir>/<name>/export)")
    parser.add_argument("--keep", type=Path, help="keep each finished result here too, and resume from what is kept")
    parser.add_argument("--docs", action="store_true", help=f"update the repository's record: the summary into "
                                                            f"{DOCS_DATA}/, the plots into {DOCS_FIGURES}/, "
                                                            f"kept results under {DOCS_KEEP}/")
    args = parser.parse_args(argv)
    if args.docs and (args.export or args.keep):
        parser.error("--docs sets the export and keep directories itself: drop --export and --keep, or --docs")

    worlds = [w.strip() for w in args.worlds.split(",") if w.strip()]
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ablation_arms.ARMS] + [w for w in worlds if w not in WORLDS]
    if unknown or not arms or not worlds:
        parser.error(f"unknown world(s) or arm(s) {unknown}; worlds: {', '.join(WORLDS)}; "
                     f"arms: {', '.join(ablation_arms.ARMS)}")
    if args.steps is not None and args.steps < 2:
        parser.error("--steps must be at least 2")
    changed = args.head_lr or args.alpha_estimate or args.draft_vocab_share or args.steps
    if changed and not args.tag and not args.quick:
        parser.error("--head-lr, --alpha-estimate, --draft-vocab-share and --steps change a setting: name it with "
                     "--tag")
    if args.draft_vocab_share is not None and not 0 < args.draft_vocab_share <= 1:
        parser.error(f"--draft-vocab-share must be in (0, 1], got {args.draft_vocab_share}")
    if args.tag and not re.fullmatch(r"[A-Za-z0-9_.-]+", args.tag):
        parser.error(f"--tag {args.tag!r}: letters, digits, '.', '_' and '-' only (it names directories)")
    seeds = tuple(int(s) for s in args.seeds.split(",")) if args.seeds else SEEDS["quick" if args.quick else "full"]
    out = Path(args.runs_dir) / (args.name or ("ablations-quick" if args.quick else "ablations")
                                 + _suffix(args.start, args.tag))
    args.export, figures, args.keep = destinations(args.docs, args.export, args.keep, out)
    if args.fresh and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    doc = {"schedule": "rl_step", "start": args.start, "preset": "quick" if args.quick else "full", "worlds": {}}
    for name in worlds:
        doc["worlds"][name] = run_world(name, args, out, seeds, arms)
        doc["invocation_wall_s"] = time.perf_counter() - began
        ablation_arms.write_json(out / "summary.json", doc)
    args.export.mkdir(parents=True, exist_ok=True)
    figures.mkdir(parents=True, exist_ok=True)
    prefix = "ablations" + _suffix(args.start, args.tag).replace("-", "_").replace(".", "_")
    ablation_arms.write_json(args.export / f"{prefix}.json", doc)
    for name, world in doc["worlds"].items():
        for plot in world["plots"]:
            shutil.copyfile(plot, figures / f"{prefix}_{name}_{Path(plot).name}")
    failed = {name: w["failed"] for name, w in doc["worlds"].items() if w["failed"]}
    print(f"\nwrote {out}/summary.json and {args.export}/{prefix}.json in {(time.perf_counter() - began) / 60:.1f} min")
    if failed:
        print(f"FAILED runs: {failed} (their logs: {out}/<world>/<arm>-s<seed>/train.log)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
