"""The rule-based math reward: answer extraction, normalization, equivalence and OpenRLHF's reward_func."""

from __future__ import annotations

import importlib.util
import pathlib
import threading
import time

import pytest
import sympy
import torch

from openrlhf_growmtp.rewards import math_verify
from openrlhf_growmtp.rewards.math_verify import extract_answer, is_equiv, latex_to_sympy, math_score, normalize

REWARD_FILE = pathlib.Path(math_verify.__file__).with_name("math_reward.py")

# (response, reference, expected score)
CASES = [
    # fractions
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\dfrac12}", r"\frac{1}{2}", 1.0),
    ("Answer: 1/2", r"\frac{1}{2}", 1.0),
    ("Answer: 0.5", r"\frac{1}{2}", 1.0),
    ("Answer: .5", r"\frac12", 1.0),
    (r"\boxed{\tfrac{3}{4}}", "0.75", 1.0),
    (r"\boxed{-\frac{1}{2}}", r"\frac{-1}{2}", 1.0),
    (r"\boxed{2\frac{1}{2}}", r"\frac{5}{2}", 1.0),  # mixed number
    (r"\boxed{2/1}", "1/2", 0.0),
    (r"\boxed{0.333}", r"\frac{1}{3}", 0.0),
    # radicals
    (r"\boxed{\sqrt{3}/2}", r"\frac{\sqrt{3}}{2}", 1.0),
    (r"\boxed{\frac{\sqrt3}{2}}", r"\frac{\sqrt{3}}{2}", 1.0),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", 1.0),
    (r"\boxed{3\sqrt{2}}", r"\sqrt{18}", 1.0),
    (r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{\sqrt{2}}{2}", 1.0),
    (r"\boxed{\sqrt[3]{27}}", "3", 1.0),
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\sqrt{2}", 0.0),
    (r"\boxed{2\sqrt{3}}", r"3\sqrt{2}", 0.0),
    (r"\boxed{\sqrt{5+2\sqrt{6}}}", r"\sqrt{2}+\sqrt{3}", 1.0),
    (r"\boxed{e^{\pi\sqrt{163}}}", "640320^3+744", 0.0),  # differs by about 7.5e-13
    # intervals and unions
    (r"\boxed{[1, 2)}", "[1,2)", 1.0),
    (r"\boxed{[1,2]}", "(1,2]", 0.0),
    (r"\boxed{(-\infty, 3) \cup (5, \infty)}", r"(-\infty,3)\cup(5,\infty)", 1.0),
    (r"\boxed{(5, \infty) \cup (-\infty, 3)}", r"(-\infty,3)\cup(5,\infty)", 1.0),
    (r"\boxed{(-\infty, 3] \cup (5, \infty)}", r"(-\infty,3)\cup(5,\infty)", 0.0),
    (r"\boxed{\left[ \frac{1}{2}, 3 \right)}", "[0.5,3)", 1.0),
    (r"\boxed{(0, \infty)}", r"(0,+\infty)", 1.0),
    # sets and solution lists
    (r"\boxed{\{3, 1, 2\}}", r"\{1,2,3\}", 1.0),
    (r"\boxed{\{1, 2\}}", r"\{1,2,3\}", 0.0),
    (r"\boxed{x = 2, 1}", "1, 2", 1.0),
    (r"\boxed{x=1 \text{ or } x=-3}", "-3, 1", 1.0),
    (r"\boxed{1, 2}", "1, -2", 0.0),
    (r"\boxed{x=1, y=2}", "y=2, x=1", 1.0),
    (r"\boxed{x=2, y=1}", "x=1, y=2", 0.0),
    # tuples
    (r"\boxed{(1, 2)}", "(1,2)", 1.0),
    (r"\boxed{(2, 1)}", "(1,2)", 0.0),
    (r"\boxed{\left( \frac{1}{2}, -3 \right)}", "(0.5,-3)", 1.0),
    (r"\boxed{(1,2)}", "1, 2", 0.0),
    # LaTeX and formatting variants
    (r"\boxed{30^\circ}", "30", 1.0),
    (r"\boxed{30^{\circ}}", "30", 1.0),
    (r"The cost is \boxed{\$25}.", "25", 1.0),
    (r"\boxed{\text{(B)}}", "B", 1.0),
    (r"\boxed{12 \text{ cm}}", "12", 1.0),
    (r"\boxed{\frac{1}{1+\frac{1}{2}}}", r"\frac{2}{3}", 1.0),
    (r"\boxed{2^{10}}", "1024", 1.0),
    ("Answer: 34", "34", 1.0),
    ("**Answer:** $34$.", "34", 1.0),
    ("Final Answer: 34", "34", 1.0),
    (r"First \boxed{3}, but correcting that: \boxed{4}", "4", 1.0),
    (r"First \boxed{3}, but correcting that: \boxed{4}", "3", 0.0),
    ("\\boxed{4}\nAnswer: 3", "4", 1.0),
    # large integers and signs
    (r"\boxed{1,000,000}", "1000000", 1.0),
    ("Answer: 12,345", "12345", 1.0),
    (r"\boxed{1{,}024}", "1024", 1.0),
    (r"\boxed{1000001}", "1000000", 0.0),
    (r"\boxed{-5}", "5", 0.0),
    (r"\boxed{-5}", "-5", 1.0),
    (r"\boxed{- 7}", "-7", 1.0),
    # pi
    (r"\boxed{2\pi}", r"2\pi", 1.0),
    (r"\boxed{\frac{\pi}{2}}", r"\pi/2", 1.0),
    (r"\boxed{\pi r^2}", r"r^2\pi", 1.0),
    (r"\boxed{3.14}", r"\pi", 0.0),
    (r"\boxed{6.2832}", r"2\pi", 0.0),
    (r"\boxed{\frac{355}{113}}", r"\pi", 0.0),
    (r"\boxed{10^{20}\sqrt{2}+1}", r"10^{20}\sqrt{2}", 0.0),
    # percent
    (r"\boxed{25\%}", "25", 1.0),
    (r"\boxed{25\%}", "0.25", 1.0),
    (r"\boxed{25\%}", "2.5", 0.0),
    ("Answer: 40%", "40", 1.0),
    # symbolic and other notations
    (r"\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    (r"\boxed{y = 2x + 3}", "2x+3", 1.0),
    (r"\boxed{\sqrt{x^2}}", "x", 0.0),
    (r"\boxed{1010_2}", "10", 1.0),
    (r"\boxed{e^{i\pi}}", "-1", 1.0),
    (r"\boxed{5!}", "120", 1.0),
    (r"\boxed{\begin{pmatrix}1&2\end{pmatrix}}", r"\begin{pmatrix}1 & 2\end{pmatrix}", 1.0),
    (r"\boxed{\begin{pmatrix}2&1\end{pmatrix}}", r"\begin{pmatrix}1&2\end{pmatrix}", 0.0),
    # no usable answer
    ("I could not solve it.", "5", 0.0),
    (r"\boxed{}", "5", 0.0),
    (r"\boxed{3} and then a truncated \boxed{\frac{1", "3", 0.0),
]


@pytest.mark.parametrize("response, reference, expected", CASES)
def test_math_score_table(response, reference, expected):
    assert math_score(response, reference) == expected


def test_table_is_large_and_has_both_outcomes():
    assert len(CASES) >= 40
    assert {expected for _, _, expected in CASES} == {0.0, 1.0}


@pytest.mark.parametrize(
    "response, answer",
    [
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
        ("no answer here", None),
        (r"\boxed{3} and \boxed{4", None),
        ("the answer: 5 is inline, not a line of its own", None),
    ],
)
def test_extract_answer(response, answer):
    assert extract_answer(response) == answer


@pytest.mark.parametrize(
    "raw, canonical",
    [
        ("5 cm", "5"),
        ("12 square units", "12"),
        ("1,000", "1000"),
        (r"\$1,000", "1000"),
        ("(1,2)", "(1,2)"),
        ("(1, 000)", "(1,000)"),
        (r"\dfrac12", r"\frac{1}{2}"),
        (r"\frac{\frac12}{3}", r"\frac{\frac{1}{2}}{3}"),
        (r"\sqrt2", r"\sqrt{2}"),
        ("x = 5", "5"),
        (r"\theta = \frac{\pi}{4}", r"\frac{\pi}{4}"),
        (r"x \le 5", r"x\le5"),
        (r"\left( 1, 2 \right)", "(1,2)"),
        (r"30^\circ", "30"),
        (r"\text{yes}", "yes"),
        (r"$\frac{1}{2}$.", r"\frac{1}{2}"),
        (r"2 \pi r", r"2\pi r"),
        (r"\boxed{7}", "7"),
        (".5", "0.5"),
        (r"1\,000\,000", "1000000"),
        (r"\varnothing", r"\emptyset"),
    ],
)
def test_normalize(raw, canonical):
    assert normalize(raw) == canonical


@pytest.mark.parametrize(
    "latex, value",
    [
        (r"\frac{1}{2}", sympy.Rational(1, 2)),
        (r"\frac12", sympy.Rational(1, 2)),
        (r"\sqrt[3]{8}", sympy.Integer(2)),
        (r"\sqrt[3]{-8}", sympy.Integer(-2)),
        (r"2\pi", 2 * sympy.pi),
        (r"3\sqrt{2}", 3 * sympy.sqrt(2)),
        (r"-2^2", sympy.Integer(-4)),
        ("2**3**2", sympy.Integer(512)),
        (r"50\%", sympy.Rational(1, 2)),
        ("i^2", sympy.Integer(-1)),
        (r"-\infty", -sympy.oo),
        ("1.25", sympy.Rational(5, 4)),
        (r"(1+2)\cdot[3]", sympy.Integer(9)),
        (r"2\times3\div4", sympy.Rational(3, 2)),
        (r"\left(1+1\right)^{3}", sympy.Integer(8)),
        ("x_1+x_{1}", 2 * sympy.Symbol("x_1")),
        (r"\log_2 8", sympy.Integer(3)),
        (r"|-3|", sympy.Integer(3)),
        (r"\lfloor 2.5 \rfloor", sympy.Integer(2)),
        (r"\binom{5}{2}", sympy.Integer(10)),
        ("2e", 2 * sympy.E),
    ],
)
def test_latex_to_sympy_values(latex, value):
    assert latex_to_sympy(latex) == value


@pytest.mark.parametrize(
    "latex",
    [r"\frac{", "1+", r"\foo{2}", "(1,2)", r"\{1\}", "2^{2^{2^{100}}}", "10**10**10", r"\frac{1}{0}",
     "1010_1", "x_", r"\lfloor x \rfloor", "1000!!", "1.2.3", ""],
)
def test_latex_to_sympy_refuses(latex):
    assert latex_to_sympy(latex) is None


HOSTILE = [
    r"\frac{",
    r"\boxed{\frac{",
    "10**10**10",
    "2^{2^{2^{100}}}",
    "9!!!",
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


def _timed_score(response: str, reference: str) -> tuple[float, float]:
    start = time.monotonic()
    score = math_score(response, reference)
    return score, time.monotonic() - start


@pytest.mark.parametrize("text", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_inputs_finish_quickly(text):
    for response in (text, "\\boxed{" + text + "}", "Answer: " + text):
        for reference in ("1", text, "(1,2)"):
            score, seconds = _timed_score(response, reference)
            assert score in (0.0, 1.0)
            assert seconds < 2.0


def test_hostile_inputs_finish_quickly_in_a_worker_thread():
    """OpenRLHF calls reward_func through asyncio.to_thread, where SIGALRM cannot interrupt anything."""
    results = []

    def work():
        for text in HOSTILE:
            results.append(_timed_score("\\boxed{" + text + "}", "2"))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert len(results) == len(HOSTILE)
    assert all(score == 0.0 and seconds < 2.0 for score, seconds in results)


def test_non_string_inputs_score_zero():
    assert math_score(None, "1") == 0.0
    assert math_score(r"\boxed{1}", None) == 0.0
    assert is_equiv(None, "1") is False
    assert extract_answer(b"\\boxed{1}") is None


def test_slow_comparison_is_cut_off_in_main_thread(monkeypatch):
    def never_ending(a, b, loose):
        time.sleep(30)
        return True

    monkeypatch.setattr(math_verify, "_sympy_equal", never_ending)
    start = time.monotonic()
    assert is_equiv("x+1", "1+x") is False
    assert time.monotonic() - start < 2.0 + math_verify.TIME_LIMIT_S


def test_slow_comparisons_are_cut_off_in_a_worker_thread(monkeypatch):
    def slow_mismatch(a, b, loose):
        time.sleep(0.2)
        return False

    monkeypatch.setattr(math_verify, "_sympy_equal", slow_mismatch)
    many = ", ".join(f"x+{k}" for k in range(20))  # 20 elements: 20 slow comparisons before a mismatch
    outcome = []

    def work():
        start = time.monotonic()
        outcome.append((is_equiv(many, many.replace("x", "y")), time.monotonic() - start))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=30)
    equal, seconds = outcome[0]
    assert equal is False
    assert seconds < math_verify.TIME_LIMIT_S + 1.0


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


def test_reward_func_on_a_dapo_batch():
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
    labels = ["34", "0.5", "8"]
    out = reward_func([p + r for p, r in zip(prompts, responses)], prompts, labels)
    expected = torch.tensor([1.0, 1.0, 0.0])
    assert out["rewards"].dtype == torch.float32
    assert torch.equal(out["rewards"], expected)
    assert torch.equal(out["scores"], expected)


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
