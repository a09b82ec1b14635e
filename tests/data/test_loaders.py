"""Data loaders and the prepare_data CLI on small local fixtures laid out like the real datasets."""

from __future__ import annotations

import base64
import json
import pickle
import subprocess
import sys
import zlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from openrlhf_growmtp.cli import prepare_data
from openrlhf_growmtp.data import lcb_tests, loaders, sources
from openrlhf_growmtp.rewards.code_reward import code_score

ROOT = Path(__file__).resolve().parents[2]


def livecodebench_rows(rows, platform=None, max_tests=None, allow_pickled_str=False) -> list[dict]:
    """LiveCodeBench rows without the counts (`loaders.livecodebench_rows_and_stats`)."""
    return loaders.livecodebench_rows_and_stats(rows, platform, max_tests, allow_pickled_str)[0]


# ------------------------------------------------------------------------------------------------ fixtures


def dapo_row(index: str, problem: str, answer: str) -> dict:
    """One DAPO-Math-17k row, in the published parquet's layout."""
    content = f"{loaders.DAPO_MATH_PREFIX}{problem}{loaders.DAPO_MATH_SUFFIX}"
    return {"data_source": "math_dapo", "prompt": [{"content": content, "role": "user"}], "ability": "MATH",
            "reward_model": {"ground_truth": answer, "style": "rule-lm"}, "extra_info": {"index": index}}


@pytest.fixture
def dapo_parquet(tmp_path: Path) -> Path:
    """Three problems, each repeated like the published file (a, b, a, c, b, a, ...)."""
    problems = [("uuid-a", "What is 1+1?", "2"), ("uuid-b", "What is 2+3?", "5"), ("uuid-c", "What is 3*3?", "9")]
    order = [0, 1, 0, 2, 1, 0, 2, 2, 1]
    path = tmp_path / "dapo-math-17k.parquet"
    pq.write_table(pa.Table.from_pylist([dapo_row(*problems[i]) for i in order]), path)
    return path


def taco_row(question: str, input_output, **extra) -> dict:
    """One TACO-Verified row (BAAI/TACO schema: every field a string)."""
    row = {"question": question, "solutions": json.dumps(["print(input())"]), "starter_code": "",
           "input_output": input_output if isinstance(input_output, str) else json.dumps(input_output),
           "difficulty": "EASY", "raw_tags": "[]", "name": None, "source": "codeforces", "tags": "[]",
           "skill_types": "[]", "url": "https://codeforces.com/problemset/problem/1/A",
           "Expected Auxiliary Space": None,
           "time_limit": "1 second", "date": "2010-01-01", "picture_num": "0", "memory_limit": "256 megabytes",
           "Expected Time Complexity": None}
    row.update(extra)
    return row


@pytest.fixture
def taco_rows() -> list[dict]:
    return [
        taco_row("Echo the number.", {"inputs": ["1\n", "2\n", "3\n"], "outputs": ["1\n", "2\n", "3\n"]}, id="t-echo"),
        taco_row("Call-based.", {"fn_name": "solve", "inputs": [[1, 2]], "outputs": [3]}),
        taco_row("Broken JSON.", '{"inputs": ["1\\n"], "outputs": '),
        taco_row("Lines.", {"inputs": [["3", "1 2 3"]], "outputs": [["6"]]}),
        taco_row("No tests.", {"inputs": [], "outputs": []}),
        taco_row("Not text.", {"inputs": [1], "outputs": [2]}),
    ]


def lcb_compress(tests: list[dict]) -> str:
    """base64(zlib(JSON)): the private-test encoding the loader decodes."""
    return base64.b64encode(zlib.compress(json.dumps(tests).encode())).decode()


