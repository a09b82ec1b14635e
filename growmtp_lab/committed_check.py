"""A sanity check of the committed-sequence loss under `--growmtp_depth auto`, on one seed (not an evaluation).

    python -m growmtp_lab.committed_check --seed 7 --out docs/data/depth/committed_check.json

Three arms of the speed world's full recipe (the demo's), one after the other, with the seed given: `fixed`
(`--growmtp_k K`), `auto` (`--growmtp_depth auto`, the committed chains on) and `auto_nocl` (the same with
`--growmtp_no_committed_loss`). Afterwards each arm's final head drafts at depth K with its own final policy on
held-out prompts (lines past every prompt a run may read), so that every position's acceptance is measured,
drafted or not during the run. Writes runs/<name>/seed<N>/summary.json (and `--out`): per arm the commit it ran
at, the wall, the depth, τ and α_k of every step, `committed_alpha_k` where logged, and the held-out α_1..α_K
and τ at depth K. Arms already in that summary and not run again are kept.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the held-out engine runs in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from growmtp_lab import report  # noqa: E402
from growmtp_lab.demo import run_arm  # noqa: E402
from growmtp_lab.recipes import WORLDS, train_command  # noqa: E402

ARMS = {"fixed": [], "auto": ["--growmtp_depth", "auto", "--growmtp_committed_loss"],
        "auto_nocl": ["--growmtp_depth", "auto", "--growmtp_no_committed_loss"]}
PER_STEP = ("depth", "tau", "reward", "step_s", "rollout_s", "head_committed_loss")


def per_step(tensorboard: Path, k: int) -> list[dict]:
    """Each step's logged values: PER_STEP, alpha_k, head_alpha_k and committed_alpha_k (None where not logged)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(sorted(tensorboard.rglob("events.out.tfevents.*"))[-1].parent),
                              size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    read = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in tags}
    names = [f"growmtp/{n}" for n in PER_STEP] + [f"growmtp/{n}_{i}" for n in ("alpha", "head_alpha",
                                                                               "committed_alpha")
                                                   for i in range(1, k + 1)]
    steps = sorted(read.get("train/growmtp/tau", {}))
    return [{"step": s, **{n.split("/", 1)[1]: read.get(f"train/{n}", {}).get(s) for n in names}} for s in steps]


def held_out(final: Path, prompts: Path, skip: int, count: int, samples: int, k: int, topk: int,
             max_tokens: int, seed: int) -> dict:
    """α_1..α_K and τ of the final head drafting at depth K with its own final policy on prompts [skip, skip+count)."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from vllm_patches.engine import SpecEngine

    tokenizer = AutoTokenizer.from_pretrained(final)
    lines = prompts.read_text().splitlines()[skip:skip + count]
    ids = [tokenizer(json.loads(line)["input"], add_special_tokens=False)["input_ids"] for line in lines]
    engine = SpecEngine(final, final / "growmtp_head", k, capture=True, topk=topk, dtype="float32",
                        enforce_eager=True, max_model_len=256, max_num_seqs=16, seed=seed)
    try:
        summary = engine.generate([p for p in ids for _ in range(samples)],
                                  SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed)).metrics.acceptance
    finally:
        engine.close()
    return {"tau": summary.tau, "alpha": summary.alpha, "cycles": summary.cycles}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m growmtp_lab.committed_check",
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--steps", type=int, help="RL steps per arm (default: the full recipe's)")
    parser.add_argument("--name", default="committed-check")
    parser.add_argument("--runs-dir", default="runs")
    parser.add_argument("--eval-prompts", type=int, default=64)
    parser.add_argument("--out", type=Path, help="also write the summary here")
    args = parser.parse_args(argv)

    demo = WORLDS["speed"]
    preset = demo.recipes["full"]
    preset = preset if args.steps is None else replace(preset, steps=args.steps)
    out = Path(args.runs_dir) / args.name / f"seed{args.seed}"
    world = demo.build(Path(args.runs_dir) / ".cache")
    kept = json.loads((out / "summary.json").read_text())["arms"] if (out / "summary.json").exists() else {}
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    summary = {"kind": "sanity check on one seed, not the evaluation", "seed": args.seed, "steps": preset.steps,
               "k": preset.k, "world": world.info, "arms": kept,
               "command": " ".join(["python -m growmtp_lab.committed_check", *(argv or sys.argv[1:])]),
               "machine": f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
               "date": time.strftime("%Y-%m-%d")}
    for arm in args.arms:
        arm_dir = out / arm
        if arm_dir.exists():
            shutil.rmtree(arm_dir)
        cmd = train_command(world, arm_dir, preset, preset.k, demo.reward, seed=args.seed) + ARMS[arm]
        wall = run_arm(cmd, arm_dir, f"seed {args.seed} {arm}", preset.steps)
        rows = per_step(arm_dir / "tensorboard", preset.k)
        evaluation = held_out(arm_dir / "final", world.prompts, skip=preset.steps * preset.prompts_per_step,
                              count=args.eval_prompts, samples=preset.samples_per_prompt, k=preset.k,
                              topk=preset.topk, max_tokens=preset.max_new_tokens, seed=args.seed)
        summary["arms"][arm] = {"commit": commit, "command": summary["command"], "date": summary["date"],
                                "wall_s": wall, "flags": ARMS[arm], "held_out_at_k": evaluation,
                                "tau_final": tau_final(rows), "steps": rows}
        print(f"{arm}: wall {wall:.0f} s, held-out at depth {preset.k}: tau {evaluation['tau']:.3f}, alpha "
              f"[{' '.join(f'{a:.3f}' for a in evaluation['alpha'])}]", flush=True)
    text = json.dumps(summary, indent=1) + "\n"
    (out / "summary.json").write_text(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


def tau_final(rows: list[dict]) -> float:
    """τ over the run's last steps, as the demo's summary reads it (`report.final_window`)."""
    last = rows[-report.final_window(len(rows)):]
    return sum(row["tau"] for row in last) / len(last)


if __name__ == "__main__":
    sys.exit(main())
