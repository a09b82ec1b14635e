"""Rule-based math reward for OpenRLHF (`--reward.remote_url openrlhf_growmtp/rewards/math_reward.py`).

OpenRLHF loads this file by path (`importlib.util.spec_from_file_location`, without registering it in
sys.modules, so its imports are absolute) and calls `reward_func(queries, prompts, labels)` from a worker
thread (`asyncio.to_thread`) with the decoded prompt+response texts, the prompts and the reference answers.
A response scores 1.0 when its final answer matches the label under the run's rule ($GROWMTP_MATH_RULE:
"dapo", the default, or "symbolic"; see `rewards.math.score`), else 0.0; a sample that cannot be scored
(missing prompt or label, odd types) scores 0.0.
"""

from __future__ import annotations

import logging

from openrlhf_growmtp.rewards.common import response_of, reward_dict, samples
from openrlhf_growmtp.rewards.math.score import math_score, rule_from_env

RULE = rule_from_env()  # an unknown rule stops the run when the file loads, not as a run of zero rewards
logging.getLogger(__name__).info("math reward: rule %r", RULE)


def _score(query, prompt, label) -> float:
    if not isinstance(query, str) or label is None:
        return 0.0
    return math_score(response_of(query, prompt) if isinstance(prompt, str) else query, str(label), RULE)


def reward_func(queries: list[str], prompts: list[str], labels: list[str]) -> dict:
    """One 0/1 reward per query, as `{"rewards": float32 tensor, "scores": the same values}`."""
    return reward_dict([_score(*sample) for sample in samples(queries, prompts, labels)])
