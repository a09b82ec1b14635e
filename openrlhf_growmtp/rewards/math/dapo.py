"""Rule "dapo": DAPO's string-matching verifier (verl's `math_dapo`, after Minerva's answer normalisation).

Both answers are normalised by `normalize_final_answer` and compared as strings: `0.5` does not match
`\\frac{1}{2}` and `\\dfrac12` does not match `\\frac{1}{2}`; `1,000` matches `1000`, `12\\text{ cm}` matches
`12`. The tables and the order of the steps are DAPO's; so are its quirks (only the text after the last
`=` counts; every "a " and "an " is deleted, so `a b` matches `b`).
"""

from __future__ import annotations

import re

SUBSTITUTIONS = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
                 (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
REMOVED_EXPRESSIONS = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue", "points",
    "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
    "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3",
    "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)
# (pattern, replacement) in DAPO's order; `[^\n]` is its `.` (no DOTALL)
_REWRITES = (
    (re.compile(r"[^\n]*?\$([^\n]*?)\$[^\n]*"), r"$\1$"),  # keep the first $...$ of a line
    (re.compile(r"\\text\{([^\n]*?)\}"), r"\1"),
    (re.compile(r"\\textbf\{([^\n]*?)\}"), r"\1"),
    (re.compile(r"\\overline\{([^\n]*?)\}"), r"\1"),
    (re.compile(r"\\boxed\{([^\n]*)\}"), r"\1"),
    (re.compile(r"frac([^{])([^\n])"), r"frac{\1}{\2}"),  # \frac12 -> \frac{1}{2}
    (re.compile(r"sqrt([^{])"), r"sqrt{\1}"),  # \sqrt2 -> \sqrt{2}
)


def normalize_final_answer(answer: str) -> str:
    """DAPO's canonical form of a final answer (see the module docstring)."""
    text = answer.split("=")[-1]
    for old, new in SUBSTITUTIONS:
        text = text.replace(old, new)
    for expression in REMOVED_EXPRESSIONS:
        text = text.replace(expression, "")
    for pattern, replacement in _REWRITES:
        text = pattern.sub(replacement, text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def dapo_equal(answer: str, reference: str) -> bool:
    """Whether the normalised strings are equal (two empty answers are not)."""
    normalized = normalize_final_answer(answer)
    return bool(normalized) and normalized == normalize_final_answer(reference)
