"""The paired design without an engine: the order alternates, the warm-up is not timed, per-token seconds and
the speedup follow from the rows, alternation cancels a machine that slows down steadily, several processes
combine into one figure, and the default baseline's engine lives in a process of its own (refused on a CPU)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from scipy import stats

from openrlhf_growmtp.cli.paired_rollout import parse_regimes, read_prompts, tokenize_prompts
from openrlhf_growmtp.measure.paired_rollout import PairedDesign, combine, run_pairs, summarize


class FakeMachine:
    """A clock and two arms: each generate costs `cost[arm]` seconds per token times a slowdown that grows by
    `drift` per generate (the machine getting slower), over `tokens[arm]` tokens."""

    def __init__(self, cost: dict, tokens: dict, drift: float = 0.0):
        self.now, self.calls, self.cost, self.tokens, self.drift = 0.0, [], cost, tokens, drift

    def clock(self) -> float:
        return self.now

    def arm(self, name: str):
        def generate() -> dict:
            n = self.tokens[name][len([c for c in self.calls if c == name]) % len(self.tokens[name])]
            self.now += n * self.cost[name] * (1 + self.drift * len(self.calls))
            self.calls.append(name)
            out = {"tokens": n}
            if name == "spec":
                out.update(cycles=n // 2, accepted=n - n // 2)
            return out
        return generate


def test_arms_alternate_abba_after_one_untimed_warm_up_each():
    machine = FakeMachine({"ar": 1.0, "spec": 1.0}, {"ar": [10], "spec": [10]})
    rows = run_pairs({"ar": machine.arm("ar"), "spec": machine.arm("spec")}, PairedDesign(pairs=4), machine.clock)
    assert machine.calls == ["ar", "spec"] + ["ar", "spec", "spec", "ar", "ar", "spec", "spec", "ar"]
    assert [(r["pair"], r["position"], r["arm"]) for r in rows] == [
        (0, 0, "ar"), (0, 1, "spec"), (1, 0, "spec"), (1, 1, "ar"),
        (2, 0, "ar"), (2, 1, "spec"), (3, 0, "spec"), (3, 1, "ar")]


def test_the_speedup_is_per_generated_token_whatever_the_lengths():
    # the speculative arm generates other lengths than the autoregressive one; per token it is 1.5x as fast
    machine = FakeMachine({"ar": 0.003, "spec": 0.002}, {"ar": [400, 450, 500], "spec": [380, 520, 470, 430]})
    rows = run_pairs({"ar": machine.arm("ar"), "spec": machine.arm("spec")}, PairedDesign(pairs=6), machine.clock)
    result = summarize(rows)
    assert result["pairs"] == 6 and result["speedup_per_pair"] == pytest.approx([1.5] * 6)
    assert result["speedup"]["estimate"] == pytest.approx(1.5)
    assert result["ar_s_per_token"]["estimate"] == pytest.approx(0.003)
    spec_rows = [r for r in rows if r["arm"] == "spec"]
    cycles, accepted = sum(r["cycles"] for r in spec_rows), sum(r["accepted"] for r in spec_rows)
    assert result["tau"] == pytest.approx(1 + accepted / cycles) and result["cycles"] == cycles


def test_alternation_cancels_a_steady_slowdown_that_a_fixed_order_would_not():
    # the machine slows by 5% per generate: with the arms always in the same order the second one looks 5%
    # slower in every pair; alternating, the median over pairs stays within 2% of the true 1.5
    cost, tokens = {"ar": 0.003, "spec": 0.002}, {"ar": [400], "spec": [400]}
    machine = FakeMachine(cost, tokens, drift=0.05)
    alternated = summarize(run_pairs({"ar": machine.arm("ar"), "spec": machine.arm("spec")},
                                     PairedDesign(pairs=6), machine.clock))
    assert alternated["speedup"]["estimate"] == pytest.approx(1.5, rel=0.02)
    assert alternated["speedup"]["low"] <= 1.5 <= alternated["speedup"]["high"]

    class FixedOrder(PairedDesign):
        @staticmethod
        def order(pair):
            return ("ar", "spec")

    machine = FakeMachine(cost, tokens, drift=0.05)
    fixed = summarize(run_pairs({"ar": machine.arm("ar"), "spec": machine.arm("spec")}, FixedOrder(pairs=6),
                                machine.clock))
    assert fixed["speedup"]["estimate"] < 1.5 * 0.97


def test_a_generate_without_tokens_and_a_bad_design_are_refused():
    with pytest.raises(RuntimeError, match="spec arm generated no tokens"):
        run_pairs({"ar": lambda: {"tokens": 5}, "spec": lambda: {"tokens": 0}}, PairedDesign(pairs=2))
    with pytest.raises(ValueError, match="no generate for arm"):
        run_pairs({"ar": lambda: {"tokens": 5}}, PairedDesign(pairs=2))
    for bad, message in (({"pairs": 1}, "at least 2 pairs"), ({"max_tokens": 0}, "max_tokens"),
                         ({"temperature": 0.0}, "temperature")):
        with pytest.raises(ValueError, match=message):
            PairedDesign(**bad)


def test_the_clis_prompts_and_regimes_are_checked_before_any_engine(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(f'{{"input": "q{i}", "label": "a"}}\n' for i in range(5)))
    assert read_prompts(path, "input", 2) == ["q0", "q1"]
    assert read_prompts(path, "input", 2, from_end=True) == ["q3", "q4"]
    with pytest.raises(ValueError, match="5 rows, cannot take 6"):
        read_prompts(path, "input", 6)
    with pytest.raises(ValueError, match="no 'prompt' field"):
        read_prompts(path, "prompt", 1)
    assert parse_regimes("2,4,8:1,2") == {"ar": [2, 4, 8], "spec": [1, 2]}
    for bad in ("2,4", "2:0", ":1"):
        with pytest.raises(ValueError):
            parse_regimes(bad)


def test_prompts_are_tokenized_as_the_rollout_does_and_repeated_per_sample():
    class Words:
        def __call__(self, text, add_special_tokens=True):
            assert add_special_tokens is False  # OpenRLHF's rollout adds none
            return {"input_ids": [len(word) for word in text.split()]}

    assert tokenize_prompts(Words(), ["a bb", "ccc"], samples=2) == [[1, 2], [1, 2], [3], [3]]
    with pytest.raises(ValueError, match="no tokens"):
        tokenize_prompts(Words(), [""], samples=1)


def test_combine_takes_the_mean_of_the_processes_medians_with_a_t_interval_over_processes():
    # three processes of 3 pairs each; the second runs 10% slower in both arms (the machine's state), which
    # moves its per-token seconds but not its speedup
    results = []
    for process, (slow, speedups) in enumerate(((1.0, [1.1, 1.2, 1.3]), (1.1, [1.0, 1.05, 1.4]),
                                                (1.0, [1.2, 1.25, 1.3]))):
        machine = FakeMachine({"ar": 0.003 * slow, "spec": 0.002 * slow}, {"ar": [100], "spec": [100]})
        rows = run_pairs({"ar": machine.arm("ar"), "spec": machine.arm("spec")}, PairedDesign(pairs=3),
                         machine.clock)
        for row, speedup in zip([r for r in rows if r["arm"] == "spec"], speedups):
            row["wall_s"] = row["tokens"] * 0.003 * slow / speedup  # the pair's own speedup
        results.append({"rows": rows, **summarize(rows)})  # a process's result: its rows and summary
    combined = combine(results)
    assert combined["speedup_per_process"] == pytest.approx([1.2, 1.05, 1.25])
    half = stats.t.ppf(0.975, 2) * np.std([1.2, 1.05, 1.25], ddof=1) / np.sqrt(3)
    assert combined["speedup"]["estimate"] == pytest.approx(np.mean([1.2, 1.05, 1.25]))
    assert combined["speedup"]["high"] - combined["speedup"]["estimate"] == pytest.approx(half)
    assert combined["speedup"]["n"] == 3 and combined["processes"] == 3 and combined["pairs"] == 9
    assert combined["ar_s_per_token_per_process"] == pytest.approx([0.003, 0.0033, 0.003])
    assert combined["cycles"] == sum(r["cycles"] for r in results)
    with pytest.raises(ValueError, match="at least 2"):
        combine(results[:1])


def test_the_default_baseline_engine_runs_in_a_process_of_its_own_without_the_runner_choice(monkeypatch):
    from functools import partial

    from helpers.plain_engine import FakePlainEngine
    from openrlhf_growmtp.measure.engine_process import RUNNER_ENV, EngineProcess

    monkeypatch.setenv(RUNNER_ENV, "0")  # what a GrowMTP engine sets in this process
    with EngineProcess(FakePlainEngine) as engine:
        assert engine.facts["pid"] != os.getpid() and engine.facts[RUNNER_ENV] is None
        assert engine.generate_tokens([{"prompt_token_ids": [1, 2]}] * 3, {"max_tokens": 5}) == 15
    with pytest.raises(RuntimeError, match="failed while building the engine: ValueError: no such model"):
        EngineProcess(partial(FakePlainEngine, "build"))
    engine = EngineProcess(partial(FakePlainEngine, "generate"))
    with pytest.raises(RuntimeError, match="failed while generating: RuntimeError: out of memory"):
        engine.generate_tokens([{"prompt_token_ids": [1]}], {"max_tokens": 1})
    assert not engine._process.is_alive()
    # vLLM's engine core starts a process of its own (its default): a daemonic engine process may not have one
    with EngineProcess(partial(FakePlainEngine, with_child=True)) as engine:
        assert engine.facts["child_pid"] not in (None, os.getpid(), engine.facts["pid"])


def test_the_default_baseline_is_refused_on_a_cpu_before_any_engine(tmp_path, monkeypatch, capsys):
    from openrlhf_growmtp.cli import paired_rollout as cli
    from openrlhf_growmtp.core.checkpoint import materialize_random_head
    from growmtp_lab.worlds.toy import make_policy

    policy = make_policy(tmp_path / "policy")
    materialize_random_head(policy, policy / "growmtp_head", seed=0)
    (tmp_path / "p.jsonl").write_text('{"input": "a b"}\n')
    monkeypatch.setenv("GROWMTP_CPU", "1")
    monkeypatch.setattr(cli, "measure_checkpoint", lambda *a, **k: pytest.fail("an engine was started"))
    with pytest.raises(SystemExit):
        cli.main(["--model", str(policy), "--depth", "2", "--prompts", str(tmp_path / "p.jsonl"), "--prompt-count",
                  "1", "--baseline", "default"])
    assert "--baseline default on a CPU" in capsys.readouterr().err
    # the regimes' scan picks the autoregressive level on the matched engine: not for the default one
    monkeypatch.setenv("GROWMTP_CPU", "0")
    with pytest.raises(SystemExit):
        cli.main(["--model", str(policy), "--depth", "2", "--prompts", str(tmp_path / "p.jsonl"), "--prompt-count",
                  "1", "--baseline", "default", "--regimes", "1,2:1,2"])
    assert "does not combine with --baseline default" in capsys.readouterr().err
