"""The math reward: answer extraction, the "dapo" and "symbolic" rules, their time bounds, and reward_func
loaded the way OpenRLHF loads `--reward.remote_url <file>.py`."""

from __future__ import annotations

import asyncio
import importlib.util
import pathlib
import threading
import time

import pytest
import torch

import openrlhf_growmtp.rewards
from openrlhf_growmtp.rewards.math import symbolic
from openrlhf_growmtp.rewards.math.dapo import dapo_equal, normalize_final_answer
from openrlhf_growmtp.rewards.math.extract import extract_answer
from openrlhf_growmtp.rewards.math.score import MAX_ANSWER_CHARS, RULE_ENV, math_score
from openrlhf_growmtp.rewards.math.symbolic import symbolic_equal

REWARD_FILE = pathlib.Path(openrlhf_growmtp.rewards.__file__).with_name("math_reward.py")
RULES = ("dapo", "symbolic")
# Slack over a deadline for process scheduling, the pipe round trip and killing a worker on a busy
# 2-core machine; the calls that reach the deadline measure ~1.02 s for TIME_LIMIT_S = 1.0.
SLACK_S = 1.0

# (response, reference, score under "dapo", score under "symbolic")
CASES = [
    # DAPO's format: the last `Answer:` line
    ("Answer: 42", "42", 1.0, 1.0),
    ("17 * 2 = 34.\n\nAnswer: 34<|im_end|>", "34", 1.0, 1.0),
    ("**Answer:** $34$.", "34", 1.0, 1.0),
    ("Final Answer: 34", "34", 1.0, 1.0),
    ("Answer: 43", "42", 0.0, 0.0),
    ("Answer: x = 3", "3", 1.0, 1.0),
    ("Answer: 5 cm", "5", 1.0, 1.0),
    ("Answer: 1/2", r"\frac{1}{2}", 0.0, 1.0),
    ("Answer: 0.5", r"\frac{1}{2}", 0.0, 1.0),
    ("Answer: .5", r"\frac12", 0.0, 1.0),
    ("Answer: 12,345", "12345", 1.0, 1.0),
    ("Answer: 40%", "40", 0.0, 1.0),
    # boxed answers; the last box wins, also over a later Answer: line
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}", 1.0, 1.0),
    (r"\boxed{\frac12}", r"\frac{1}{2}", 1.0, 1.0),  # DAPO braces \frac12 itself
    (r"\boxed{\dfrac12}", r"\frac{1}{2}", 0.0, 1.0),
    (r"\boxed{\tfrac{3}{4}}", "0.75", 0.0, 1.0),
    (r"\boxed{-\frac{1}{2}}", r"\frac{-1}{2}", 0.0, 1.0),
    (r"\boxed{2\frac{1}{2}}", r"\frac{5}{2}", 0.0, 1.0),  # mixed number
    (r"\boxed{2/1}", "1/2", 0.0, 0.0),
    (r"\boxed{0.333}", r"\frac{1}{3}", 0.0, 0.0),
    (r"First \boxed{3}, but correcting that: \boxed{4}", "4", 1.0, 1.0),
    (r"First \boxed{3}, but correcting that: \boxed{4}", "3", 0.0, 0.0),
    ("\\boxed{4}\nAnswer: 3", "4", 1.0, 1.0),
    # radicals
    (r"\boxed{\frac{\sqrt3}{2}}", r"\frac{\sqrt{3}}{2}", 1.0, 1.0),
    (r"\boxed{\sqrt{3}/2}", r"\frac{\sqrt{3}}{2}", 0.0, 1.0),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", 0.0, 1.0),
    (r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{\sqrt{2}}{2}", 0.0, 1.0),
    (r"\boxed{\sqrt[3]{27}}", "3", 0.0, 1.0),
    (r"\boxed{\sqrt{5+2\sqrt{6}}}", r"\sqrt{2}+\sqrt{3}", 0.0, 1.0),
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\sqrt{2}", 0.0, 0.0),
    (r"\boxed{2\sqrt{3}}", r"3\sqrt{2}", 0.0, 0.0),
    (r"\boxed{e^{\pi\sqrt{163}}}", "640320^3+744", 0.0, 0.0),  # differs by about 7.5e-13
    # intervals, sets, tuples, solution lists
    (r"\boxed{[1, 2)}", "[1,2)", 1.0, 1.0),
    (r"\boxed{[1,2]}", "(1,2]", 0.0, 0.0),
    (r"\boxed{(5, \infty) \cup (-\infty, 3)}", r"(-\infty,3)\cup(5,\infty)", 0.0, 1.0),
    (r"\boxed{(-\infty, 3] \cup (5, \infty)}", r"(-\infty,3)\cup(5,\infty)", 0.0, 0.0),
    (r"\boxed{\left[ \frac{1}{2}, 3 \right)}", "[0.5,3)", 0.0, 1.0),
    (r"\boxed{\{3, 1, 2\}}", r"\{1,2,3\}", 0.0, 1.0),
    (r"\boxed{\{1, 2\}}", r"\{1,2,3\}", 0.0, 0.0),
    (r"\boxed{x=1 \text{ or } x=-3}", "-3, 1", 0.0, 1.0),
    (r"\boxed{x=2, y=1}", "x=1, y=2", 0.0, 0.0),
    (r"\boxed{(1, 2)}", "(1,2)", 1.0, 1.0),
    (r"\boxed{(2, 1)}", "(1,2)", 0.0, 0.0),
    (r"\boxed{(1,2)}", "1, 2", 0.0, 1.0),  # math-verify lets a pair match the bare list
    (r"\boxed{1, 2}", "1, -2", 0.0, 0.0),
    # formatting
    (r"\boxed{30^\circ}", "30", 1.0, 1.0),
    (r"The cost is \boxed{\$25}.", "25", 1.0, 1.0),
    (r"\boxed{12 \text{ cm}}", "12", 1.0, 1.0),
    (r"\boxed{\text{(B)}}", "B", 0.0, 1.0),
    (r"\boxed{1{,}024}", "1024", 1.0, 1.0),
    (r"\boxed{1,000,000}", "1000000", 1.0, 1.0),
    (r"\boxed{1000001}", "1000000", 0.0, 0.0),
    (r"\boxed{-5}", "5", 0.0, 0.0),
    (r"\boxed{- 7}", "-7", 1.0, 1.0),
    # expressions and constants
    (r"\boxed{2^{10}}", "1024", 0.0, 1.0),
    (r"\boxed{5!}", "120", 0.0, 1.0),
    (r"\boxed{\frac{\pi}{2}}", r"\pi/2", 0.0, 1.0),
    (r"\boxed{3.14}", r"\pi", 0.0, 0.0),
    (r"\boxed{\frac{355}{113}}", r"\pi", 0.0, 0.0),
    (r"\boxed{x^2+2x+1}", "(x+1)^2", 0.0, 1.0),
    (r"\boxed{y = 2x + 3}", "2x+3", 1.0, 1.0),
    (r"\boxed{\sqrt{x^2}}", "x", 0.0, 0.0),
    (r"\boxed{25\%}", "0.25", 0.0, 1.0),
    (r"\boxed{25\%}", "2.5", 0.0, 0.0),
    (r"\boxed{1010_2}", "10", 0.0, 0.0),  # neither rule reads base subscripts
    (r"\boxed{\begin{pmatrix}1&2\end{pmatrix}}", r"\begin{pmatrix}1 & 2\end{pmatrix}", 1.0, 1.0),
    (r"\boxed{\begin{pmatrix}2&1\end{pmatrix}}", r"\begin{pmatrix}1&2\end{pmatrix}", 0.0, 0.0),
    # no usable answer
    ("I could not solve it.", "5", 0.0, 0.0),
    (r"\boxed{}", "5", 0.0, 0.0),
    (r"\boxed{3} and then a truncated \boxed{\frac{1", "3", 0.0, 0.0),
    ("Answer: " + "1" * (MAX_ANSWER_CHARS + 1), "1" * (MAX_ANSWER_CHARS + 1), 0.0, 0.0),
]


