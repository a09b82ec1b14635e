"""The user's guide stays a guide, and its links resolve: README.md has at most 300 lines, and every relative
link in README.md and docs/*.md names a file that exists and, with a `#anchor`, a heading of that file.

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

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = ("http://", "https://", "mailto:")


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


def test_readme_is_at_most_300_lines():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move details into docs/"


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_relative_link_resolves(document: Path):
    problems = broken_links(document)
    assert not problems, "\n".join(problems)


def test_slugs_and_links_follow_github():
    assert slug("Serve what the run grew: `growmtp-export` and `make serve`") == \
        "serve-what-the-run-grew-growmtp-export-and-make-serve"
    assert slug("The `--growmtp_*` flags") == "the---growmtp_-flags"
    assert slug("Results: τ, α and [the GPU](docs/gpu.md)") == "results-τ-α-and-the-gpu"
    text = "see [a](a.md#x) and ![b](b.png)\n`[c](not-a-link.md)`\n```\n[d](in-code.md)\n```\n[e](<f.md>)"
    assert links(text) == ["a.md#x", "b.png", "f.md"]
