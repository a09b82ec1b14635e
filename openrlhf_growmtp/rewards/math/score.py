"""The math reward's verdict: the response's final answer against the reference, by one rule per run.

The rule is $GROWMTP_MATH_RULE (it must reach the process that runs the reward, e.g. a Ray worker):

* "dapo", the default: DAPO's string-matching verifier (`dapo`). The paper trains on DAPO-Math-17K and
  states "Judging uses the same string-matching verifier as training in mathematical reasoning"
  (Appendix, Evaluation Protocol), so training and evaluation both use it unless told otherwise.
* "symbolic": equivalence by HF's math-verify (`symbolic`), e.g. `0.5` matches `\\frac{1}{2}`.

Both rules judge the answer `extract.extract_answer` finds (the last box, else the last `Answer:` line).
An answer or reference longer than MAX_ANSWER_CHARS never matches: DAPO reads only the last 300 characters
of a response (the longest MATH-500 answer has 159), and the cap bounds both rules' cost on hostile text.
"""

from __future__ import annotations

import importlib.util
import logging
import os

from openrlhf_growmtp.rewards.math.dapo import dapo_equal
from openrlhf_growmtp.rewards.math.extract import extract_answer
from openrlhf_growmtp.rewards.math.symbolic import symbolic_equal

logger = logging.getLogger(__name__)

RULES = {"dapo": dapo_equal, "symbolic": symbolic_equal}
DEFAULT_RULE = "dapo"
RULE_ENV = "GROWMTP_MATH_RULE"
MAX_ANSWER_CHARS = 300


def rule_from_env() -> str:
    """$GROWMTP_MATH_RULE, else "dapo"; raises ValueError for an unknown rule and ImportError when the
    symbolic rule's math-verify is not installed."""
    rule = os.environ.get(RULE_ENV, "").strip() or DEFAULT_RULE
    if rule not in RULES:
        raise ValueError(f"{RULE_ENV}={rule!r}: the math rules are {', '.join(RULES)}")
    if rule == "symbolic" and importlib.util.find_spec("math_verify") is None:  # fail now, not as zero rewards
        raise ImportError("the symbolic math rule needs math-verify: pip install math-verify==0.9.0")
    return rule


def math_score(response, reference, rule: str | None = None) -> float:
    """1.0 when the response's final answer matches `reference` under `rule` (None: `rule_from_env()`),
    else 0.0. Raises only for an unknown rule; anything wrong with the sample scores 0.0."""
    rule = rule_from_env() if rule is None else rule
    if rule not in RULES:
        raise ValueError(f"unknown math rule {rule!r}: the rules are {', '.join(RULES)}")
    equal = RULES[rule]
    try:
        answer = extract_answer(response)
        if answer is None or reference is None or max(len(answer), len(str(reference))) > MAX_ANSWER_CHARS:
            return 0.0
        return float(equal(answer, str(reference)))
    except Exception:
        logger.warning("math reward: scoring failed; 0.0", exc_info=True)
        return 0.0
