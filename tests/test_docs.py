"""The user's guide stays a guide, and its links resolve: README.md has at most 300 lines; every relative
link in README.md, docs/*.md and examples/README.md names a file that exists and, with a `#anchor`, a heading of
that file, and a README section cited in prose (README, "Section") is one of its headings; README.md and docs/*.md
read as a manual, naming no issue number and no sitting (the project's history is CHANGELOG.md's). docs/ holds
pages, with their data apart: every figure in docs/figures/ is shown by a page, and every kept file in docs/data/
is named by one (its path, or a folder of runs above it, in a page's text).

Links are markdown's `[text](target)` (images `![alt](target)` too) outside code blocks and code spans;
http(s) and mailto targets are not checked. Anchors are GitHub's heading slugs. Standard library only.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 300
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINKED = [*DOCUMENTS, ROOT / "examples" / "README.md"]  # whose links are checked

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = ("http://", "https://", "mailto:")
# a README section cited in prose: README, "Rehearsal" / README "Running on GPUs" / the README's "..."
README_CITATION = re.compile(r"README(?:'s)?,?\s+\"([^\"]+)\"")
HISTORY = re.compile(r"\bissues?\s*#?\s*\d|sitting", re.IGNORECASE)  # what a manual does not name


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (fence lines included as blank), in order."""
    lines, in_fence = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            lines.append("")
        else:
            lines.append("" if in_fence else line)
    return lines


def links(text: str) -> list[str]:
    """Every link target of a markdown text, outside code blocks and code spans."""
    return [match.group(1) for line in prose_lines(text) for match in LINK.finditer(CODE_SPAN.sub("", line))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: links reduced to their text, lower case, every character but
    letters, digits, `_`, `-` and spaces dropped, spaces turned into `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a markdown file's headings; a repeated slug gets `-1`, `-2`, ... as on GitHub."""
    seen: dict[str, int] = {}
    result = set()
    for line in prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def broken_links(document: Path) -> list[str]:
    """The relative links of `document` that do not resolve, each with the reason."""
    problems = []
    for target in links(document.read_text(encoding="utf-8")):
        if target.startswith(EXTERNAL):
            continue
        path_part, _, anchor = target.partition("#")
        path = (document.parent / path_part).resolve() if path_part else document
        if not path.exists():
            problems.append(f"{target}: no such file {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
        elif anchor and (path.is_dir() or path.suffix != ".md"):
            problems.append(f"{target}: an anchor into a file that is not markdown")
        elif anchor and anchor not in anchors(path):
            problems.append(f"{target}: no heading with the anchor #{anchor} in {path.relative_to(ROOT)}")
    return problems


def images(text: str) -> list[str]:
    """The image targets of a markdown text (`![alt](target)`), outside code blocks and code spans."""
    return [match.group(1) for line in prose_lines(text) for match in LINK.finditer(CODE_SPAN.sub("", line))
            if match.group(0).startswith("!")]


def pages_text() -> str:
    return "\n".join(page.read_text(encoding="utf-8") for page in DOCUMENTS)


def test_docs_holds_pages_beside_its_data_and_figures():
    stray = [p.name for p in (ROOT / "docs").iterdir() if p.suffix != ".md" and p.name not in ("data", "figures")]
    assert not stray, f"docs/ holds pages (*.md): put kept data in docs/data/<topic>/, plots in docs/figures/: {stray}"


def test_every_figure_is_shown_by_a_page():
    shown = {(page.parent / target).resolve() for page in DOCUMENTS
             for target in images(page.read_text(encoding="utf-8"))}
    unshown = [p.name for p in sorted((ROOT / "docs" / "figures").iterdir()) if p.resolve() not in shown]
    assert not unshown, f"no page shows {unshown}: show them or delete them"


def named(relative: Path, text: str) -> bool:
    """Whether a text names docs/data/<relative>, or a folder above it below its topic (data/<topic>/<runs>/), as a
    whole path (`data/x/` in `data/x/y.json` names no folder)."""
    parts = relative.parts
    folders = [re.escape("data/" + "/".join(parts[:n]) + "/") + r"(?=[\])`\s]|$)" for n in range(2, len(parts))]
    whole = re.escape("data/" + "/".join(parts)) + r"(?![\w./-])"
    return any(re.search(pattern, text, re.MULTILINE) for pattern in [whole, *folders])


