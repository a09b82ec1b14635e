"""Write OpenRLHF prompt jsonl (`{"id", "prompt", "label"}` rows) from a training set or a held-out benchmark.

    python -m openrlhf_growmtp.cli.prepare_data dapo-math /data/dapo-math-17k.parquet train/dapo.jsonl
    python -m openrlhf_growmtp.cli.prepare_data taco-verified /data/TACO-verified train/taco.jsonl --max-tests 20
    python -m openrlhf_growmtp.cli.prepare_data aime24 /data/aime_2024 eval/aime24.jsonl
    python -m openrlhf_growmtp.cli.prepare_data livecodebench /data/lcb/test6.jsonl eval/lcb.jsonl --platform atcoder

SOURCE is a local .parquet/.jsonl/.json file, a folder of them, a save_to_disk folder, or a hub id (needs
hub access). Train with `--data.prompt_dataset OUT.jsonl --data.input_key prompt --data.label_key label
--data.apply_chat_template`. Every row is converted before OUT is opened, so a bad source writes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from openrlhf_growmtp.data import loaders

DATASETS = ("dapo-math", "taco-verified", "amc23", "aime24", "aime25", "livecodebench")
MATH_BENCHMARKS = {"amc23": loaders.amc23_rows, "aime24": loaders.aime24_rows, "aime25": loaders.aime25_rows}


def convert(dataset: str, rows, args: argparse.Namespace) -> tuple[list[dict], dict | None]:
    """Rows of `dataset` in OpenRLHF's layout, and the converter's skip counts where it keeps them."""
    if dataset == "dapo-math":
        return loaders.dapo_math_rows(rows), None
    if dataset == "taco-verified":
        max_tests = loaders.DEFAULT_MAX_TESTS if args.max_tests is None else args.max_tests
        return loaders.taco_verified_rows(rows, max_tests=max_tests)
    if dataset == "livecodebench":
        return loaders.livecodebench_rows_and_stats(rows, platform=args.platform, max_tests=args.max_tests,
                                                    allow_pickled_str=args.read_pickled_tests)
    return MATH_BENCHMARKS[dataset](rows), None


class Counted:
    """An iterable that counts the rows drawn from it."""

    def __init__(self, rows):
        self.rows, self.count = rows, 0

    def __iter__(self):
        for row in self.rows:
            self.count += 1
            yield row


def write_jsonl(rows: list[dict], out: Path) -> None:
    """Write `rows` as JSON lines, through a temporary file renamed into place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, out)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(prog="prepare_data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dataset", choices=DATASETS)
    parser.add_argument("source", help="local file/folder, or a hub dataset id")
    parser.add_argument("out", type=Path, help="jsonl file to write")
    parser.add_argument("--split", default="train", help="split to read (default train)")
    parser.add_argument("--platform", choices=loaders.LCB_PLATFORMS, default=None,
                        help="livecodebench: keep this platform only")
    parser.add_argument("--max-tests", type=int, default=None,
                        help=f"tests kept per problem (taco-verified default {loaders.DEFAULT_MAX_TESTS}, "
                             f"livecodebench default all)")
    parser.add_argument("--read-pickled-tests", action="store_true",
                        help="livecodebench: read private tests shipped as a pickled string, parsing the pickle's "
                             "opcodes without unpickling (off: such problems keep their public tests only)")
    args = parser.parse_args(argv)
    if args.max_tests is not None and args.max_tests < 1:
        parser.error("--max-tests must be at least 1")
    if args.platform and args.dataset != "livecodebench":
        parser.error("--platform applies to livecodebench only")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        source_rows = Counted(loaders.iter_rows(args.source, args.split))
        rows, stats = convert(args.dataset, source_rows, args)
    except (loaders.RowFormatError, loaders.DataSourceError, ValueError) as err:
        print(f"prepare_data: {err}", file=sys.stderr)
        return 2
    write_jsonl(rows, args.out)
    print(f"{args.dataset}: read {source_rows.count} rows, wrote {len(rows)} rows to {args.out}")
    if stats is not None:
        print(f"{args.dataset}: " + ", ".join(f"{key}={value}" for key, value in stats.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
