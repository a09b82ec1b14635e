"""A Hugging Face hub cache made by hand, laid out as huggingface_hub lays out its own (no network):

    <cache>/models--Org--Name/blobs/<sha256 of the content>
    <cache>/models--Org--Name/snapshots/<commit>/<file>   -> a relative symlink to its blob
    <cache>/models--Org--Name/refs/main                   the commit the main branch points at
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def commit_of(repo_id: str) -> str:
    """A fixed 40-hex commit per repo (huggingface_hub only needs refs/main to name a snapshot directory)."""
    return hashlib.sha1(repo_id.encode()).hexdigest()


def add_to_hub_cache(cache: Path, repo_id: str, files: dict[str, bytes | str | dict]) -> Path:
    """Put `files` (name -> content; a dict is written as JSON) into `cache` as the main branch of `repo_id`.
    Returns the snapshot directory."""
    repo = Path(cache) / ("models--" + repo_id.replace("/", "--"))
    commit = commit_of(repo_id)
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        if isinstance(content, dict):
            content = json.dumps(content)
        data = content.encode() if isinstance(content, str) else content
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs" / "main").write_text(commit)
    return snapshot
