"""Code-execution reward for OpenRLHF (`--reward.remote_url openrlhf_growmtp/rewards/code_reward.py`).

OpenRLHF loads this file with `importlib.util.spec_from_file_location` and calls
`reward_func(queries, prompts, labels)`. Each label is a JSON object (a dict is accepted too)
`{"inputs": [stdin, ...], "outputs": [expected stdout, ...], "time_limit_s": optional float}` as in
TACO-Verified's stdin/stdout problems; an element given as a list of lines is joined with newlines.
A response scores 1.0 when the program in its last ```python block (see
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


def parse_label(label) -> tuple[list[tuple[str, str]], float | None]:
    """(tests as (stdin, expected stdout) pairs, the label's time limit or None). Raises ValueError on
    anything but a non-empty stdin/stdout test list (call-based `fn_name` problems included)."""
    data = json.loads(label) if isinstance(label, (str, bytes)) else label
    if not isinstance(data, dict):
        raise ValueError("label is not a JSON object")
    if data.get("fn_name"):
        raise ValueError("call-based (fn_name) problems are not stdin/stdout tests")
    inputs, outputs = data.get("inputs"), data.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs) or not inputs:
        raise ValueError("label needs non-empty 'inputs' and 'outputs' lists of equal length")
    tests = [(_text(stdin), _text(expected)) for stdin, expected in zip(inputs, outputs)]
    limit = data.get("time_limit_s")
    return tests, None if limit is None else _positive_seconds(limit)


def code_score(query, prompt, label) -> float:
    """The 0/1 reward of one sample; never raises."""
    try:
        tests, time_limit_s = parse_label(label)
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
        limits = SandboxLimits(time_limit_s=time_limit_s or default_time_limit_s())
        return score_program(program, tests, limits)
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
