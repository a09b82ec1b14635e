"""What every reward file needs: OpenRLHF's batch as (query, prompt, label) rows, the response part of a
decoded prompt+response, and the `{"rewards", "scores"}` dict OpenRLHF reads back."""

from __future__ import annotations

import torch

TAIL = 64  # characters of the prompt's end used to find it when re-decoding changed its text


def response_of(query: str, prompt: str) -> str:
    """The text after the prompt in `query` (OpenRLHF decodes prompt and response tokens together).

    Decoding the tokenized prompt can differ from the prompt text (whitespace, normalisation), so when
    the query does not start with the prompt, the response starts after the last occurrence of the
    prompt's final characters; failing that, the whole query is returned.
    """
    if query.startswith(prompt):
        return query[len(prompt):]
    tail = prompt.strip()[-TAIL:]
    at = query.rfind(tail) if tail else -1
    return query[at + len(tail):] if at >= 0 else query


def samples(queries, prompts, labels) -> list[tuple]:
    """(query, prompt, label) per query; a missing prompt or label is None."""
    prompts, labels = list(prompts or []), list(labels or [])
    return [(query, prompts[i] if i < len(prompts) else None, labels[i] if i < len(labels) else None)
            for i, query in enumerate(queries or [])]


def reward_dict(scores: list[float]) -> dict:
    """OpenRLHF's reward-function result: the same float32 values as "rewards" and "scores"."""
    rewards = torch.tensor(scores, dtype=torch.float32)
    return {"rewards": rewards, "scores": rewards.clone()}
