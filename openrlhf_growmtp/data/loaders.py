"""Turn the paper's datasets into OpenRLHF prompt rows, and read held-out benchmarks the same way.

Output row (every converter): `{"id": str, "prompt": [{"role": "user", "content": str}], "label": str}`.
Math labels are the reference answer; code labels are `json.dumps({"inputs": [str], "outputs": [str]})`
with stdin/stdout tests, plus `"fn_name"` for LeetCode's call-based tests (see `rewards.code.label`).
Converters take any iterable of mapping rows (from `sources.load_rows`/`iter_rows`, a `datasets.Dataset`,
or a list) and raise `MissingFieldError` naming the field and the row index when a required column is absent.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

from openrlhf_growmtp.data.lcb_tests import decode_lcb_private_tests
from openrlhf_growmtp.rewards.code.label import code_label, parse_label

# The instruction DAPO-Math-17k wraps around every problem; the benchmarks reuse it so eval prompts match training.
DAPO_MATH_PREFIX = ("Solve the following math problem step by step. The last line of your response should be of "
                    "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n")
DAPO_MATH_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'

# Appended to every stdin/stdout coding problem (TACO-Verified for training, LiveCodeBench for evaluation).
CODE_STDIN_INSTRUCTION = ("Write a complete Python 3 program that solves the problem above. The program must read "
                          "its input from standard input and write its answer to standard output. Put the whole "
                          "program in a single ```python code block.")

# Follows a LeetCode problem, whose tests call a method of the starter code's class instead of using stdin.
CODE_CALL_INSTRUCTION = ("Complete the starter code below so that it solves the problem above. Put the whole "
                         "solution, including the class and method signature of the starter code, in a single "
                         "```python code block.")

DEFAULT_MAX_TESTS = 20
LCB_PLATFORMS = ("atcoder", "leetcode", "codeforces")

# Column aliases the public copies of the math benchmarks use (HuggingFaceH4/aime_2024: problem/answer/id;
# Maxwell-Jia/AIME_2024: Problem/Answer/ID; math-ai/amc23: question/answer/id; MathArena: problem/answer/problem_idx).
PROBLEM_KEYS = ("problem", "question", "Problem", "Question")
ANSWER_KEYS = ("answer", "Answer")
ID_KEYS = ("id", "ID", "problem_idx", "idx", "unique_id")


class RowFormatError(ValueError):
    """A row that a converter cannot read."""


class MissingFieldError(RowFormatError):
    """A required column is absent (or null) in a row; names the field and the row's index."""

    def __init__(self, field: str, index: int, dataset: str):
        self.field, self.index, self.dataset = field, index, dataset
        super().__init__(f"{dataset}: row {index} has no {field!r} field")


# ---------------------------------------------------------------------------------------------- shared helpers


def _as_mapping(row: Any, index: int, dataset: str) -> Mapping:
    """The row itself, checked to be a mapping."""
    if not isinstance(row, Mapping):
        raise RowFormatError(f"{dataset}: row {index} is a {type(row).__name__}, not an object")
    return row


def _require(row: Mapping, field: str, index: int, dataset: str) -> Any:
    """`row[field]`, raising MissingFieldError when it is absent or null."""
    value = row.get(field)
    if value is None:
        raise MissingFieldError(field, index, dataset)
    return value


def _first_of(row: Mapping, keys: tuple[str, ...]) -> Any:
    """The value of the first of `keys` present and non-null in `row`, else None."""
    for key in keys:
        if row.get(key) is not None:
            return row[key]
    return None


# OpenRLHF's PromptDataset turns every "<image>" in a chat message into an image part (its VLM path), and a
# text-only chat template such as Qwen3's then renders the whole message as "". TACO's Codeforces statements
# keep "<image>" where a formula picture was, so prompts write it as "[image]".
IMAGE_TAG, IMAGE_STANDIN = "<image>", "[image]"


def _text_only(content: str) -> str:
    """`content` with OpenRLHF's image tag replaced by a plain-text stand-in."""
    return content.replace(IMAGE_TAG, IMAGE_STANDIN)


def _user(content: str) -> list[dict]:
    """A one-message chat prompt."""
    return [{"role": "user", "content": _text_only(content)}]


def _answer_text(value: Any) -> str:
    """A reference answer as a string: integral floats lose their `.0` (some copies store 27.0 for 27)."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return str(int(value))
    return str(value).strip()


def _test_text(value: Any) -> str | None:
    """One test's input or output as text: a string, or a list of line strings joined by newlines; else None."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(line, str) for line in value):
        return "\n".join(value)
    return None


