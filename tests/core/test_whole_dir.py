"""Directories written whole (`core/whole_dir.py`): swapped in only once complete, the older one kept until then,
read back against a manifest that names each file cut short, mixed in, added or missing."""

import json

import pytest
from helpers.disk import FullDisk

from openrlhf_growmtp.core.whole_dir import MANIFEST, NotWholeError, check_whole, written_whole


def write_files(out, files: dict[str, bytes]):
    """`files` (relative path -> bytes) written whole to `out`, as an export is."""
    with written_whole(out) as staging:
        for rel, data in files.items():
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            with open(staging / rel, "wb") as f:
                f.write(data)
    return out


OLD = {"config.json": b'{"old": 1}', "model.safetensors": b"o" * 5000, "head/model.safetensors": b"h" * 900}
NEW = {"config.json": b'{"new": 22}', "model.safetensors": b"n" * 7000, "head/model.safetensors": b"g" * 900,
       "tokenizer.json": b"t" * 300}


def contents(directory):
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


def test_the_new_directory_replaces_the_old_whole_with_a_manifest_of_every_file(tmp_path):
    out = write_files(tmp_path / "final", OLD)
    assert check_whole(out) and set(contents(out)) == set(OLD) | {MANIFEST}
    write_files(out, NEW)
    assert check_whole(out) and {k: v for k, v in contents(out).items() if k != MANIFEST} == NEW
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]  # the old one gone, no staging left


def test_a_disk_full_at_every_write_leaves_the_older_directory_as_it_was(tmp_path):
    out = write_files(tmp_path / "final", OLD)
    before = contents(out)
    with FullDisk(tmp_path, budget=None) as disk:  # where each write happens: the points to fill the disk at
        write_files(tmp_path / "probe", NEW)
    assert disk.writes[-1][0].endswith(MANIFEST) and len(disk.writes) == len(NEW) + 1
    for budget in disk.fill_points():
        with FullDisk(tmp_path, budget), pytest.raises(OSError, match="No space left on device"):
            write_files(out, NEW)
        assert contents(out) == before, budget
        assert sorted(p.name for p in tmp_path.iterdir()) == ["final", "probe"], budget  # the staging removed
    with FullDisk(tmp_path, budget=disk.total):  # room for all of it
        write_files(out, NEW)
    assert check_whole(out) and contents(out)["model.safetensors"] == NEW["model.safetensors"]


@pytest.mark.parametrize("damage, says", [
    (lambda d: (d / "model.safetensors").write_bytes(b"n" * 3000), "model.safetensors has 3,000 bytes, 7,000 were"),
    (lambda d: (d / "head/model.safetensors").write_bytes(b"h" * 900),  # another run's head of the same size
     "head/model.safetensors holds other bytes than were written with the rest"),
    (lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json is missing"),
    (lambda d: (d / "model-00002.safetensors").write_bytes(b"x"), "model-00002.safetensors was not written with"),
    (lambda d: (d / MANIFEST).write_text('{"files": '), f"{MANIFEST} does not read"),
])
def test_a_directory_changed_after_it_was_written_is_named_file_by_file(tmp_path, damage, says):
    out = write_files(tmp_path / "final", NEW)
    damage(out)
    with pytest.raises(NotWholeError, match="not the directory that was written whole") as err:
        check_whole(out)
    assert says in str(err.value) and str(out) in str(err.value)


def test_a_directory_without_a_manifest_says_nothing_either_way(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert check_whole(tmp_path) is False


def test_an_old_directory_holding_more_than_its_own_files_is_kept_beside(tmp_path):
    """A directory not written whole (no manifest, an earlier version's) or with a file added is not deleted by the
    swap: it moves to NAME.previous."""
    out = tmp_path / "final"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    write_files(out, NEW)
    assert (tmp_path / "final.previous" / "notes.txt").read_text() == "mine" and check_whole(out)
    (out / "added.txt").write_text("also mine")
    write_files(out, OLD)
    assert (tmp_path / "final.previous-1" / "added.txt").read_text() == "also mine"
    listed = json.loads((tmp_path / "final.previous-1" / MANIFEST).read_text())["files"]
    assert set(listed) == set(NEW)
