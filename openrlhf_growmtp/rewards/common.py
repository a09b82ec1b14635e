"""What every reward file needs: the response part of OpenRLHF's decoded prompt+response."""

from __future__ import annotations

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
