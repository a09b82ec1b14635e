"""Where the studies write: `make ablations` and `make from-scratch` export into their run directory under runs/,
and touch the repository's tracked docs/ only when asked (`--docs`). Each CLI runs in an empty working directory,
so anything it wrote shows up there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from growmtp_lab import ablations, from_scratch
from growmtp_lab.from_scratch import Setting


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_the_ablations_export_goes_to_the_run_directory_unless_docs_is_asked():
    out = Path("runs") / "ablations"
    export, figures, keep = ablations.destinations(False, None, None, out)
    assert export == figures == out / "export" and keep is None
    assert not export.resolve().is_relative_to(Path("docs").resolve())
    assert ablations.destinations(False, Path("elsewhere"), Path("kept"), out) == (
        Path("elsewhere"), Path("elsewhere"), Path("kept"))
    # --docs: the summary and the kept results with the repository's data, the plots with its figures
    assert ablations.destinations(True, None, None, out) == (
        Path("docs/data/ablations"), Path("docs/figures"), Path("docs/data/ablations/runs"))


@pytest.mark.parametrize("extra", [["--export", "x"], ["--keep", "y"]])
def test_ablations_refuses_docs_beside_its_own_destinations_before_any_run(extra, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as refused:
        ablations.main(["--docs", *extra])
    assert refused.value.code == 2 and "--docs" in capsys.readouterr().err
    assert files_under(tmp_path) == set()  # refused before it made any directory


@pytest.fixture
def one_setting(tmp_path, monkeypatch):
    """The study reduced to one setting with nothing kept, run from an empty working directory."""
    monkeypatch.setattr(from_scratch, "SETTINGS", {"demo/held-out": Setting("demo", ("growmtp", "hybrid"), (45,))})
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_from_scratch_export_goes_to_the_run_directory_by_default(one_setting, capsys):
    assert from_scratch.main(["export"]) == 0
    assert files_under(one_setting) == {"runs/from_scratch/export/from_scratch.json"}
    doc = json.loads((one_setting / "runs/from_scratch/export/from_scratch.json").read_text())
    assert doc["runs_missing"] == 2 and doc["decided"] is False
    assert from_scratch.main(["next"]) == 0  # the driver command keeps its run under runs/ too
    command = capsys.readouterr().out.split()
    assert command[command.index("--keep") + 1] == "runs/from_scratch/kept"


def test_the_from_scratch_docs_option_writes_the_repositorys_record(one_setting, capsys):
    assert from_scratch.main(["export", "--docs"]) == 0
    assert files_under(one_setting) == {"docs/data/from_scratch/from_scratch.json"}
    assert from_scratch.main(["next", "--docs"]) == 0
    command = capsys.readouterr().out.split()
    assert command[command.index("--keep") + 1] == "docs/data/ablations/runs"
    with pytest.raises(SystemExit):
        from_scratch.main(["export", "--docs", "--out", "elsewhere.json"])
