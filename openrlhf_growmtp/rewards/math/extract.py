"""The final answer of a math response: the last `\\boxed{}` (or `\\fbox{}`), else the last `Answer:` line."""

from __future__ import annotations

import re

# OpenRLHF decodes with skip_special_tokens=False, so chat tokens can end an answer line
_SPECIAL_TOKEN = re.compile(r"<\|[A-Za-z0-9_:.\-]{1,40}\|>|</s>|<eos>|<end_of_turn>")
_ANSWER_LINE = re.compile(r"^[ \t>#*_]*(?:final[ \t]+)?answer[ \t*_]*:(.*)$", re.IGNORECASE | re.MULTILINE)
_ANSWER_IS = re.compile(r"^(?:the[ \t]+)?(?:final[ \t]+)?answer[ \t]+is[ \t]*:?", re.IGNORECASE)


def braced(text: str, start: int) -> str | None:
    """The content of the `{...}` group opening at `start`; None when it never closes (`\\{`, `\\}` skipped)."""
    depth, i = 0, start
    while i < len(text):
        if text[i] == "\\":
            i += 1
        elif text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1:i]
        i += 1
    return None


def strip_decorations(s: str) -> str:
    """Drop surrounding whitespace, markdown bold, `$`/`\\(`/`\\[` math delimiters and a trailing period."""
    previous = None
    while s != previous:
        previous = s
        s = s.strip().strip("*").strip().removesuffix(".")
        if len(s) >= 2 and s[0] == s[-1] == "$":
            s = s.strip("$")
        if len(s) >= 4 and s[:2] + s[-2:] in ("\\(\\)", "\\[\\]"):
            s = s[2:-2]
    return s


def last_boxed(text: str) -> str | None:
    """The last `\\boxed{...}` / `\\fbox{...}` (`\\boxed 5` runs to the end of the math or line); None when
    there is none, or the last one is empty or never closes (a truncated response)."""
    at, name = max((text.rfind("\\" + name), name) for name in ("boxed", "fbox"))
    if at < 0:
        return None
    rest = text[at + len(name) + 1:].lstrip(" \t")
    content = braced(rest, 0) if rest.startswith("{") else re.split(r"[$\n]", rest, maxsplit=1)[0]
    if content is None:
        return None
    return strip_decorations(content) or None


def last_answer_line(text: str) -> str | None:
    """The last `Answer: ...` line (`**Answer:**`, `Final Answer:`, any case), or the next non-empty line
    when nothing follows the colon; a leading "the final answer is" is dropped."""
    matches = list(_ANSWER_LINE.finditer(text))
    if not matches:
        return None
    content = matches[-1].group(1)
    if not strip_decorations(content):
        following = [line for line in text[matches[-1].end():].splitlines() if line.strip()]
        content = following[0] if following else ""
    return strip_decorations(_ANSWER_IS.sub("", strip_decorations(content))) or None


def extract_answer(response) -> str | None:
    """The final answer in a model response, or None: the last box wins over an `Answer:` line."""
    if not isinstance(response, str):
        return None
    response = _SPECIAL_TOKEN.sub("\n", response)
    return last_boxed(response) or last_answer_line(response)