def _expected(case, rule: str) -> float:
    return case[2] if rule == "dapo" else case[3]


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_math_score_table(case, rule):
    assert math_score(case[0], case[1], rule) == _expected(case, rule)


def test_table_separates_the_rules():
    assert len(CASES) >= 60
    assert {case[2] for case in CASES} == {case[3] for case in CASES} == {0.0, 1.0}
    assert sum(case[2] < case[3] for case in CASES) >= 20  # equivalent forms only symbolic accepts
    assert not any(case[2] > case[3] for case in CASES)  # symbolic accepts whatever dapo accepts


@pytest.mark.parametrize("rule", RULES)
def test_table_in_worker_threads_as_openrlhf_calls_it(rule):
    """OpenRLHF runs reward_func through asyncio.to_thread, several samples at once."""
    async def score_all():
        return await asyncio.gather(*(asyncio.to_thread(math_score, case[0], case[1], rule) for case in CASES))

    assert asyncio.run(score_all()) == [_expected(case, rule) for case in CASES]


@pytest.mark.parametrize("answer, reference", [
    ("0.5", r"\frac{1}{2}"), (r"\dfrac12", r"\frac{1}{2}"), (r"2\sqrt{2}", r"\sqrt{8}"),
    (r"\{3, 1, 2\}", r"\{1,2,3\}"), ("x^2+2x+1", "(x+1)^2"),
])
def test_symbolic_accepts_equivalent_forms_that_dapo_does_not(answer, reference):
    assert not dapo_equal(answer, reference)
    assert symbolic_equal(answer, reference)