def code_prompt(question: str) -> list[dict]:
    """A coding problem statement followed by the stdin/stdout instruction, as a chat prompt."""
    return _user(f"{question.strip()}\n\n{CODE_STDIN_INSTRUCTION}")


def code_call_prompt(question: str, starter_code: str) -> list[dict]:
    """A call-based coding problem followed by the instruction and its starter code, as a chat prompt."""
    return _user(f"{question.strip()}\n\n{CODE_CALL_INSTRUCTION}\n\n```python\n{starter_code.rstrip()}\n```")


def math_prompt(problem: str) -> list[dict]:
    """A math problem wrapped in DAPO-Math-17k's own instruction, as a chat prompt."""
    return _user(f"{DAPO_MATH_PREFIX}{problem.strip()}{DAPO_MATH_SUFFIX}")


# ---------------------------------------------------------------------------------------------- DAPO-Math-17k


def _dapo_messages(prompt: Any, index: int) -> list[dict]:
    """DAPO's `prompt` as chat messages: a list of `{"role", "content"}` dicts (a string is one user turn)."""
    if isinstance(prompt, str):
        return _user(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(m, Mapping) and isinstance(m.get("content"), str)
                                                   for m in prompt):
        return [{"role": str(m.get("role") or "user"), "content": _text_only(m["content"])} for m in prompt]
    raise RowFormatError(f"dapo-math: row {index} has a 'prompt' that is neither text nor a list of messages")


def dapo_math_rows(rows: Iterable[Mapping]) -> list[dict]:
    """DAPO-Math-17k (`BytedTsinghua-SIA/DAPO-Math-17k`) as prompt rows, one per distinct problem.

    Expected row layout:
        data_source: str                       ("math_dapo")
        prompt: [{"role": "user", "content": str}]   content already holds DAPO's "Answer: $Answer" instruction
        ability: str                           ("MATH")
        reward_model: {"ground_truth": str, "style": "rule-lm"}
        extra_info: {"index": str}             a uuid per problem
    The published parquet repeats every problem (~1.79M rows for ~17k problems): rows are de-duplicated by
    `extra_info.index` (by the prompt text when there is no index), keeping first-seen order. The prompt
    is kept as given (OpenRLHF's image tag aside, see `IMAGE_TAG`); the label is `reward_model.ground_truth`;
    the id is the index.
    """
    out: list[dict] = []
    seen: set[str] = set()
    for index, row in enumerate(rows):
        row = _as_mapping(row, index, "dapo-math")
        messages = _dapo_messages(_require(row, "prompt", index, "dapo-math"), index)
        reward_model = _require(row, "reward_model", index, "dapo-math")
        truth = reward_model.get("ground_truth") if isinstance(reward_model, Mapping) else None
        if truth is None:
            raise MissingFieldError("reward_model.ground_truth", index, "dapo-math")
        extra = row.get("extra_info")
        problem_index = extra.get("index") if isinstance(extra, Mapping) else None
        key = str(problem_index) if problem_index is not None else "\n".join(m["content"] for m in messages)
        if key in seen:
            continue
        seen.add(key)
        ident = str(problem_index) if problem_index is not None else f"dapo-{index}"
        out.append({"id": ident, "prompt": messages, "label": _answer_text(truth)})
    return out


# ---------------------------------------------------------------------------------------------- TACO-Verified


def _stdin_tests(spec: Any, max_tests: int | None) -> tuple[list[str], list[str]] | str:
    """Tests from a parsed TACO `input_output`, or the reason they are unusable.

    `spec` is `{"inputs": [...], "outputs": [...]}` (call-based problems add `"fn_name"`); inputs and
    outputs are strings, or lists of line strings which are joined with newlines. Returns
    (inputs, outputs) capped at `max_tests`, or "call_based" / "no_tests" / "malformed".
    """
    if not isinstance(spec, Mapping):
        return "malformed"
    if spec.get("fn_name"):
        return "call_based"
    inputs, outputs = spec.get("inputs") or [], spec.get("outputs") or []
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
        return "malformed"
    if not inputs:
        return "no_tests"
    ins, outs = [_test_text(v) for v in inputs], [_test_text(v) for v in outputs]
    if any(v is None for v in ins + outs):
        return "malformed"
    if max_tests is not None:
        ins, outs = ins[:max_tests], outs[:max_tests]
    return ins, outs