def lcb_row(qid: str, platform: str, public: list[dict], private: str = "", metadata: str = "{}",
            starter_code: str = "") -> dict:
    """One LiveCodeBench code_generation_lite row."""
    return {"question_title": f"Title {qid}", "question_content": f"Statement of {qid}.", "platform": platform,
            "question_id": qid, "contest_id": "abc400", "contest_date": "2025-04-05T00:00:00",
            "starter_code": starter_code, "difficulty": "easy", "public_test_cases": json.dumps(public),
            "private_test_cases": private, "metadata": metadata}


STDIN = {"input": "1 2\n", "output": "3\n", "testtype": "stdin"}
PRIVATE = [{"input": "5 5\n", "output": "10\n", "testtype": "stdin"},
           {"input": "0 0\n", "output": "0\n", "testtype": "stdin"}]
# LeetCode: one JSON argument per input line, the JSON return value as output
FUNCTIONAL = {"input": "[1, 2]\n10", "output": "13", "testtype": "functional"}
PRIVATE_FUNCTIONAL = [{"input": "[]\n0", "output": "0", "testtype": "functional"},
                      {"input": "[-5, 5, 7]\n-1", "output": "6", "testtype": "functional"}]
ADD_ALL = '{"func_name": "addAll"}'
STARTER = "class Solution:\n    def addAll(self, nums: List[int], extra: int) -> int:\n        "


@pytest.fixture
def lcb_rows() -> list[dict]:
    pickled = base64.b64encode(zlib.compress(pickle.dumps(json.dumps(PRIVATE)))).decode()
    return [
        lcb_row("abc400_a", "atcoder", [STDIN, FUNCTIONAL], lcb_compress(PRIVATE)),
        lcb_row("3500", "leetcode", [FUNCTIONAL], lcb_compress(PRIVATE_FUNCTIONAL), ADD_ALL, STARTER),
        lcb_row("2050A", "codeforces", [STDIN], pickled),
        lcb_row("abc400_b", "atcoder", [STDIN], json.dumps(PRIVATE)),
        lcb_row("3501", "leetcode", [FUNCTIONAL]),  # no func_name in its metadata
        lcb_row("3502", "leetcode", [{**FUNCTIONAL, "input": "[1, 2\n10"}], metadata=ADD_ALL),  # not JSON
    ]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


# ------------------------------------------------------------------------------------------------ reading


def test_load_rows_reads_parquet_jsonl_json_and_split_folders(tmp_path: Path, dapo_parquet: Path):
    rows = sources.load_rows(str(dapo_parquet))
    assert len(rows) == 9 and rows[0]["reward_model"]["ground_truth"] == "2"
    assert isinstance(rows[0]["prompt"], list)  # plain Python lists, not numpy arrays

    write_jsonl(tmp_path / "a.jsonl", [{"x": 1}, {"x": 2}])
    assert [r["x"] for r in sources.load_rows(str(tmp_path / "a.jsonl"))] == [1, 2]
    (tmp_path / "b.json").write_text(json.dumps({"test": [{"x": 3}]}))
    assert sources.load_rows(str(tmp_path / "b.json"), split="test") == [{"x": 3}]

    hub_like = tmp_path / "repo" / "data"
    hub_like.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([{"x": 1}, {"x": 2}]), hub_like / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist([{"x": 9}]), hub_like / "test-00000-of-00001.parquet")
    assert [r["x"] for r in sources.load_rows(str(tmp_path / "repo"))] == [1, 2]
    assert [r["x"] for r in sources.load_rows(str(tmp_path / "repo"), split="test")] == [9]
    # a split no file is named after: refused, where reading every file would mix train and test rows
    with pytest.raises(sources.DataSourceError, match="no file for split 'validation'.* test, train"):
        sources.load_rows(str(tmp_path / "repo"), split="validation")
    plain = tmp_path / "plain"
    plain.mkdir()
    write_jsonl(plain / "problems.jsonl", [{"x": 5}])  # no file named after any split: every file is the data
    assert [r["x"] for r in sources.load_rows(str(plain), split="validation")] == [5]


