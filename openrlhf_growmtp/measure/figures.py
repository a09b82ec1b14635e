"""Figures quoted in the README and docs, tied to the kept files they come from.

Two marks, both invisible in rendered markdown:

- after a number, `<!-- fig: PATH KEY -->`: the number is the JSON file PATH's value at KEY (dots between keys and list
  indices, e.g. `paired.0.speedup.low`; a key may hold dots itself), rounded to as many decimals as the text shows;
  ` pct` after KEY reads a share as a percentage, ` ms` seconds as milliseconds. PATH is relative to the markdown file.
- `<!-- table: PATH -->` ... `<!-- /table -->` around a block: the block is the file PATH's text (a table a
  study wrote, e.g. `table.md`).

Every other number with a speed or time unit (×, x, s, ms, min, %, tokens/s, GB/s, ...) or a τ value, outside code,
stands inside a labelled block, `<!-- KIND: why -->` ... `<!-- /KIND -->`, KIND one of
- `history`: from a run that was not kept (quoted from its output at the time), or a figure withdrawn;
- `example`: not a measurement: an illustration, a target, a setting, a spec sheet's value, worked arithmetic;
- `derived`: arithmetic on figures quoted with marks nearby (its inputs named in the text);
- `kept: PATH [PATH ...]`: read from those kept files (a folder: its JSON files) without a mark each; every such number,
  and every other decimal of the block (units or not: `| 2.31 | 0.88 |`, `z −1.10`, `2.8e-01`), must be one of the
  files' values (any key) at the precision shown, as a value, a share in percent, seconds in milliseconds or
  minutes, bytes in MiB or GiB, or a count in millions or billions, or a number written in one of the files'
  strings (a row's printed `max|d| 2.8e-01`) (a weaker check than a mark's: it catches a number the files do not
  hold, not one that matches another value by chance). The other labels may stand inside a kept block, for what
  is not read from its files.
`untied(markdown_path)` lists the numbers that stand in none (`tests/test_figures.py`: none may).

`check(markdown_path)` lists every mark that no longer matches its file; `refresh(markdown_path)` rewrites the
table blocks from their files (a quoted number is never rewritten: its sentence may need to change with it).

    python -m openrlhf_growmtp.measure.figures README.md docs/*.md            # check
    python -m openrlhf_growmtp.measure.figures --refresh docs/demo.md         # tables from their files
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

FIGURE = re.compile(r"(-?\d[\d,]*(?:\.\d+)?)(?:\*\*|[×x%]|\s)*<!-- fig: (\S+) (\S+)( pct| ms)? -->")
SCALES = {None: 1, " pct": 100, " ms": 1000}  # a mark's unit: what the kept value is multiplied by
TABLE = re.compile(r"<!-- table: (\S+) -->\n(.*?)<!-- /table -->", re.DOTALL)
MARK = re.compile(r"<!-- (fig|table): ")
CODE = re.compile(r"^(```|~~~).*?^\1[^\n]*$|(`+)[^\n]*?\2", re.DOTALL | re.MULTILINE)  # fenced blocks, code spans


def _blank(match: re.Match) -> str:
    """A match's text as spaces, its line breaks kept (line numbers stay true)."""
    return re.sub(r"[^\n]", " ", match.group(0))


def _outside_code(text: str) -> str:
    """`text` with its code blocks and code spans blanked (a mark quoted as an example is no mark)."""
    return CODE.sub(_blank, text)


def lookup(document: dict | list, key: str):
    """`document`'s value at a dotted key: integers index lists; a dict's own keys may hold dots (e.g. a τ of
    "2.91"), the longest that matches is taken."""
    value, parts, i = document, key.split("."), 0
    while i < len(parts):
        if isinstance(value, list):
            value, i = value[int(parts[i])], i + 1
            continue
        for j in range(len(parts), i, -1):
            name = ".".join(parts[i:j])
            if isinstance(value, dict) and name in value:
                value, i = value[name], j
                break
        else:
            raise KeyError(f"no {parts[i]!r} in {key!r}")
    return value


