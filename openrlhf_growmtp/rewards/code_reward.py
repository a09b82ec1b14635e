"""Code-execution reward for OpenRLHF (`--reward.remote_url openrlhf_growmtp/rewards/code_reward.py`).

OpenRLHF loads this file by path (no sys.modules entry, so: absolute imports and no dataclass here) and
calls `reward_func(queries, prompts, labels)` from a worker thread; labels are `rewards.code.label`'s. A
response scores 1.0 when the program in its last ```python block passes every test in the sandbox
(`sandbox.score_program`), else 0.0. The per-test time limit is the label's `time_limit_s`, else
$GROWMTP_CODE_TIME_LIMIT_S, else 6 s (the paper's LiveCodeBench setting). Nothing here raises: a malformed
label scores 0.0 with a logged warning, and so does a response without a program.
"""

from __future__ import annotations

import logging
import os

from openrlhf_growmtp.rewards.code.judge import extract_program
from openrlhf_growmtp.rewards.code.label import parse_label, positive_seconds
from openrlhf_growmtp.rewards.code.sandbox import SandboxLimits, score_program
from openrlhf_growmtp.rewards.common import response_of, reward_dict, samples

logger = logging.getLogger(__name__)

DEFAULT_TIME_LIMIT_S = 6.0
TIME_LIMIT_ENV = "GROWMTP_CODE_TIME_LIMIT_S"


def default_time_limit_s() -> float:
    """$GROWMTP_CODE_TIME_LIMIT_S when set to a positive number, else 6.0 (a bad value is logged)."""
    raw = os.environ.get(TIME_LIMIT_ENV, "").strip()
    try:
        return positive_seconds(raw) if raw else DEFAULT_TIME_LIMIT_S
    except ValueError:
        logger.warning("code reward: ignoring %s=%r", TIME_LIMIT_ENV, raw)
        return DEFAULT_TIME_LIMIT_S


def code_score(query, prompt, label) -> float:
    """The 0/1 reward of one sample; never raises."""
    try:
        parsed = parse_label(label)
    except (ValueError, TypeError, RecursionError) as error:
        logger.warning("code reward: malformed label (%s); scoring 0.0", error)
        return 0.0
    if not isinstance(query, str):
        return 0.0
    program = extract_program(response_of(query, prompt) if isinstance(prompt, str) else query)
    limits = SandboxLimits(time_limit_s=parsed.time_limit_s or default_time_limit_s())
    return score_program(program, parsed.tests, limits, call=parsed.fn_name)


def reward_func(queries: list[str], prompts: list[str], labels: list[str]) -> dict:
    """One 0/1 reward per query, as `{"rewards": float32 tensor, "scores": the same values}`.
    A query without a matching prompt or label scores 0.0."""
    return reward_dict([code_score(*sample) for sample in samples(queries, prompts, labels)])
