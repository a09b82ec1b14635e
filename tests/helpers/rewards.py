"""Reward and prompt files for the launcher's end-to-end tests on the toy world."""

import json
import random


def token_parity_reward(parity: int) -> str:
    """The source of a reward file: the share of a response's toy tokens (`t<id>`) whose id is `parity` mod 2."""
    return f'''
import torch
def reward_func(queries, prompts, labels):
    tokens = queries[0][len(prompts[0]):].split()
    hits = sum(1 for t in tokens if t[1:].isdigit() and int(t[1:]) % 2 == {parity})
    value = torch.tensor(hits / max(1, len(tokens)))
    return {{"rewards": value, "scores": value}}
'''


def write_toy_prompts(path, count: int, seed: int, max_words: int = 8) -> None:
    """A prompt dataset of `count` lines `{"input": "t<id> ...", "label": ""}`, 4..`max_words` toy tokens each."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(count):
            prompt = " ".join(f"t{rng.randint(2, 127)}" for _ in range(rng.randint(4, max_words)))
            f.write(json.dumps({"input": prompt, "label": ""}) + "\n")
