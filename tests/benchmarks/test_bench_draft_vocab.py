"""`bench_draft_vocab --acceptance`: the τ pairs and the table docs/measurements.md shows, against a hand count on
kept runs written here (the kept files' own test only reruns the same arithmetic on them)."""

from __future__ import annotations

import json

import pytest

from benchmarks.bench_draft_vocab import acceptance, acceptance_table


def _run(path, taus, coverage=None, flags=()):
    rows = [{"step": i + 1, "tau": tau, **({} if coverage is None else {"draft_vocab_coverage": coverage[i]})}
            for i, tau in enumerate(taus)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rows": rows, "flags": list(flags)}))


def test_the_pairs_read_the_last_five_steps_and_every_steps_coverage(tmp_path):
    # 40 steps: "final" is the mean of the last 5 (report.final_window: a quarter of the run, at most 5)
    _run(tmp_path / "paper-abc" / "growmtp-s42.json", [1.0] * 35 + [2.0] * 5)
    _run(tmp_path / "paper-abc-vocab-quarter" / "growmtp-s42.json", [1.0] * 35 + [2.0, 2.1, 2.2, 2.3, 2.4],
         coverage=[0.8] * 20 + [1.0] * 20, flags=["--growmtp_draft_vocab", "1024"])
    _run(tmp_path / "paper-abc" / "growmtp-s43.json", [3.0] * 40)  # no vocabulary run of seed 43: no pair
    result = acceptance(tmp_path)
    assert list(result) == ["paper-abc"] and list(result["paper-abc"]) == ["42"]
    pair = result["paper-abc"]["42"]
    assert pair["tau_final_all_ids"] == pytest.approx(2.0)
    assert pair["tau_final_subset"] == pytest.approx(2.2)  # (2.0 + 2.1 + 2.2 + 2.3 + 2.4) / 5
    assert pair["tau_change"] == pytest.approx(0.1)  # 2.2 / 2.0 - 1
    assert pair["coverage_mean"] == pytest.approx(0.9)  # every step's, not the window's
    assert acceptance_table(result).splitlines()[2] == "| paper | 42 | 1,024 | 2.000 | 2.200 | +10.0% | 0.9000 |"
