"""Rule-based rewards for the paper's domains, in OpenRLHF's reward-function form.

`--reward.remote_url <file>` loads a Python file defining `reward_func(queries, prompts, labels)`;
OpenRLHF calls it per sample with the decoded prompt+response, the prompt text and the dataset label,
and reads `{"rewards": tensor, "scores": tensor}` back. `math_reward.py` and `code_reward.py` are such files.
"""