def taco_verified_rows(rows: Iterable[Mapping], max_tests: int | None = DEFAULT_MAX_TESTS
                       ) -> tuple[list[dict], dict]:
    """TACO-Verified (`likaixin/TACO-verified`, BAAI/TACO's schema) as stdin/stdout prompt rows, plus counts.

    Expected row layout (all strings):
        question: the statement          input_output: JSON `{"inputs": [...], "outputs": [...]}`, with
        solutions: JSON list of code         `"fn_name"` for call-based problems; may be empty
        starter_code, difficulty, source, url, time_limit, memory_limit, date, ... (unused); `id` if present
    Kept: problems without `fn_name` that have at least one test whose input and output are strings (or lists
    of lines, joined with "\\n"), capped at `max_tests` tests (None: all). Skipped rows are counted in the
    returned stats `{"kept", "call_based", "no_tests", "malformed"}`; unparsable `input_output` JSON is
    "malformed", never an exception. The id is the row's `id` when present, else `taco-<row index>`.
    """
    stats = {"kept": 0, "call_based": 0, "no_tests": 0, "malformed": 0}
    out: list[dict] = []
    for index, row in enumerate(rows):
        row = _as_mapping(row, index, "taco-verified")
        question = _require(row, "question", index, "taco-verified")
        if "input_output" not in row:
            raise MissingFieldError("input_output", index, "taco-verified")
        raw = row["input_output"]
        if raw is None or (isinstance(raw, str) and not raw.strip()):
            stats["no_tests"] += 1
            continue
        try:
            spec = json.loads(raw) if isinstance(raw, str) else raw
        except (json.JSONDecodeError, RecursionError):
            stats["malformed"] += 1
            continue
        tests = _stdin_tests(spec, max_tests)
        if isinstance(tests, str):
            stats[tests] += 1
            continue
        ident = str(row["id"]) if row.get("id") is not None else f"taco-{index}"
        out.append({"id": ident, "prompt": code_prompt(str(question)), "label": code_label(*tests)})
        stats["kept"] += 1
    return out, stats


# ---------------------------------------------------------------------------------------------- math benchmarks


def math_benchmark_rows(rows: Iterable[Mapping], name: str) -> list[dict]:
    """A problem/answer math benchmark as prompt rows with DAPO's instruction and the answer as label.

    Expected row layout: the statement in one of `problem` / `question` / `Problem` / `Question`, the answer
    in `answer` / `Answer` (string or number), an optional id in `id` / `ID` / `problem_idx` / `idx` /
    `unique_id` (else `<name>-<row index>`). Other columns (solution, url, year) are ignored.
    """
    out = []
    for index, row in enumerate(rows):
        row = _as_mapping(row, index, name)
        problem = _first_of(row, PROBLEM_KEYS)
        if problem is None:
            raise MissingFieldError(" / ".join(PROBLEM_KEYS), index, name)
        answer = _first_of(row, ANSWER_KEYS)
        if answer is None:
            raise MissingFieldError(" / ".join(ANSWER_KEYS), index, name)
        ident = _first_of(row, ID_KEYS)
        out.append({"id": f"{name}-{index}" if ident is None else str(ident),
                    "prompt": math_prompt(str(problem)), "label": _answer_text(answer)})
    return out


def amc23_rows(rows: Iterable[Mapping]) -> list[dict]:
    """AMC 2023 (e.g. `math-ai/amc23`: id, question, answer, url) as prompt rows; see `math_benchmark_rows`."""
    return math_benchmark_rows(rows, "amc23")


def aime24_rows(rows: Iterable[Mapping]) -> list[dict]:
    """AIME 2024 (e.g. `HuggingFaceH4/aime_2024`: id, problem, solution, answer, url, year) as prompt rows."""
    return math_benchmark_rows(rows, "aime24")


def aime25_rows(rows: Iterable[Mapping]) -> list[dict]:
    """AIME 2025 (e.g. `math-ai/aime25`: problem, answer, id; `opencompass/AIME2025`: question, answer)."""
    return math_benchmark_rows(rows, "aime25")


# ---------------------------------------------------------------------------------------------- LiveCodeBench

def _lcb_pairs(tests: list, testtype: str) -> list[tuple[str, str]]:
    """(input, output) of the tests of `testtype` ("stdin" or "functional") with string input and output."""
    return [(t["input"], t["output"]) for t in tests
            if isinstance(t, Mapping) and t.get("testtype") == testtype
            and isinstance(t.get("input"), str) and isinstance(t.get("output"), str)]


