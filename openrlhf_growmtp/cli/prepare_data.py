"""Write OpenRLHF prompt jsonl (`{"id", "prompt", "label"}` rows) from a training set or a held-out benchmark.

    python -m openrlhf_growmtp.cli.prepare_data dapo-math /data/dapo-math-17k.parquet train/dapo.jsonl
    python -m openrlhf_growmtp.cli.prepare_data taco-verified /data/TACO-verified train/taco.jsonl --max-tests 20
    python -m openrlhf_growmtp.cli.prepare_data aime24 /data/aime_2024 eval/aime24.jsonl
    python -m openrlhf_growmtp.cli.prepare_data livecodebench /data/lcb/test6.jsonl eval/lcb.jsonl --platform atcoder
    python -m openrlhf_growmtp.cli.prepare_data livecodebench /data/lcb/test6.jsonl eval/lcb_leetcode.jsonl \
        --platform leetcode    # call-based rows: the label names the function to call
    python -m openrlhf_growmtp.cli.prepare_data dapo-math /data/dapo.parquet train/dapo.qwen3_4b.jsonl \
        --max-prompt-tokens 1024 --tokenizer /models/Qwen3-4B

SOURCE is a local .parquet/.jsonl/.json file, a folder of them, a save_to_disk folder, or a hub id (needs
hub access). Train with `--data.prompt_dataset OUT.jsonl --data.input_key prompt --data.label_key label
--data.apply_chat_template`. Every row is converted before OUT is opened, so a bad source writes nothing.
With --max-prompt-tokens N --tokenizer MODEL, rows whose chat-rendered prompt is longer than N tokens of
MODEL's tokenizer are dropped (not cut: a cut statement is a different, usually unsolvable problem), so the
file is per model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from openrlhf_growmtp.data import loaders, sources

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


def load_chat_tokenizer(path: str):
    """The tokenizer at `path`; raises ValueError naming `path` when it cannot be loaded or has no chat template."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
    except Exception as err:  # a missing folder, no hub access, a broken tokenizer file: all mean "check --tokenizer"
        raise ValueError(f"could not load the tokenizer {path!r}: {type(err).__name__}: {err}") from err
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer {path!r} has no chat template, which --data.apply_chat_template needs")
    return tokenizer


def drop_long_prompts(rows: list[dict], tokenizer, max_prompt_tokens: int) -> tuple[list[dict], int, int]:
    """The rows whose prompt fits in `max_prompt_tokens`, how many were dropped, and the longest kept length.

    A prompt is counted as training sees it: rendered by upstream's own PromptDataset step under
    --data.apply_chat_template (called rather than re-written, as it also turns `<image>` tags in the text
    into image parts before the template runs), then tokenized without special tokens as upstream's vLLM
    rollout does (openrlhf/utils/agent.py).
    """
    from openrlhf.datasets.prompts_dataset import preprocess_data

    kept, longest = [], 0
    for row in rows:
        text, _ = preprocess_data(row, input_key="prompt", apply_chat_template=tokenizer.apply_chat_template)
        num_tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if num_tokens <= max_prompt_tokens:
            kept.append(row)
            longest = max(longest, num_tokens)
    return kept, len(rows) - len(kept), longest


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
    parser.add_argument("--max-prompt-tokens", type=int, default=None,
                        help="drop rows whose chat-rendered prompt is longer than this many tokens (needs --tokenizer)")
    parser.add_argument("--tokenizer", default=None,
                        help="the model's tokenizer (folder or hub id) that --max-prompt-tokens counts with")
    args = parser.parse_args(argv)
    if (args.max_prompt_tokens is None) != (args.tokenizer is None):
        parser.error("--max-prompt-tokens and --tokenizer go together")
    if args.max_prompt_tokens is not None and args.max_prompt_tokens < 1:
        parser.error("--max-prompt-tokens must be at least 1")
    if args.max_tests is not None and args.max_tests < 1:
        parser.error("--max-tests must be at least 1")
    if args.platform and args.dataset != "livecodebench":
        parser.error("--platform applies to livecodebench only")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        tokenizer = load_chat_tokenizer(args.tokenizer) if args.tokenizer else None  # before the source is read
        source_rows = Counted(sources.iter_rows(args.source, args.split))
        rows, stats = convert(args.dataset, source_rows, args)
    except (loaders.RowFormatError, sources.DataSourceError, ValueError) as err:
        print(f"prepare_data: {err}", file=sys.stderr)
        return 2
    if tokenizer is not None:
        rows, num_dropped, longest = drop_long_prompts(rows, tokenizer, args.max_prompt_tokens)
        if num_dropped and not rows:
            print(f"prepare_data: {args.dataset}: all {num_dropped} prompts are over {args.max_prompt_tokens} "
                  f"tokens; nothing written", file=sys.stderr)
            return 2
    write_jsonl(rows, args.out)
    print(f"{args.dataset}: read {source_rows.count} rows, wrote {len(rows)} rows to {args.out}")
    if stats is not None:
        print(f"{args.dataset}: " + ", ".join(f"{key}={value}" for key, value in stats.items()))
    if tokenizer is not None:
        print(f"{args.dataset}: dropped {num_dropped} prompts over {args.max_prompt_tokens} tokens "
              f"(longest kept: {longest})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