def test_load_rows_reads_save_to_disk_folders(tmp_path: Path):
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"problem": "p", "answer": "1"}])}
                         ).save_to_disk(str(tmp_path / "saved"))
    assert sources.load_rows(str(tmp_path / "saved")) == [{"problem": "p", "answer": "1"}]
    with pytest.raises(sources.DataSourceError, match="no split 'test'"):
        sources.load_rows(str(tmp_path / "saved"), split="test")


def test_missing_local_path_and_unreachable_hub_name_the_source(tmp_path: Path, monkeypatch):
    with pytest.raises(sources.DataSourceError, match="no such file"):
        sources.load_rows(str(tmp_path / "absent.parquet"))

    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(sources.DataSourceError, match=r"'BytedTsinghua-SIA/DAPO-Math-17k'.*local path"):
        sources.load_rows("BytedTsinghua-SIA/DAPO-Math-17k")


# ------------------------------------------------------------------------------------------------ DAPO


def test_dapo_math_deduplicates_by_index_in_first_seen_order(dapo_parquet: Path):
    rows = loaders.dapo_math_rows(sources.iter_rows(str(dapo_parquet)))
    assert [r["id"] for r in rows] == ["uuid-a", "uuid-b", "uuid-c"]
    assert [r["label"] for r in rows] == ["2", "5", "9"]
    assert rows[1]["prompt"] == [{"role": "user", "content": loaders.DAPO_MATH_PREFIX + "What is 2+3?"
                                  + loaders.DAPO_MATH_SUFFIX}]


def test_dapo_math_falls_back_to_prompt_text_and_names_missing_ground_truth():
    a, b = dapo_row("x", "P1", "1"), dapo_row("y", "P2", "2")
    for row in (a, b):
        del row["extra_info"]
    assert [r["label"] for r in loaders.dapo_math_rows([a, b, dict(a)])] == ["1", "2"]

    broken = dapo_row("z", "P3", "3")
    broken["reward_model"] = {"style": "rule-lm"}
    with pytest.raises(loaders.MissingFieldError, match=r"row 1 has no 'reward_model.ground_truth'"):
        loaders.dapo_math_rows([a, broken])


# ------------------------------------------------------------------------------------------------ TACO


def test_taco_keeps_stdin_problems_and_counts_the_rest(taco_rows: list[dict]):
    rows, stats = loaders.taco_verified_rows(taco_rows)
    assert stats == {"kept": 2, "call_based": 1, "no_tests": 1, "malformed": 2}
    assert [r["id"] for r in rows] == ["t-echo", "taco-3"]
    echo = rows[0]
    assert json.loads(echo["label"]) == {"inputs": ["1\n", "2\n", "3\n"], "outputs": ["1\n", "2\n", "3\n"]}
    content = echo["prompt"][0]["content"]
    assert content.startswith("Echo the number.") and content.endswith(loaders.CODE_STDIN_INSTRUCTION)
    assert "```python" in loaders.CODE_STDIN_INSTRUCTION
    assert json.loads(rows[1]["label"]) == {"inputs": ["3\n1 2 3"], "outputs": ["6"]}


def test_image_tags_never_reach_openrlhfs_vlm_path():
    """Upstream's PromptDataset would turn "<image>" into an image part, which Qwen3's template renders as ""."""
    from openrlhf.datasets.prompts_dataset import _str_to_content_list

    statement = "Given <image>, print the value of <image> modulo 7."
    [taco], _ = loaders.taco_verified_rows([taco_row(statement, {"inputs": ["1\n"], "outputs": ["1\n"]})])
    [dapo] = loaders.dapo_math_rows([dapo_row("i", statement, "3")])
    [lcb] = livecodebench_rows([{**lcb_row("q", "atcoder", [STDIN]), "question_content": statement}])
    for row in (taco, dapo, lcb):
        content = row["prompt"][0]["content"]
        assert "Given [image], print the value of [image] modulo 7." in content
        assert _str_to_content_list(content) == content  # stays text under --data.apply_chat_template


