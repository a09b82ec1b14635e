"""Code-execution reward for OpenRLHF (`--reward.remote_url openrlhf_growmtp/rewards/code_reward.py`).

OpenRLHF loads this file with `importlib.util.spec_from_file_location` and calls
`reward_func(queries, prompts, labels)`. Each label is a JSON object (a dict is accepted too), either
`{"inputs": [stdin, ...], "outputs": [expected stdout, ...], "time_limit_s": optional float}` as in
TACO-Verified's stdin/stdout problems (an element given as a list of lines is joined with newlines), or
a call-based (LeetCode) problem `{"fn_name": name, "inputs": [...], "outputs": [...]}` in
LiveCodeBench's layout: each input is text with one JSON argument per line, each output the JSON text of
the expected return value. A response scores 1.0 when the program in its last ```python block (see
`code_sandbox.extract_program`) passes every test in the sandbox (`code_sandbox.score_program`), else
0.0. The per-test time limit is the label's `time_limit_s`, else $GROWMTP_CODE_TIME_LIMIT_S, else 6 s
(the paper's LiveCodeBench setting). Nothing here raises: a malformed label scores 0.0 with a logged
warning, and so does a response without a program.
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import NamedTuple

import torch

from openrlhf_growmtp.rewards.code_sandbox import SandboxLimits, extract_program, score_program
from openrlhf_growmtp.rewards.common import response_of

logger = logging.getLogger(__name__)

DEFAULT_TIME_LIMIT_S = 6.0
TIME_LIMIT_ENV = "GROWMTP_CODE_TIME_LIMIT_S"


def _positive_seconds(value) -> float:
    seconds = float(value)
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"time limit must be a positive number of seconds, got {value!r}")
    return seconds


def default_time_limit_s() -> float:
    """$GROWMTP_CODE_TIME_LIMIT_S when set to a positive number, else 6.0 (a bad value is logged)."""
    raw = os.environ.get(TIME_LIMIT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIME_LIMIT_S
    try:
        return _positive_seconds(raw)
    except ValueError:
        logger.warning("code reward: ignoring %s=%r", TIME_LIMIT_ENV, raw)
        return DEFAULT_TIME_LIMIT_S


def _text(value) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(line, str) for line in value):
        return "\n".join(value)
    raise ValueError(f"test data must be a string or a list of strings, got {type(value).__name__}")


class CodeLabel(NamedTuple):
    """A parsed label: `tests` as `code_sandbox.score_program` takes them (for a call-based problem, a
    JSON argument array and the expected value's JSON text), the function to call, the time limit.
    (Not a dataclass: those need their module in sys.modules, which OpenRLHF's file loader skips.)"""

    tests: list[tuple[str, str]]
    fn_name: str | None = None
    time_limit_s: float | None = None

    def score(self, program: str | None, limits: SandboxLimits) -> float:
        return score_program(program, self.tests, limits, call=self.fn_name)


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
    return CodeLabel(tests, fn_name, None if limit is None else _positive_seconds(limit))


def code_score(query, prompt, label) -> float:
    """The 0/1 reward of one sample; never raises."""
    try:
        parsed = parse_label(label)
    except (ValueError, TypeError) as error:
        logger.warning("code reward: malformed label (%s); scoring 0.0", error)
        return 0.0
    try:
        if not isinstance(query, str):
            return 0.0
        response = response_of(query, prompt) if isinstance(prompt, str) else query
        program = extract_program(response)
        if program is None:
            return 0.0
        return parsed.score(program, SandboxLimits(time_limit_s=parsed.time_limit_s or default_time_limit_s()))
    except Exception:
        logger.warning("code reward: scoring failed; 0.0", exc_info=True)
        return 0.0


def reward_func(queries: list[str], prompts: list[str], labels: list[str]) -> dict:
    """One 0/1 reward per query, as `{"rewards": float32 tensor, "scores": the same values}`.
    A query without a matching prompt or label scores 0.0."""
    queries, prompts, labels = list(queries or []), list(prompts or []), list(labels or [])
    scores = [code_score(query, prompts[i] if i < len(prompts) else None, labels[i] if i < len(labels) else None)
              for i, query in enumerate(queries)]
    rewards = torch.tensor(scores, dtype=torch.float32)
    return {"rewards": rewards, "scores": rewards.clone()}