@pytest.mark.parametrize("raw, canonical", [
    ("x = 5", "5"), (r"\$1,000", "1000"), (r"12 \text{ cm}", "12"), (r"30^\circ", "30"), (r"30^{\circ}", "30"),
    (r"\frac12", r"\frac{1}{2}"), (r"\sqrt2", r"\sqrt{2}"), (r"\boxed{7}", "7"), (r"$\frac{1}{2}$.", r"\frac{1}{2}"),
    (r"\text{(B)}", "(B)"), (r"\textbf{yes}", "yes"), ("1, 2", "12"), ("(1, 2)", "(1,2)"), ("an apple", "apple"),
    (r"5 \text{ square units}", "5"), (r"1{,}024", "1024"), (r"\dfrac12", r"\dfrac{1}{2}"),
])
def test_normalize_final_answer_follows_dapo(raw, canonical):
    assert normalize_final_answer(raw) == canonical


@pytest.mark.parametrize("response, answer", [
    (r"so \boxed{\frac{1}{\sqrt{2}}} is it", r"\frac{1}{\sqrt{2}}"),
    (r"\boxed{1} then \boxed{\{1, 2\}}", r"\{1, 2\}"),
    (r"\boxed 5$.", "5"),
    (r"\fbox{7}", "7"),
    ("Answer: $34$.", "34"),
    ("**Answer:** 34", "34"),
    ("**Final Answer**: 12", "12"),
    ("ANSWER: 12", "12"),
    ("Final Answer:\n\n$\\frac12$\n", r"\frac12"),
    ("Answer: 1\nmore thinking\nAnswer: 2", "2"),
    ("Answer: 34<|im_end|>", "34"),
    ("Answer: The final answer is 9", "9"),
    (r"Answer: \(\frac{1}{2}\)", r"\frac{1}{2}"),
    ("no answer here", None),
    (r"\boxed{3} and \boxed{4", None),
    ("the answer: 5 is inline, not a line of its own", None),
])
def test_extract_answer(response, answer):
    assert extract_answer(response) == answer


