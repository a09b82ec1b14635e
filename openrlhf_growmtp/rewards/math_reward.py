"""Rule-based math reward for OpenRLHF (`--reward.remote_url openrlhf_growmtp/rewards/math_reward.py`).

OpenRLHF loads this file with `importlib.util.spec_from_file_location` and calls
`reward_func(queries, prompts, labels)`: the decoded prompt+response texts, the prompt texts and the
ground-truth answers. Each response scores 1.0 when its final answer (last `\\boxed{}`, else the last
`Answer: ...` line, as DAPO-Math-17K's prompt asks) equals the label, else 0.0; see `math_verify`.
A sample that cannot be scored (missing prompt or label, odd types, any error) gets 0.0.
"""

from __future__ import annotations

import torch

from openrlhf_growmtp.rewards.common import response_of
from openrlhf_growmtp.rewards.math_verify import math_score


def _score_one(query, prompt, label) -> float:
    try:
        if not isinstance(query, str) or label is None:
            return 0.0
        response = response_of(query, prompt) if isinstance(prompt, str) else query
        return math_score(response, str(label))
    except Exception:
        return 0.0


def reward_func(queries: list[str], prompts: list[str], labels: list[str]) -> dict:
    """One 0/1 reward per query, as `{"rewards": float32 tensor, "scores": the same tensor}`."""
    queries = list(queries or [])
    prompts = list(prompts or [])
    labels = list(labels or [])
    scores = [
        _score_one(query, prompts[i] if i < len(prompts) else None, labels[i] if i < len(labels) else None)
        for i, query in enumerate(queries)
    ]
    rewards = torch.tensor(scores, dtype=torch.float32)
    return {"rewards": rewards, "scores": rewards}
