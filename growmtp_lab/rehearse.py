"""`python -m growmtp_lab.rehearse`: the two halves of `GROWMTP_REHEARSAL=1`
(examples/scripts/common.sh).

    rehearse world ROOT MODEL          build (once) the tiny stand-in for MODEL and the raw dataset rows;
                                       print the build's digest and its native head's measured tau
    rehearse report TB_DIR --steps N --k K [--frozen] [--random-head] [--world MODEL_DIR]
                                       print tau, alpha_k, reward and times per step; exit 1 unless the
                                       run logged steps 1..N, all finite, with a reward, and (K > 0) drafting
                                       cycles, a finite head update (unless frozen) and, for a native head,
                                       every step's tau within its margin of the tau the world's build
                                       measured at K (report.check)

An unknown preset exits 2 with the reason, before anything is built; a native head below its preset's
floor (Qwen3.5: tau 1.5 at K = 3) exits 1 with its measured tau.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rehearse", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    world = commands.add_parser("world")
    world.add_argument("root")
    world.add_argument("model")
    report = commands.add_parser("report")
    report.add_argument("tensorboard_dir")
    report.add_argument("--steps", type=int, required=True)
    report.add_argument("--k", type=int, required=True)
    report.add_argument("--frozen", action="store_true", help="the head is never updated (no head metrics)")
    report.add_argument("--random-head", action="store_true", help="the head started from random weights")
    report.add_argument("--world", help="the world's model directory: its native head's measured tau")
    args = parser.parse_args(argv)

    if args.command == "world":
        from growmtp_lab.rehearsal import world as world_module

        try:
            world_module.build(args.root, args.model)
        except world_module.UnsupportedPresetError as err:
            print(f"rehearsal: {err}", file=sys.stderr)
            return 2
        except world_module.WeakNativeHeadError as err:
            print(f"rehearsal world FAILED: {err}", file=sys.stderr)
            return 1
        print(world_module.describe(args.root, args.model))
        return 0

    from growmtp_lab.rehearsal import report as report_module

    try:
        steps = report_module.read_steps(args.tensorboard_dir)
    except report_module.RehearsalFailed as err:
        print(f"rehearsal FAILED: {err}", file=sys.stderr)
        return 1
    print(report_module.table(steps, args.k))
    measured = None
    if args.world and args.k and not args.random_head:
        measured = report_module.read_measured_tau(args.world, args.k)
        if measured is None:
            print(f"the world measured its native head at no K={args.k}: held to tau > 1 at the last step")
        else:
            print(f"the world's native head, measured at its build: tau {measured.tau:.3f} at K={args.k} over "
                  f"{measured.cycles} cycles; each step must reach tau - {report_module.MARGIN_STANDARD_ERRORS:g} "
                  f"standard errors at its cycle count")
    problems = report_module.check(steps, args.steps, args.k, trains_head=not args.frozen,
                                   random_head=args.random_head, measured=measured)
    if problems:
        print("rehearsal FAILED:\n  - " + "\n  - ".join(problems), file=sys.stderr)
        return 1
    print(f"rehearsal passed: {len(steps)} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
