"""Every figure the README and docs tie to a kept file matches it (`openrlhf_growmtp.measure.figures`), and the
check itself catches a changed number, a changed file, a table out of date and a mark after no number; every
other speed or time figure stands in a labelled block (an unmarked one added to the README fails); and the kept
summaries and tables follow from their kept rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from openrlhf_growmtp.measure.figures import check, lookup, refresh, untied

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_quoted_figure_matches_its_kept_file(document: Path):
    problems = check(document)
    assert not problems, "\n".join(problems)


def test_the_speed_figures_of_the_readme_and_the_speed_pages_are_tied_to_kept_files():
    for name in ("README.md", "docs/demo.md", "docs/depth.md"):
        assert "<!-- fig: " in (ROOT / name).read_text(encoding="utf-8"), name


@pytest.fixture
def kept(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "s.json").write_text(json.dumps({"paired": [{"speedup": {"estimate": 1.4567}}],
                                                          "share": 0.123, "name": "x"}))
    (tmp_path / "data" / "t.md").write_text("| a |\n|---|\n| 1 |\n")
    return tmp_path


def write(root: Path, text: str) -> Path:
    path = root / "page.md"
    path.write_text(text)
    return path


def test_a_figure_matches_at_the_precision_shown(kept):
    page = write(kept, "speedup **1.46×**<!-- fig: data/s.json paired.0.speedup.estimate --> and 1.457x"
                       "<!-- fig: data/s.json paired.0.speedup.estimate --> of which 12.3%<!-- fig: data/s.json "
                       "share pct --> in 123<!-- fig: data/s.json share ms --> ms\n"
                       "<!-- table: data/t.md -->\n| a |\n|---|\n| 1 |\n<!-- /table -->\n")
    assert check(page) == []
    quoted = write(kept, "write `1.2 <!-- fig: FILE KEY -->` after a number\n"
                         "```\n9 <!-- fig: nowhere.json a -->\n```\n")
    assert check(quoted) == []  # marks quoted in code are examples, not marks
    assert lookup({"a": [{"b": 2}]}, "a.0.b") == 2
    assert lookup({"t": {"2.91": {"x": 3}, "2": {}}}, "t.2.91.x") == 3  # a key with a dot in it


@pytest.mark.parametrize("text, reason", [
    ("1.45× <!-- fig: data/s.json paired.0.speedup.estimate -->", "shows as 1.46"),
    ("1.46 <!-- fig: data/s.json paired.0.speed -->", "no 'speed'"),
    ("1.46 <!-- fig: data/missing.json a -->", "No such file"),
    ("x <!-- fig: data/s.json name -->", "not after a number"),
    ("1 <!-- fig: data/s.json name -->", "not a number"),
    ("<!-- table: data/t.md -->\n| a |\n|---|\n| 2 |\n<!-- /table -->", "differs from its file"),
    ("<!-- table: data/t.md -->\n| a |", "not closed"),
])
def test_a_stale_figure_or_table_is_caught(kept, text, reason):
    problems = check(write(kept, text))
    assert len(problems) == 1 and reason in problems[0], problems


def test_refresh_rewrites_tables_from_their_files_and_nothing_else(kept):
    page = write(kept, "1.99 stays\n<!-- table: data/t.md -->\nold\n<!-- /table -->\n")
    assert refresh(page) == 1
    assert page.read_text() == "1.99 stays\n<!-- table: data/t.md -->\n| a |\n|---|\n| 1 |\n<!-- /table -->\n"
    assert check(page) == [] and refresh(page) == 0


# ---- no figure untied --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_speed_or_time_figure_is_marked_or_labelled(document: Path):
    problems = untied(document)
    assert not problems, "\n".join(problems)


def test_an_unmarked_speed_figure_added_to_the_readme_is_caught(tmp_path):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    (tmp_path / "docs").symlink_to(ROOT / "docs")  # the copy's marks and kept blocks read the same files
    for added in ("GrowMTP makes the rollout 1.5× faster.", "a step takes 3.2 s", "the demo runs in 9 min",
                  "decoding at 1,292 tokens/s", "the head reaches τ 2.4", "rollouts 12% faster"):
        copy = tmp_path / "README.md"
        copy.write_text(readme + "\n" + added + "\n", encoding="utf-8")
        problems = untied(copy)
        assert len(problems) == 1 and "no <!-- fig: --> mark" in problems[0], (added, problems)


def test_what_counts_as_a_figure_and_what_ties_it(kept):
    page = write(kept, "shown 1.46×<!-- fig: data/s.json paired.0.speedup.estimate --> with its 95% interval; "
                       "`1.5× in code` is quoted; 2 × hidden is arithmetic; τ = 1 is the floor, τ = 1 + Σ α a formula\n"
                       "```\nprinted 1.7x\n```\n<!-- history: a run not kept -->\nonce 1.38× faster in 12 s\n"
                       "<!-- /history -->\nan <!-- example -->8 min<!-- /example --> wait; "
                       "<!-- kept: data/s.json -->a share of 12.3%, 1.457×<!-- /kept -->\n")
    assert untied(page) == []
    wrong = write(kept, "<!-- kept: data/s.json -->1.7×<!-- /kept --> and 0.6 s")  # s.json holds no 1.7
    problems = untied(wrong)
    assert len(problems) == 2 and "kept block whose files hold no such value" in problems[0]
    assert "page.md:1: 0.6 has no" in problems[1]


def test_a_kept_blocks_decimals_are_its_files_values_in_the_units_shown(kept):
    (kept / "data" / "u.json").write_text(json.dumps({"wall_s": 702.0, "bytes": 9_615_360, "params": 114_000_000,
                                                      "rows": [{"measured": "max|d| 2.8e-01"}]}))
    table = ("| wall (min) | MiB | M | measured |\n|---|---|---|---|\n| {} | {} | {} | max\\|d\\| {} |\n")
    page = write(kept, "<!-- kept: data/u.json -->\n" + table.format("11.7", "9.17", "114.0", "2.8e-01")
                 + "<!-- /kept -->\n")
    assert untied(page) == []  # seconds in minutes, bytes in MiB, a count in millions, a number a string holds
    for wrong in (("11.8", "9.17", "114.0", "2.8e-01"), ("11.7", "9.16", "114.1", "2.7e-01")):
        page = write(kept, "<!-- kept: data/u.json -->\n" + table.format(*wrong) + "<!-- /kept -->\n")
        problems = untied(page)
        changed = {cell for cell, right in zip(wrong, ("11.7", "9.17", "114.0", "2.8e-01")) if cell != right}
        assert {problem.split(": ")[1].split(" ")[0] for problem in problems} == changed, problems
    labelled = write(kept, "<!-- kept: data/u.json -->\n| <!-- derived: a sum -->12.5<!-- /derived --> |\n"
                           "<!-- /kept -->\n")
    assert untied(labelled) == []  # a label inside the block covers what its files do not hold
    (kept / "data" / "z.json").write_text(json.dumps({"z": -1.1003, "tau": 2.26}))
    prose = write(kept, "<!-- kept: data/z.json -->z −1.10 at 2.26, version 0.11.2<!-- /kept -->\n")
    assert untied(prose) == []  # prose too, with its sign; a version is no decimal
    for wrong in ("z 1.10 at 2.26", "z −1.10 at 2.27"):
        problems = untied(write(kept, f"<!-- kept: data/z.json -->{wrong}<!-- /kept -->\n"))
        assert len(problems) == 1 and "kept block whose files hold no such value" in problems[0], (wrong, problems)


def test_a_table_block_with_code_spans_is_compared_as_written(kept):
    (kept / "data" / "c.md").write_text("| run | x |\n|---|---|\n| `abc1234` | 1.5 |\n")
    page = write(kept, "<!-- table: data/c.md -->\n| run | x |\n|---|---|\n| `abc1234` | 1.5 |\n<!-- /table -->\n"
                       "quoted: `<!-- table: data/none.md -->`\n")
    assert check(page) == []
    (kept / "data" / "c.md").write_text("| run | x |\n|---|---|\n| `abc1234` | 1.6 |\n")
    assert ["differs from its file" in problem for problem in check(page)] == [True]


# ---- summaries and tables follow from their kept rows ---------------------------------------------------------

def same(kept, again, where: str = "") -> None:
    """`kept` equals `again`: numbers to 1e-9 relative (the same arithmetic, JSON's round trip), the rest exactly."""
    if isinstance(kept, dict):
        assert set(kept) == set(again), where
        for key in kept:
            same(kept[key], again[key], f"{where}.{key}")
    elif isinstance(kept, list):
        assert len(kept) == len(again), where
        for i, (a, b) in enumerate(zip(kept, again)):
            same(a, b, f"{where}.{i}")
    elif isinstance(kept, float) or isinstance(again, float):
        assert kept == pytest.approx(again, rel=1e-9, abs=1e-12), where
    else:
        assert kept == again, where


@pytest.mark.parametrize("run", ["demo", "demo/earlier"])
def test_the_demos_summary_follows_from_its_kept_rows(run):
    from growmtp_lab import report
    from openrlhf_growmtp.measure.paired_rollout import combine, summarize

    data = ROOT / "docs" / "data" / run
    summary = json.loads((data / "summary.json").read_text())
    rows = [json.loads(line) for line in (data / "metrics.jsonl").read_text().splitlines()]
    arms = {arm: [r for r in rows if r["arm"] == arm] for arm in ("ar", "growmtp")}
    again = report.summarize(arms["growmtp"], arms["ar"], summary["k"], extra={})
    for key, value in again.items():
        same(summary[key], value, key)
    walls = summary["arm_wall_s"]
    assert summary["net_wall_ratio"] == pytest.approx(walls["growmtp"] / walls["ar"], abs=1e-3)  # walls rounded
    same(summary["cumulative"], report.cumulative(arms["growmtp"], arms["ar"]), "cumulative")
    for kept in summary["paired"]:
        measured = json.loads((data / "paired" / f"step{kept['step']}.json").read_text())
        figure = combine(measured["per_process"]) if "per_process" in measured else summarize(measured["rows"])
        assert kept["tau"] == pytest.approx(figure["tau"])
        assert kept["speedup"]["estimate"] == pytest.approx(figure["speedup"]["estimate"])
        if kept["speedup"]["method"] == figure["speedup"]["method"]:  # an older file's bootstrap: its estimate
            same(kept["speedup"], figure["speedup"], f"step {kept['step']}")


def kept_study(tmp_path: Path, data: Path) -> Path:
    """A kept study's arm files (data/<run>/<arm>.json) laid out as the study writes them (<run>/<arm>/arm.json)."""
    from growmtp_lab import speed_study

    for found in data.glob("*/*.json"):
        (tmp_path / found.parent.name / found.stem).mkdir(parents=True)
        (tmp_path / found.parent.name / found.stem / speed_study.ARM_FILE).symlink_to(found)
    return tmp_path


@pytest.mark.parametrize("name", ["speed-study"])
def test_a_kept_studys_summary_and_table_follow_from_its_arm_files(tmp_path, name):
    from dataclasses import replace

    from growmtp_lab import speed_study

    data = ROOT / "docs" / "data" / name
    summary = json.loads((data / "summary.json").read_text())
    design = summary["design"]
    preset = replace(speed_study.WORLDS["speed"].recipes["full"], steps=design["steps"])
    plan = [(run, int(run.removeprefix("seed").removesuffix("-repeat")), found["_order"])
            for run, found in summary["runs"].items()]
    study = speed_study.Design(checkpoint_every=design["checkpoint_every"], pairs=design["pairs"],
                               paired_steps=tuple(design["paired_steps"]))
    again = speed_study.summarize(kept_study(tmp_path, data), plan, preset, study)
    for arm, figures in summary["across"].items():
        for figure, kept_figure in figures.items():
            for key in ("estimate", "low", "high", "detectable", "repeat_difference", "per_seed"):
                same(kept_figure[key], again["across"][arm][figure][key], f"{arm}.{figure}.{key}")
    if "auto_over_fixed_net_wall" in summary:
        for key in ("estimate", "low", "high", "detectable"):
            same(summary["auto_over_fixed_net_wall"][key], again["auto_over_fixed_net_wall"][key], key)
    assert (data / "table.md").read_text().strip() == speed_study.table(again).strip()


def test_the_draft_vocabularys_tau_pairs_and_table_follow_from_its_kept_runs():
    from benchmarks.bench_draft_vocab import acceptance, acceptance_table

    data = ROOT / "docs" / "data" / "draft_vocab"
    again = acceptance(data / "runs")
    assert again, "no kept pair of runs was found"
    assert json.loads((data / "acceptance.json").read_text()) == again  # the same arithmetic on the same rows
    assert (data / "acceptance.md").read_text() == acceptance_table(again)


def test_the_cycle_profile_table_follows_from_its_kept_runs():
    from benchmarks.bench_profile import markdown

    data = ROOT / "docs" / "data" / "profile"
    runs = [str(data / f"cycle_{code}_{i}.json") for i in (1, 2) for code in ("before", "after")]  # as they ran
    assert (data / "cycle.md").read_text().strip() == markdown(runs).strip()


def test_the_committed_checks_tau_over_the_last_steps_follows_from_its_rows():
    from growmtp_lab.committed_check import tau_final

    kept = json.loads((ROOT / "docs" / "data" / "depth" / "committed_check_seed7.json").read_text())
    for arm, found in kept["arms"].items():
        assert found["tau_final"] == pytest.approx(tau_final(found["steps"])), arm


def test_the_demos_interval_comparison_follows_from_its_files():
    from growmtp_lab.report import interval_comparison

    kept = json.loads((ROOT / "docs" / "data" / "demo" / "intervals.json").read_text())
    sources = kept["sources"]
    again = interval_comparison(ROOT / sources["earlier"], [ROOT / p for p in sources["repeated"]],
                                ROOT / sources["current"], 50)
    for key in ("earlier_bootstrap", "earlier_order_statistic", "repeated_runs_bootstrap",
                "repeated_runs_order_statistic", "repeated_runs_as_processes", "current"):
        same(kept[key], again[key], key)
