"""The label of a code problem: written by `data.loaders` (`code_label`), read by the reward and the
evaluation (`parse_label`). Standard library only.

A label is the JSON text of an object (a dict is accepted too):

* stdin/stdout problem (TACO-Verified): `{"inputs": [stdin, ...], "outputs": [expected stdout, ...]}`;
  an element given as a list of lines is joined with newlines.
* call-based problem (LeetCode, in LiveCodeBench's layout): `{"fn_name": name, "inputs": [...],
  "outputs": [...]}`; each input is text with one JSON argument per line, each output the JSON text of
  the expected return value. An empty `fn_name` (TACO) means a stdin/stdout problem.
* optional `"time_limit_s"`: a positive per-test limit in seconds.
"""

from __future__ import annotations

import json
import math
from typing import NamedTuple


def code_label(inputs: list[str], outputs: list[str], fn_name: str | None = None) -> str:
    """The label of a stdin/stdout problem, or with `fn_name` of a call-based one, as JSON text."""
    label = {"inputs": inputs, "outputs": outputs} if fn_name is None else {
        "fn_name": fn_name, "inputs": inputs, "outputs": outputs}
    return json.dumps(label, ensure_ascii=False)


class CodeLabel(NamedTuple):
    """A parsed label: `tests` as `sandbox.score_program` takes them (for a call-based problem, a JSON
    argument array and the expected value's JSON text), the function to call, the time limit.
    (Not a dataclass: those need their module in sys.modules, which OpenRLHF's file loader skips.)"""

    tests: list[tuple[str, str]]
    fn_name: str | None = None
    time_limit_s: float | None = None


def positive_seconds(value) -> float:
    seconds = float(value)
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"time limit must be a positive number of seconds, got {value!r}")
    return seconds


def _text(value) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(line, str) for line in value):
        return "\n".join(value)
    raise ValueError(f"test data must be a string or a list of strings, got {type(value).__name__}")


def _call_test(arguments, expected, index: int) -> tuple[str, str]:
    """One call-based test as (JSON argument array, expected JSON), each line checked to parse."""
    if not isinstance(arguments, str) or not isinstance(expected, str):
        raise ValueError(f"call-based test {index}: input and output must be text with one JSON value per "
                         f"line (LiveCodeBench's layout)")
    try:
        values = [json.loads(line) for line in arguments.strip().split("\n")] if arguments.strip() else []
        json.loads(expected)
    except ValueError as error:
        raise ValueError(f"call-based test {index}: not JSON ({error})") from None
    return json.dumps(values), expected


def parse_label(label) -> CodeLabel:
    """The label's tests, function name and time limit. Raises ValueError on anything but a non-empty
    list of stdin/stdout tests or of call-based tests (see the module docstring)."""
    data = json.loads(label) if isinstance(label, (str, bytes)) else label
    if not isinstance(data, dict):
        raise ValueError("label is not a JSON object")
    inputs, outputs = data.get("inputs"), data.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs) or not inputs:
        raise ValueError("label needs non-empty 'inputs' and 'outputs' lists of equal length")
    fn_name = data.get("fn_name") or None
    if fn_name is not None and not (isinstance(fn_name, str) and fn_name.isidentifier()):
        raise ValueError(f"fn_name must be a Python identifier, got {fn_name!r}")
    if fn_name:
        tests = [_call_test(arguments, expected, i) for i, (arguments, expected) in enumerate(zip(inputs, outputs))]
    else:
        tests = [(_text(stdin), _text(expected)) for stdin, expected in zip(inputs, outputs)]
    limit = data.get("time_limit_s")
    return CodeLabel(tests, fn_name, None if limit is None else positive_seconds(limit))
