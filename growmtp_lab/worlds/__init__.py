"""The worlds: a policy, prompts, a reward and a random head, built once and cached."""