def _lcb_function_name(metadata: Any) -> str | None:
    """`func_name` from a LiveCodeBench row's `metadata` (JSON text such as '{"func_name": "maxSum"}')."""
    try:
        parsed = json.loads(metadata) if isinstance(metadata, str) else metadata
    except json.JSONDecodeError:
        return None
    name = parsed.get("func_name") if isinstance(parsed, Mapping) else None
    return name if isinstance(name, str) and name.isidentifier() else None


def _lcb_row(row: Mapping, tests: list, max_tests: int | None) -> dict | str:
    """A LiveCodeBench problem's prompt and label, or why it has none: "no_tests" / "malformed".

    A problem with functional tests and a `func_name` becomes a call-based row whose prompt shows the
    starter code (its label must pass `parse_label`); any other keeps its stdin tests.
    Functional tests without a function name, and no stdin tests, are "malformed".
    """
    fn_name = _lcb_function_name(row.get("metadata"))
    functional, stdin = _lcb_pairs(tests, "functional"), _lcb_pairs(tests, "stdin")
    call_based = bool(functional) and fn_name is not None
    pairs = (functional if call_based else stdin)[:max_tests]
    if not pairs:
        return "malformed" if functional else "no_tests"
    label = code_label([i for i, _ in pairs], [o for _, o in pairs], fn_name if call_based else None)
    content = str(row["question_content"])
    if not call_based:
        return {"prompt": code_prompt(content), "label": label}
    try:
        parse_label(label)
    except ValueError:
        return "malformed"
    return {"prompt": code_call_prompt(content, str(row.get("starter_code") or "")), "label": label}


def livecodebench_rows_and_stats(rows: Iterable[Mapping], platform: str | None = None,
                                 max_tests: int | None = None, allow_pickled_str: bool = False
                                 ) -> tuple[list[dict], dict]:
    """LiveCodeBench code_generation_lite (e.g. release v6) as prompt rows, plus counts.

    Expected row layout (all strings; the prompt is `question_content`, as in LiveCodeBench's own prompts):
        question_title, question_content, platform ("atcoder" | "leetcode" | "codeforces"), question_id,
        contest_id, contest_date, difficulty,
        starter_code: LeetCode's class and method signature ("" elsewhere),
        metadata: JSON text, '{"func_name": "..."}' for LeetCode problems,
        public_test_cases: JSON list of {"input": str, "output": str, "testtype": "stdin" | "functional"}
        private_test_cases: the same list, plain JSON or compressed (see `decode_lcb_private_tests`)
    AtCoder and Codeforces problems keep their `stdin` tests; LeetCode problems are `functional`: each input
    is one JSON argument per line, each output the JSON return value, and their rows are call-based (the
    label names `func_name`, the prompt shows the starter code). Public tests come first, then private,
    capped at `max_tests` (None: all). Rows of other platforms than `platform` (when given) are skipped.
    Stats: {"kept", "call_based" (of those kept), "other_platform", "no_tests", "malformed" (public tests
    unreadable, or only functional tests but no function name, or non-JSON values), "private_undecoded"
    (kept on public tests only)}.
    """
    if platform is not None and platform not in LCB_PLATFORMS:
        raise ValueError(f"unknown LiveCodeBench platform {platform!r} (one of {', '.join(LCB_PLATFORMS)})")
    stats = {"kept": 0, "call_based": 0, "other_platform": 0, "no_tests": 0, "malformed": 0,
             "private_undecoded": 0}
    out: list[dict] = []
    for index, row in enumerate(rows):
        row = _as_mapping(row, index, "livecodebench")
        _require(row, "question_content", index, "livecodebench")
        row_platform = str(_require(row, "platform", index, "livecodebench")).lower()
        ident = _require(row, "question_id", index, "livecodebench")
        public_raw = _require(row, "public_test_cases", index, "livecodebench")
        if platform is not None and row_platform != platform:
            stats["other_platform"] += 1
            continue
        try:
            public = json.loads(public_raw) if isinstance(public_raw, str) else public_raw
        except json.JSONDecodeError:
            public = None
        if not isinstance(public, list):
            stats["malformed"] += 1
            continue
        private = decode_lcb_private_tests(row.get("private_test_cases"), allow_pickled_str)
        if private is None:
            stats["private_undecoded"] += 1
            private = []
        converted = _lcb_row(row, public + private, max_tests)
        if isinstance(converted, str):
            stats[converted] += 1
            continue
        out.append({"id": str(ident), **converted})
        stats["kept"] += 1
        stats["call_based"] += int("fn_name" in json.loads(converted["label"]))
    return out, stats