def test_taco_caps_tests_per_problem(taco_rows: list[dict]):
    rows, _ = loaders.taco_verified_rows(taco_rows[:1], max_tests=2)
    assert json.loads(rows[0]["label"])["inputs"] == ["1\n", "2\n"]
    with pytest.raises(loaders.MissingFieldError, match="row 0 has no 'question'"):
        loaders.taco_verified_rows([{"input_output": "{}"}])


# ------------------------------------------------------------------------------------------------ benchmarks


def test_math_benchmarks_accept_the_common_layouts():
    aime24 = loaders.aime24_rows([{"id": 60, "problem": "Find x.", "solution": "... \\boxed{204}", "answer": "204",
                                   "url": "u", "year": "2024"},
                                  {"ID": "2024-II-4", "Problem": "Find y.", "Solution": "s", "Answer": 33}])
    assert [(r["id"], r["label"]) for r in aime24] == [("60", "204"), ("2024-II-4", "33")]
    assert aime24[0]["prompt"][0]["content"] == loaders.DAPO_MATH_PREFIX + "Find x." + loaders.DAPO_MATH_SUFFIX

    amc = loaders.amc23_rows([{"id": 0, "question": "How many?", "answer": 27.0, "url": "u"}])
    assert amc[0]["label"] == "27" and "How many?" in amc[0]["prompt"][0]["content"]
    aime25 = loaders.aime25_rows([{"question": "Q", "answer": "70"}])
    assert aime25 == [{"id": "aime25-0", "prompt": loaders.math_prompt("Q"), "label": "70"}]

    with pytest.raises(loaders.MissingFieldError, match=r"row 1 has no 'answer / Answer'"):
        loaders.aime25_rows([{"problem": "P", "answer": "1"}, {"problem": "P2", "solution": "\\boxed{2}"}])


def test_livecodebench_keeps_stdin_tests_and_decodes_compressed_json(lcb_rows: list[dict]):
    rows, stats = loaders.livecodebench_rows_and_stats(lcb_rows)
    assert stats == {"kept": 4, "call_based": 1, "other_platform": 0, "no_tests": 0, "malformed": 2,
                     "private_undecoded": 1}
    by_id = {r["id"]: json.loads(r["label"]) for r in rows}
    # a stray functional test without a function name leaves the stdin tests
    assert by_id["abc400_a"] == {"inputs": ["1 2\n", "5 5\n", "0 0\n"], "outputs": ["3\n", "10\n", "0\n"]}
    assert by_id["abc400_b"]["inputs"] == ["1 2\n", "5 5\n", "0 0\n"]  # plain-JSON private tests
    assert by_id["2050A"] == {"inputs": ["1 2\n"], "outputs": ["3\n"]}  # pickled private tests: public only
    assert rows[0]["prompt"][0]["content"].startswith("Statement of abc400_a.")


def test_livecodebench_platform_filter_and_test_cap(lcb_rows: list[dict]):
    rows, stats = loaders.livecodebench_rows_and_stats(lcb_rows, platform="atcoder", max_tests=2)
    assert [r["id"] for r in rows] == ["abc400_a", "abc400_b"] and stats["other_platform"] == 4
    assert all(len(json.loads(r["label"])["inputs"]) == 2 for r in rows)
    assert [r["id"] for r in livecodebench_rows(lcb_rows, platform="leetcode")] == ["3500"]
    with pytest.raises(ValueError, match="unknown LiveCodeBench platform"):
        livecodebench_rows(lcb_rows, platform="topcoder")


