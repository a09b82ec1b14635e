"""The reasoning world's reward function for OpenRLHF (`--reward.remote_url <this file>`): the demo's, 1 for a
correct final answer read after the last `A` (the connectives hold no digit and are never `A`)."""

from __future__ import annotations

from growmtp_lab.worlds.demo_reward import reward_func

__all__ = ["reward_func"]
