"""Rule-based rewards in OpenRLHF's reward-file form (`--reward.remote_url <file>.py`, a file defining
`reward_func(queries, prompts, labels)`): `math_reward.py` (package `math`) and `code_reward.py` (`code`)."""