def test_every_kept_data_file_is_named_by_a_page():
    text, data = pages_text(), ROOT / "docs" / "data"
    unnamed = [str(p.relative_to(data)) for p in sorted(data.rglob("*")) if p.is_file()
               and not named(p.relative_to(data), text)]
    assert not unnamed, f"no page names {unnamed[:10]} (or a folder above them)"


def test_readme_is_at_most_300_lines():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move details into docs/"


def readme_citations(text: str) -> list[str]:
    """The README sections a text cites in prose, as `README, "Section"`, joined over line breaks."""
    return [" ".join(m.group(1).split()) for m in README_CITATION.finditer(" ".join(prose_lines(text)))]


def readme_headings() -> list[str]:
    """README.md's headings, read when a test runs."""
    return [m.group(2) for line in prose_lines((ROOT / "README.md").read_text(encoding="utf-8"))
            if (m := HEADING.match(line))]


def history_mentions(text: str) -> list[str]:
    """The lines of a text that name an issue number or a sitting."""
    return [line.strip() for line in text.splitlines() if HISTORY.search(line)]


@pytest.mark.parametrize("document", LINKED, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_relative_link_resolves(document: Path):
    problems = broken_links(document)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("document", LINKED, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_readme_section_cited_in_prose_exists(document: Path):
    headings = {slug(h) for h in readme_headings()}
    missing = [c for c in readme_citations(document.read_text(encoding="utf-8")) if slug(c) not in headings]
    assert not missing, f"README.md has no section {missing}"


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: str(path.relative_to(ROOT)))
def test_the_manual_names_no_issue_and_no_sitting(document: Path):
    found = history_mentions(document.read_text(encoding="utf-8"))
    assert not found, "history belongs in CHANGELOG.md; rewrite as manual text:\n" + "\n".join(found)


def test_the_history_and_citation_patterns_catch_what_they_should():
    assert history_mentions("before issue 47\nIssues #12 and 13\nsecond Sitting\nan issue's target\nthe issues") == [
        "before issue 47", "Issues #12 and 13", "second Sitting"]
    assert readme_citations('see (README, "Rehearsal") and the README\'s "Serve what\nthe run grew"') == [
        "Rehearsal", "Serve what the run grew"]


def test_slugs_and_links_follow_github():
    assert slug("Serve what the run grew: `growmtp-export` and `make serve`") == \
        "serve-what-the-run-grew-growmtp-export-and-make-serve"
    assert slug("The `--growmtp_*` flags") == "the---growmtp_-flags"
    assert slug("Results: τ, α and [the GPU](docs/gpu.md)") == "results-τ-α-and-the-gpu"
    text = "see [a](a.md#x) and ![b](b.png)\n`[c](not-a-link.md)`\n```\n[d](in-code.md)\n```\n[e](<f.md>)"
    assert links(text) == ["a.md#x", "b.png", "f.md"]
    assert images(text) == ["b.png"]
    assert named(Path("t/a.json"), "see [a.json](data/t/a.json).") and named(Path("t/r/x.json"), "`data/t/r/`")
    assert not named(Path("t/x.json"), "all under [data/t/](data/t/)")  # a topic's folder names none of its files
    assert not named(Path("t/a.json"), "data/t/a.json.bak and data/t/ab.json") and not named(Path("t/a.json"),
                                                                                         "data/t/b.json")


def test_docs_map_lists_every_page_once_in_reading_order():
    """docs/README.md, the map, links every page of docs/ exactly once (a new page must be placed on it), its path runs
    guide -> architecture -> invariants before the result pages, and the README links to it."""
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    listed = [target.split("#")[0] for target in links(index)]
    listed = [target for target in listed if target.endswith(".md") and "/" not in target]
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name != "README.md")
    assert sorted(listed) == pages, f"missing {sorted(set(pages) - set(listed))}, listed twice or not a page: " \
                                    f"{sorted(t for t in set(listed) if listed.count(t) > 1 or t not in pages)}"
    path = [listed.index(page) for page in ("guide.md", "architecture.md", "invariants.md", "demo.md")]
    assert path == sorted(path), "the map's path: guide, architecture, invariants, then the results"
    assert "docs/README.md" in links((ROOT / "README.md").read_text(encoding="utf-8"))
