"""What a code response is judged on: the program it ends with, and whether its output matches."""

from __future__ import annotations

import json
import math
import re

_FENCE = re.compile(r"```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)\n[ \t]*```", re.DOTALL)
_PYTHON_TAGS = frozenset({"python", "python3", "py", "py3"})
_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
FLOAT_TOL = 1e-6  # relative and absolute, for numbers written with a point or exponent


def extract_program(response) -> str | None:
    """The body of the last closed ```python / ```py block, else of the last untagged ``` block, else None.
    Blocks tagged with another language and an unclosed (truncated) final block are ignored; an empty
    body counts as no program."""
    if not isinstance(response, str):
        return None
    tagged, untagged = None, None
    for match in _FENCE.finditer(response):
        tag, body = match.group(1).lower(), match.group(2)
        if tag in _PYTHON_TAGS:
            tagged = body
        elif not tag:
            untagged = body
    program = tagged if tagged is not None else untagged
    return program if program is not None and program.strip() else None


def _tokens_match(actual: str, expected: str) -> bool:
    """Equal tokens, or numbers (at least one with a point or exponent) within FLOAT_TOL. Two integer
    tokens must match exactly, so large integer answers are not accepted by rounding."""
    if actual == expected:
        return True
    if not (_NUMBER.fullmatch(actual) and _NUMBER.fullmatch(expected)):
        return False
    if not any(c in token for token in (actual, expected) for c in ".eE"):
        try:
            return int(actual) == int(expected)
        except ValueError:  # past int()'s digit limit: the texts differ, so call them different
            return False
    a, b = float(actual), float(expected)
    return math.isfinite(a) and math.isfinite(b) and math.isclose(a, b, rel_tol=FLOAT_TOL, abs_tol=FLOAT_TOL)


def _lines(text: str) -> list[str]:
    """Lines without trailing whitespace, trailing blank lines dropped."""
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _line_matches(line: str, reference: str) -> bool:
    tokens, reference_tokens = line.split(), reference.split()
    return line == reference or (len(tokens) == len(reference_tokens)
                                 and all(map(_tokens_match, tokens, reference_tokens)))


def compare_output(actual: str, expected: str) -> bool:
    """Line by line after stripping trailing whitespace and trailing blank lines; a line that differs
    as text still matches when its whitespace-separated tokens match (see `_tokens_match`)."""
    got, want = _lines(actual), _lines(expected)
    return len(got) == len(want) and all(map(_line_matches, got, want))


def _values_match(actual, expected) -> bool:
    """JSON values equal, lists and objects element by element; floats within FLOAT_TOL of a number;
    a bool equals only a bool (LeetCode prints `true`, never `1`)."""
    if isinstance(expected, bool) or isinstance(actual, bool):
        return type(actual) is type(expected) and actual == expected
    if isinstance(expected, list):
        return (isinstance(actual, list) and len(actual) == len(expected)
                and all(map(_values_match, actual, expected)))
    if isinstance(expected, dict):
        return (isinstance(actual, dict) and actual.keys() == expected.keys()
                and all(_values_match(actual[key], expected[key]) for key in expected))
    numbers = (int, float)
    if isinstance(actual, numbers) and isinstance(expected, numbers) and float in (type(actual), type(expected)):
        return math.isfinite(actual) and math.isfinite(expected) and math.isclose(
            actual, expected, rel_tol=FLOAT_TOL, abs_tol=FLOAT_TOL)
    return type(actual) is type(expected) and actual == expected


def compare_json(actual: str, expected: str) -> bool:
    """Whether two JSON texts hold matching values (see `_values_match`); unparsable text never matches."""
    try:
        return _values_match(json.loads(actual), json.loads(expected))
    except (ValueError, RecursionError, OverflowError):  # OverflowError: an int too large for a float
        return False
