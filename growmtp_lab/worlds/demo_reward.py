"""The demo's reward function for OpenRLHF (`--reward.remote_url <this file>`): 1 for a correct final answer.

OpenRLHF passes the decoded prompt+response (`queries`), the prompts and the labels (the answers).
"""

from __future__ import annotations

import torch

from growmtp_lab.worlds.task import score
from openrlhf_growmtp.rewards.common import response_of


def reward_func(queries: list[str], prompts: list[str], labels: list[str]) -> dict:
    rewards = torch.tensor([score(response_of(query, prompt), label)
                            for query, prompt, label in zip(queries, prompts, labels)])
    return {"rewards": rewards, "scores": rewards}