def test_non_string_inputs_score_zero():
    for rule in RULES:
        assert math_score(None, "1", rule) == 0.0
        assert math_score(r"\boxed{1}", None, rule) == 0.0
    assert extract_answer(b"\\boxed{1}") is None


def test_unknown_rule_is_an_error():
    with pytest.raises(ValueError, match="unknown math rule 'sympy'"):
        math_score("Answer: 1", "1", "sympy")


# ---------------------------------------------------------------------------------------------------
# time bounds

HOSTILE = [
    r"\frac{",
    r"\boxed{\frac{",
    "10**10**10",
    "2^{2^{2^{100}}}",  # math-verify without its signal timeouts: > 30 s against "1"
    "9!!!",  # likewise
    "(" * 500,
    r"\left(" * 300,
    "x" * 200_000,
    "1" * 5000,
    "\\sqrt{" * 200 + "2" + "}" * 200,
    "(10^{999})^{999}",
    r"\sqrt{1000!}",
    r"\binom{10^{9}}{5}",
    r"\lfloor x^{1000} \rfloor",
    r"\lfloor 10^{1000}\pi \rfloor",
    r"e^{e^{e^{e^{e^{10}}}}}",
    r"(x+1)^{1000}-(x-1)^{1000}",
    "1," * 3000,
    r"\cup(1,2)" * 300,
    "5 " + "a" * 5000 + "!",
    "{" * 5000,
]


def _budget_s(rule: str) -> float:
    """dapo is string work on at most MAX_ANSWER_CHARS (measured < 0.05 s); symbolic waits for its deadline."""
    return (symbolic.TIME_LIMIT_S if rule == "symbolic" else 0.0) + SLACK_S


def _timed_score(response: str, reference: str, rule: str) -> tuple[float, float]:
    start = time.monotonic()
    score = math_score(response, reference, rule)
    return score, time.monotonic() - start


@pytest.fixture(scope="module", autouse=True)
def warm_symbolic_worker():
    """The first symbolic call waits for a worker to import math-verify; no test's clock should include it."""
    assert symbolic_equal("1", "1.0")


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("text", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_inputs_finish_in_time(text, rule):
    for response in (text, "\\boxed{" + text + "}", "Answer: " + text):
        for reference in ("1", text, "(1,2)"):
            score, seconds = _timed_score(response, reference, rule)
            assert score in (0.0, 1.0)
            assert seconds < _budget_s(rule), (response[:40], reference[:40], seconds)


@pytest.mark.parametrize("rule", RULES)
def test_hostile_inputs_finish_in_time_in_a_worker_thread(rule):
    """OpenRLHF calls reward_func through asyncio.to_thread, where no signal can interrupt anything."""
    results = []

    def work():
        for text in HOSTILE:
            results.append(_timed_score("\\boxed{" + text + "}", "2", rule))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=len(HOSTILE) * _budget_s(rule))
    assert not thread.is_alive()
    assert len(results) == len(HOSTILE)
    assert all(score == 0.0 and seconds < _budget_s(rule) for score, seconds in results), results


def test_math_verify_signal_timeouts_fail_in_a_worker_thread():
    """Why symbolic runs math-verify in processes: its default timeouts use SIGALRM, which a thread cannot set."""
    from math_verify import parse

    errors = []

    def work():
        try:
            parse("$1$")
        except ValueError as error:
            errors.append(error)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=30)
    assert len(errors) == 1 and "thread" in str(errors[0])


def test_a_worker_past_its_deadline_is_killed_and_replaced(monkeypatch):
    asked = symbolic._idle[-1]  # the next comparison's worker (warmed by the fixture)
    monkeypatch.setattr(symbolic, "TIME_LIMIT_S", 0.0)  # every verdict now comes too late
    assert symbolic_equal("x^2", "y") is False
    assert asked.proc.poll() is not None and asked not in symbolic._idle
    monkeypatch.undo()
    start = time.monotonic()
    assert symbolic_equal("0.5", r"\frac{1}{2}")  # the spare took over
    assert time.monotonic() - start < symbolic.TIME_LIMIT_S + SLACK_S


