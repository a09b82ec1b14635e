"""Every figure the README and docs tie to a kept file matches it (`openrlhf_growmtp.measure.figures`), and the
check itself catches a changed number, a changed file, a table out of date and a mark after no number."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from openrlhf_growmtp.measure.figures import check, lookup, refresh

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
                       "share pct --> in 123<!-- fig: data/s.json share ms --> ms\n<!-- table: data/t.md -->\n| a |\n|---|\n| 1 |\n<!-- /table -->\n")
    assert check(page) == []
    quoted = write(kept, "write `1.2 <!-- fig: FILE KEY -->` after a number\n```\n9 <!-- fig: nowhere.json a -->\n```\n")
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