def check(path: Path) -> list[str]:
    """Every figure or table of a markdown file that does not match its kept file, each with the reason."""
    raw = path.read_text(encoding="utf-8")
    text = _outside_code(raw)
    problems, cache = [], {}
    marks = len(MARK.findall(text))
    matched = 0
    for match in FIGURE.finditer(text):
        matched += 1
        shown, source, key, unit = match.groups()
        where = f"{path.name}: {shown} <- {source} {key}"
        file = (path.parent / source).resolve()
        try:
            if file not in cache:
                cache[file] = json.loads(file.read_text())
            value = lookup(cache[file], key)
        except (OSError, ValueError, KeyError, IndexError) as err:
            problems.append(f"{where}: {err}")
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            problems.append(f"{where}: the kept value {value!r} is not a number")
            continue
        value = SCALES[unit] * value
        digits = len(shown.split(".")[1]) if "." in shown else 0
        if round(value, digits) != float(shown.replace(",", "")):
            problems.append(f"{where}: the kept value is {value!r}, which shows as {value:.{digits}f}")
    for match in TABLE.finditer(raw):  # a table's own code spans stay: it is compared as its file's text
        if text[match.start()] != "<":
            continue  # a table mark quoted in code
        matched += 1
        file = (path.parent / match.group(1)).resolve()
        if not file.exists():
            problems.append(f"{path.name}: table {match.group(1)}: no such file")
        elif file.read_text(encoding="utf-8").strip() != match.group(2).strip():
            problems.append(f"{path.name}: table {match.group(1)} differs from its file (--refresh)")
    if matched != marks:
        problems.append(f"{path.name}: {marks - matched} mark(s) not after a number or not closed by <!-- /table -->")
    return problems


NUMBER = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
# a number, or a range of two, with a speed or time unit after it ("1.18×", "516 s", "9-12%", "1,292 tokens/s"; a
# ratio's × right after the number, "2 × hidden" being arithmetic)
# (an interval's level, "95% interval", "[95%]", is no figure)
UNIT_FIGURE = re.compile(rf"(?<![\w.\-/])({NUMBER})(?:\s?[-–]\s?({NUMBER}))?(?:\*\*)?"
                         r"(?:×(?!\s?\d)|x(?![\w])|\s?ms\b|\s?s\b|\s?min\b|"
                         r"\s?minutes?\b|\s?seconds?\b|\s?hours?\b|%(?!\s(?:interval|confidence|bootstrap|percentile)|\])|"
                         r"\s?tokens?/s\b|\s?tok/s\b|\s?[GT]B/s\b|\s?[GT]FLOP/s\b)")
# a τ value: "τ 2.26", "τ = 2.91", "τ ≈ 2.9", "at τ 3.01-3.04", "τ 1.04 → 2.23" (not "τ = 1", the floor, nor a
# formula, "τ = 1 + ...")
TAU_FIGURE = re.compile(rf"τ\s?(?:=|≈|of|at|to|from|near|about|:)?\s?(?!1(?!\d|[.,]\d))({NUMBER})(?![\d.])"
                        rf"(?!\s?[+×*/≤]|\s?<(?!!--))(?:\s?[-–→]\s?({NUMBER}))?")
MARK_AFTER = re.compile(r"^(?:\*\*|[×x%]|\s)*<!-- fig: ")
LABEL_INNER = re.compile(r"<!-- (history|example|derived)(?::[^>]*?)? -->.*?<!-- /\1 -->", re.DOTALL)
LABEL_KEPT = re.compile(r"<!-- kept: ([^>]*?) -->(.*?)<!-- /kept -->", re.DOTALL)


# how a kept value may be shown: as it is, a share in percent, seconds in ms or minutes, bytes in MiB or GiB, a
# count in millions or billions
SHOWN_AS = (1, 100, 1000, 1 / 60, 2 ** -20, 2 ** -30, 1e-6, 1e-9)
WRITTEN = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")  # a number written in a string value
# "2.31", "−1.10", "2.8e-01"; not "0.11.2"
DECIMAL = re.compile(r"(?<![\w.\-/−])((?:(?<=[\s(])[−-])?\d+\.\d+(?:e[-+]\d+)?)(?![\w.])")


def _numbers(document) -> set[float]:
    """Every number in a JSON document, in each unit of SHOWN_AS, and every number written in its strings."""
    found = set()
    stack = [document]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, str):
            found.update(float(number) for number in WRITTEN.findall(value))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            found.update(scale * value for scale in SHOWN_AS)
    return found