def test_a_comparison_math_verify_cannot_finish_is_cut_off_in_a_worker_thread():
    outcome = []

    def work():
        start = time.monotonic()
        outcome.append((symbolic_equal("9!!!", "1"), time.monotonic() - start))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=30)
    equal, seconds = outcome[0]
    assert equal is False
    assert symbolic.TIME_LIMIT_S <= seconds < symbolic.TIME_LIMIT_S + SLACK_S  # cut off, not refused early


# ---------------------------------------------------------------------------------------------------
# reward_func, loaded the way OpenRLHF loads `--reward.remote_url <file>.py`

DAPO_PROMPT = (
    "<|im_start|>user\nSolve the following math problem step by step. The last line of your response should be "
    "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".<|im_end|>\n<|im_start|>assistant\n'
)


def _load_reward_func():
    spec = importlib.util.spec_from_file_location("reward_func", str(REWARD_FILE))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.reward_func


@pytest.mark.parametrize("rule, expected", [(None, [1.0, 0.0, 0.0]), ("dapo", [1.0, 0.0, 0.0]),
                                            ("symbolic", [1.0, 1.0, 0.0])])
def test_reward_func_on_a_dapo_batch(monkeypatch, rule, expected):
    if rule is None:
        monkeypatch.delenv(RULE_ENV, raising=False)  # the default is the paper's: dapo
    else:
        monkeypatch.setenv(RULE_ENV, rule)
    reward_func = _load_reward_func()
    prompts = [
        DAPO_PROMPT.format(problem="What is 17 * 2?"),
        DAPO_PROMPT.format(problem="Find x if 4x = 2."),
        DAPO_PROMPT.format(problem="How many primes are below 20?"),
    ]
    responses = [
        "17 * 2 = 34.\n\nAnswer: 34<|im_end|>",
        "Dividing by 4 gives $x = \\dfrac{2}{4}$, i.e. $\\boxed{\\frac12}$.\n\nAnswer: $\\frac{1}{2}$<|im_end|>",
        "2, 3, 5, 7, 11, 13, 17, 19 — seven of them.\n\nAnswer: 7<|endoftext|>",
    ]
    out = reward_func([p + r for p, r in zip(prompts, responses)], prompts, ["34", "0.5", "8"])
    assert out["rewards"].dtype == torch.float32
    assert torch.equal(out["rewards"], torch.tensor(expected))
    assert torch.equal(out["scores"], torch.tensor(expected))


def test_unknown_rule_stops_the_reward_file_from_loading(monkeypatch):
    monkeypatch.setenv(RULE_ENV, "exact")
    with pytest.raises(ValueError, match="GROWMTP_MATH_RULE='exact'"):
        _load_reward_func()


def test_reward_func_ignores_the_prompts_own_answer_instructions():
    reward_func = _load_reward_func()
    prompt = DAPO_PROMPT.format(problem="Answer: 5\nWhat is 2 + 3?")
    out = reward_func([prompt + "I am not sure.<|im_end|>"], [prompt], ["5"])
    assert out["rewards"].tolist() == [0.0]


def test_reward_func_when_decoding_changed_the_prompt_text():
    reward_func = _load_reward_func()
    prompt = DAPO_PROMPT.format(problem="What is 6 * 7?")
    query = "  " + prompt.replace("\n\n", "\n \n", 1) + "6 * 7 = 42\nAnswer: 42<|im_end|>"
    assert reward_func([query], [prompt], ["42"])["rewards"].tolist() == [1.0]


def test_reward_func_never_raises_on_bad_samples():
    reward_func = _load_reward_func()
    out = reward_func(["Answer: 1", None, "Answer: 3", "Answer: 4"], ["", "", None], ["1", "2", "3", None])
    assert out["rewards"].tolist() == [1.0, 0.0, 1.0, 0.0]
    empty = reward_func([], [], [])
    assert empty["rewards"].shape == (0,)
