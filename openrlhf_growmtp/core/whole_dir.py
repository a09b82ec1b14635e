"""Directories written whole: a run's export (the policy with its head) and growmtp-export's served directory.

`written_whole(out_dir)` yields a temporary sibling of OUT_DIR to write into. When the writing returns it adds
MANIFEST, written last (every other file's size and sha256: what ties the head to the policy it was written
with), and swaps the sibling in: the old OUT_DIR is renamed aside, the new one onto its name, then the old one
is removed. When the writing fails (a full disk, any error) the sibling is removed and OUT_DIR is left as it was.
Nothing is ever written into OUT_DIR itself, so a reader finds there the old directory or the new one, whole:

- a process killed outright while writing leaves its sibling `.OUT_DIR.tmp-*` (never read; remove it);
- killed between the two renames, OUT_DIR is absent, the old one is at `.OUT_DIR.tmp-*.old` and the new one
  whole at `.OUT_DIR.tmp-*`;
- an old OUT_DIR that holds anything but the files of its own manifest (a directory not written whole, a file
  added to it) is not removed: it is kept at `OUT_DIR.previous[-N]`, and the log says so.

`check_whole(directory)` reads a directory back against its manifest: a file listed but missing, of another size
or other bytes, or a file the manifest does not list, is named (cut short, or mixed with another write's files).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger("growmtp")

MANIFEST = "growmtp_manifest.json"
MANIFEST_FORMAT = 1


class NotWholeError(ValueError):
    """A directory that is not the one written whole (the message names it, and each file that differs)."""


@contextlib.contextmanager
def written_whole(out_dir: str | Path, write: bool = True):
    """A temporary sibling of `out_dir` to write into, swapped in whole once the block returns (module
    docstring). `write=False` (a rank that writes nothing) yields `out_dir` and does nothing."""
    out = Path(out_dir)
    if not write:
        yield out
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        staging.chmod(0o755)  # mkdtemp's 0700 would otherwise become OUT_DIR's
        yield staging
        write_manifest(staging)
        _swap(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def write_manifest(directory: Path) -> None:
    """MANIFEST: every other file under `directory` (relative path -> bytes, sha256)."""
    files = {rel: _describe(directory / rel) for rel in _files(directory)}
    (directory / MANIFEST).write_text(json.dumps({"format": MANIFEST_FORMAT, "files": files}, indent=1) + "\n")


def check_whole(directory: str | Path) -> bool:
    """Whether `directory` has a manifest (False: none, it says nothing either way); raises NotWholeError naming
    every file that is not as the manifest lists it."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        return False
    try:
        listed = json.loads(path.read_text())["files"]
        problems = []
        for rel in sorted(listed):
            want, found = listed[rel], directory / rel
            if not found.is_file():
                problems.append(f"{rel} is missing")
            elif found.stat().st_size != want["bytes"]:
                problems.append(f"{rel} has {found.stat().st_size:,} bytes, {want['bytes']:,} were written")
            elif _describe(found)["sha256"] != want["sha256"]:
                problems.append(f"{rel} holds other bytes than were written with the rest")
        problems += [f"{rel} was not written with the rest" for rel in sorted(set(_files(directory)) - set(listed))]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
        problems = [f"{MANIFEST} does not read ({type(err).__name__}: {err})"]
    if problems:
        raise NotWholeError(f"{directory}: not the directory that was written whole (its {MANIFEST}): "
                            f"{'; '.join(problems[:6])}{' ...' if len(problems) > 6 else ''}. Cut short, or mixed "
                            "with another write's files: write it again")
    return True


def _swap(staging: Path, out: Path) -> None:
    if not os.path.lexists(out):
        os.rename(staging, out)
        return
    if not out.is_dir() or out.is_symlink():
        raise NotWholeError(f"{out} exists and is not a directory: not replaced")
    aside = staging.with_name(staging.name + ".old")
    os.rename(out, aside)
    try:
        os.rename(staging, out)
    except BaseException:
        os.rename(aside, out)  # the old one back under its name
        raise
    if _only_its_own_files(aside):
        shutil.rmtree(aside, ignore_errors=True)
        return
    kept = next(candidate for n in itertools.count()
                if not os.path.lexists(candidate := out.with_name(f"{out.name}.previous{f'-{n}' if n else ''}")))
    os.rename(aside, kept)
    logger.warning("GrowMTP: %s held files not written whole with it (no %s listing exactly them); its previous "
                   "contents are kept at %s", out, MANIFEST, kept)


def _only_its_own_files(directory: Path) -> bool:
    """Empty, or exactly the files its manifest lists (an earlier export of ours: nothing else to keep)."""
    if not (directory / MANIFEST).is_file():
        return not any(directory.iterdir())
    try:
        return set(_files(directory)) == set(json.loads((directory / MANIFEST).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _files(directory: Path) -> list[str]:
    """Every regular file under `directory` but MANIFEST, as POSIX paths relative to it."""
    return sorted(path.relative_to(directory).as_posix() for path in directory.rglob("*")
                  if path.is_file() and path != directory / MANIFEST)


def _describe(path: Path) -> dict:
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    return {"bytes": path.stat().st_size, "sha256": digest}