def _kept_in(shown: str, values: set[float]) -> bool:
    """Whether one of `values` shows as `shown` ("1,234.5", "−1.10", or "2.8e-01" at its mantissa's digits)."""
    shown = shown.replace("−", "-")
    if "e" in shown:
        digits = len(shown.split("e")[0].partition(".")[2])
        return any(float(f"{v:.{digits}e}") == float(shown) for v in values)
    digits = len(shown.split(".")[1]) if "." in shown else 0
    target, half = float(shown.replace(",", "")), 0.5 * 10 ** -digits
    return any(abs(v - target) <= half * (1 + 1e-9) for v in values)  # an exact half may show either way


def _decimals(text: str) -> list[tuple[str, int]]:
    """The decimals of `text` that carry no mark, with their digits' offsets (where `_figures` puts a unit figure's:
    a signed one replaces it)."""
    return [(match.group(1), match.start(1) + (match.group(1)[0] in "−-")) for match in DECIMAL.finditer(text)
            if not MARK_AFTER.match(text[match.end(1):])]


def untied(path: Path) -> list[str]:
    """Every number with a speed or time unit, or τ value, outside code, that carries no mark and stands in no
    labelled block; and every such number, or other decimal, of a `kept` block that none of its files holds."""
    text = _outside_code(path.read_text(encoding="utf-8"))
    text = TABLE.sub(_blank, text)  # a table block is its file
    problems = []
    text = LABEL_INNER.sub(_blank, text)  # history, example, derived: inside a kept block too
    for label in LABEL_KEPT.finditer(text):
        values = set()
        for source in (label.group(1) or "").split():
            where = path.parent / source
            for file in sorted(where.rglob("*.json")) if where.is_dir() else [where]:
                try:
                    values |= _numbers(json.loads(file.read_text()))
                except (OSError, ValueError) as err:
                    problems.append(f"{path.name}: kept block's file {file}: {err}")
        figures = dict((at, shown) for shown, at in _figures(label.group(2)) + _decimals(label.group(2)))
        for at, shown in sorted(figures.items()):
            if not _kept_in(shown, values):
                line = text.count(chr(10), 0, label.start(2) + at) + 1
                problems.append(f"{path.name}:{line}: {shown} is in a kept block whose files hold no such value")
    outside = LABEL_KEPT.sub(_blank, text)
    for shown, at in _figures(outside):
        problems.append(f"{path.name}:{outside.count(chr(10), 0, at) + 1}: {shown} has no <!-- fig: --> mark and "
                        "stands in no labelled block")
    return problems


def _figures(text: str) -> list[tuple[str, int]]:
    """The figures of `text` that carry no mark, with their offsets: each number of a unit or τ figure (both
    ends of a range), in the order they stand."""
    found = {}
    for pattern in (UNIT_FIGURE, TAU_FIGURE):
        for match in pattern.finditer(text):
            for i in (1, 2):
                if match.group(i) is None or MARK_AFTER.match(text[match.end(i):]):
                    continue
                if i == 1 and match.group(2) is None and MARK_AFTER.match(text[match.end(1):]):
                    continue
                found[match.start(i)] = match.group(i)
    return [(shown, at) for at, shown in sorted(found.items())]


def refresh(path: Path) -> int:
    """Rewrite `path`'s table blocks from their files; returns how many changed."""
    text = path.read_text(encoding="utf-8")
    changed = 0

    def replace(match: re.Match) -> str:
        nonlocal changed
        table = (path.parent / match.group(1)).read_text(encoding="utf-8").strip()
        changed += table != match.group(2).strip()
        return f"<!-- table: {match.group(1)} -->\n{table}\n<!-- /table -->"

    path.write_text(TABLE.sub(replace, text), encoding="utf-8")
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m openrlhf_growmtp.measure.figures", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--refresh", action="store_true", help="rewrite the table blocks from their files first")
    args = parser.parse_args(argv)
    problems = []
    for path in args.files:
        if args.refresh and refresh(path):
            print(f"{path}: tables refreshed")
        problems += check(path)
    print("\n".join(problems) if problems else "every figure matches its kept file")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
