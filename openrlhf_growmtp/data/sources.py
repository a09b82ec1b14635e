"""Read a dataset's rows from where a user has it: a local .parquet / .jsonl / .json file, a folder of them,
a folder written by `datasets`' `save_to_disk`, or a Hugging Face hub id. The converters in `loaders` turn
the rows into prompt rows.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

DATA_SUFFIXES = (".parquet", ".jsonl", ".json")
_METADATA_FILES = {"dataset_info.json", "state.json", "dataset_dict.json"}
# file stems that name a split (the hub's `train-00000-of-00001`, `test.jsonl`, ...)
_SPLIT_STEM = re.compile(r"^(train|test|validation|valid|dev|eval)([-_.].*)?$")


class DataSourceError(RuntimeError):
    """A source that is neither a readable local path nor a loadable hub dataset."""


def _is_save_to_disk_dir(path: Path) -> bool:
    """A directory written by `Dataset.save_to_disk` (state.json) or `DatasetDict.save_to_disk` (dataset_dict.json)."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def _data_files(directory: Path, split: str) -> list[Path]:
    """Data files under `directory` (recursive, hidden folders skipped), those named after `split` if any are.

    A file counts as the split's when its stem is the split name or starts with it followed by `-`, `_` or `.`
    (the hub's `data/train-00000-of-00001.parquet` layout); when no file is named so, all files are read, unless
    some are named after other splits: then the split is missing, and reading every file would mix the others.
    """
    files = sorted(p for p in directory.rglob("*")
                   if p.is_file() and p.suffix in DATA_SUFFIXES and p.name not in _METADATA_FILES
                   and not any(part.startswith(".") for part in p.relative_to(directory).parts))
    pattern = re.compile(rf"^{re.escape(split)}([-_.].*)?$")
    named = [p for p in files if pattern.match(p.stem)]
    others = sorted({found.group(1) for p in files if (found := _SPLIT_STEM.match(p.stem))})
    if not named and others:
        raise DataSourceError(f"{directory}: no file for split {split!r}; its files are named after the split(s) "
                              f"{', '.join(others)}: pass one of those as the split")
    return named or files


def _iter_parquet(path: Path) -> Iterator[dict]:
    """Rows of a parquet file as plain Python values, read batch by batch (structs -> dicts, lists -> lists)."""
    import pyarrow.parquet as pq

    for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
        yield from batch.to_pylist()


def _iter_jsonl(path: Path) -> Iterator[dict]:
    """Rows of a JSON-lines file; blank lines are skipped, a broken line raises with its line number."""
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataSourceError(f"{path}:{number}: not valid JSON ({err})") from err


def _iter_json(path: Path, split: str) -> Iterator[dict]:
    """Rows of a .json file: a list of rows, an object mapping split names to lists, or JSON lines."""
    try:
        with path.open(encoding="utf-8") as handle:
            data = json.load(handle)
    except json.JSONDecodeError:
        yield from _iter_jsonl(path)
        return
    if isinstance(data, list):
        yield from data
    elif isinstance(data, dict) and isinstance(data.get(split), list):
        yield from data[split]
    else:
        raise DataSourceError(f"{path}: expected a list of rows or an object with a {split!r} list")


def _iter_file(path: Path, split: str) -> Iterator[dict]:
    """Rows of one local data file, by suffix."""
    if path.suffix == ".parquet":
        return _iter_parquet(path)
    if path.suffix == ".jsonl":
        return _iter_jsonl(path)
    if path.suffix == ".json":
        return _iter_json(path, split)
    raise DataSourceError(f"{path}: unsupported file type (use {', '.join(DATA_SUFFIXES)})")


def _iter_saved(path: Path, split: str) -> Iterator[dict]:
    """Rows of a `save_to_disk` directory; for a DatasetDict, those of `split`."""
    import datasets

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataSourceError(f"{path}: no split {split!r} (has {', '.join(loaded)})")
        loaded = loaded[split]
    yield from loaded


def _looks_like_path(source: str) -> bool:
    """Whether a missing `source` was meant as a local path rather than an `owner/name` hub id."""
    return source.startswith((".", "/", "~")) or source.endswith(DATA_SUFFIXES) or source.count("/") > 1


def _iter_hub(source: str, split: str) -> Iterator[dict]:
    """Rows of a hub dataset through `datasets.load_dataset`; any failure becomes a DataSourceError."""
    import datasets

    try:
        loaded = datasets.load_dataset(source, split=split)
    except Exception as err:  # network, auth, missing script: all mean "give me a local copy"
        raise DataSourceError(
            f"could not load {source!r} (split {split!r}) from the Hugging Face hub: {type(err).__name__}: {err}. "
            f"Without hub access, download it elsewhere and pass a local path instead: a .parquet/.jsonl/.json "
            f"file, a folder of them, or a folder written by datasets' save_to_disk.") from err
    yield from loaded


def iter_rows(source: str, split: str = "train") -> Iterator[dict]:
    """Rows of `source`, lazily: a local file or folder (see `load_rows`), else a hub dataset id."""
    path = Path(source).expanduser()
    if path.is_file():
        return _iter_file(path, split)
    if path.is_dir():
        if _is_save_to_disk_dir(path):
            return _iter_saved(path, split)
        files = _data_files(path, split)
        if not files:
            raise DataSourceError(f"{path}: no {', '.join(DATA_SUFFIXES)} files in this folder")
        return (row for file in files for row in _iter_file(file, split))
    if _looks_like_path(source):
        raise DataSourceError(f"{source}: no such file or folder")
    return _iter_hub(source, split)


def load_rows(source: str, split: str = "train") -> list[dict]:
    """All rows of `source` as plain dicts.

    `source` is a local .parquet / .jsonl / .json file; a folder of such files (those named after `split`
    when there are any, e.g. `data/train-00000-of-00001.parquet`); a folder written by `save_to_disk`
    (`split` picks from a DatasetDict); or else a hub id read with `datasets.load_dataset(source, split=split)`,
    which raises `DataSourceError` naming the source when the hub cannot be reached.
    """
    return list(iter_rows(source, split))