def test_leetcode_problems_become_call_based_rows_the_code_reward_runs(lcb_rows: list[dict]):
    [row] = livecodebench_rows(lcb_rows, platform="leetcode")
    label = json.loads(row["label"])
    assert label == {"fn_name": "addAll", "inputs": ["[1, 2]\n10", "[]\n0", "[-5, 5, 7]\n-1"],
                     "outputs": ["13", "0", "6"]}
    prompt = row["prompt"][0]["content"]
    assert prompt.startswith("Statement of 3500.") and f"```python\n{STARTER.rstrip()}\n```" in prompt
    right = "```python\nclass Solution:\n    def addAll(self, nums, extra):\n        return sum(nums) + extra\n```"
    wrong = right.replace("+ extra", "+ abs(extra)")  # fails only the last (private) test
    assert code_score(right, None, row["label"]) == 1.0
    assert code_score(wrong, None, row["label"]) == 0.0
    [capped] = livecodebench_rows(lcb_rows[1:2], max_tests=2)
    assert code_score(wrong, None, capped["label"]) == 1.0


def test_pickled_private_tests_are_read_only_as_a_bare_string_when_allowed(lcb_rows: list[dict]):
    rows = livecodebench_rows(lcb_rows[2:3], allow_pickled_str=True)
    assert json.loads(rows[0]["label"])["inputs"] == ["1 2\n", "5 5\n", "0 0\n"]

    class Payload:
        def __reduce__(self):
            return (print, ("executed",))

    hostile = base64.b64encode(zlib.compress(pickle.dumps(Payload()))).decode()
    assert lcb_tests.decode_lcb_private_tests(hostile, allow_pickled_str=True) is None
    assert lcb_tests.read_pickled_str(pickle.dumps(["not", "a", "str"])) is None
    assert lcb_tests.read_pickled_str(pickle.dumps("text") + b"trailing") is None
    assert lcb_tests.decode_lcb_private_tests("not base64 !!") is None


# ------------------------------------------------------------------------------------------------ CLI


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "openrlhf_growmtp.cli.prepare_data", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_cli_writes_parseable_jsonl_end_to_end(tmp_path: Path, dapo_parquet: Path, taco_rows: list[dict]):
    out = tmp_path / "out" / "dapo.jsonl"
    done = run_cli("dapo-math", str(dapo_parquet), str(out))
    assert done.returncode == 0, done.stderr
    assert "read 9 rows, wrote 3 rows" in done.stdout
    rows = read_jsonl(out)
    assert [r["label"] for r in rows] == ["2", "5", "9"]
    assert all(isinstance(r["label"], str) and r["prompt"][0]["role"] == "user" for r in rows)

    taco_out = tmp_path / "taco.jsonl"
    assert prepare_data.main(["taco-verified", str(write_jsonl(tmp_path / "taco-src.jsonl", taco_rows)),
                              str(taco_out), "--max-tests", "1"]) == 0
    taco = read_jsonl(taco_out)
    assert len(taco) == 2 and json.loads(taco[0]["label"]) == {"inputs": ["1\n"], "outputs": ["1\n"]}


def test_cli_prints_taco_stats(tmp_path: Path, taco_rows: list[dict], capsys):
    src = write_jsonl(tmp_path / "taco-src.jsonl", taco_rows)
    assert prepare_data.main(["taco-verified", str(src), str(tmp_path / "t.jsonl")]) == 0
    assert "kept=2, call_based=1, no_tests=1, malformed=2" in capsys.readouterr().out


def test_cli_missing_column_exits_2_and_writes_nothing(tmp_path: Path):
    src = write_jsonl(tmp_path / "aime.jsonl", [{"problem": "P", "answer": "1"}, {"problem": "Q"}])
    out = tmp_path / "aime-out.jsonl"
    done = run_cli("aime24", str(src), str(out))
    assert done.returncode == 2
    assert "row 1" in done.stderr and "answer" in done.stderr
    assert not out.exists() and not (tmp_path / "aime-out.jsonl.tmp").exists()

    lcb = write_jsonl(tmp_path / "lcb.jsonl", [{"question_content": "c", "platform": "atcoder", "question_id": "q"}])
    assert prepare_data.main(["livecodebench", str(lcb), str(out)]) == 2
    assert not out.exists()
