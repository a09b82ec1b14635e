"""A disk that fills up, for the tests of writes that must survive one (`core/whole_dir.py`).

`FullDisk(root, budget)` patches every way the exports write a file (Python's `open` and `io.open`, so
`Path.write_text`, `json.dump` and shutil's copies too; safetensors' `save_file` under every name it is imported
by, rerouted through `open`): once `budget` bytes were written to files under `root`, the write that crosses it
writes what still fits and raises OSError(ENOSPC), as a full filesystem does. With `budget=None` nothing fails,
and `writes` records each file written, in order, with its bytes: the points a test then fills the disk at.
"""

from __future__ import annotations

import builtins
import errno
import io
import shutil
from pathlib import Path

import safetensors.torch

# modules that bound safetensors' save_file to a name of their own at import (patched there too)
SAVE_FILE_NAMES = (("openrlhf_growmtp.core.checkpoint", "save_file"),
                   ("openrlhf_growmtp.core.model_export", "save_file"),
                   ("transformers.modeling_utils", "safe_save_file"))


class _Budgeted:
    """A file opened for writing under the disk's root: its writes count against the budget."""

    def __init__(self, disk: "FullDisk", file, path: str):
        self._disk, self._file = disk, file
        disk.writes.append([path, 0])

    def write(self, data):
        disk = self._disk
        room = len(data) if disk.budget is None else max(0, disk.budget - disk.used)
        if len(data) > room:
            self._file.write(data[:room])
            self._file.flush()
            disk.used += room
            disk.writes[-1][1] += room
            raise OSError(errno.ENOSPC, "No space left on device (FullDisk)", disk.writes[-1][0])
        disk.used += len(data)
        disk.writes[-1][1] += len(data)
        return self._file.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()

    def __getattr__(self, name):
        return getattr(self._file, name)


class FullDisk:
    def __init__(self, root: Path, budget: int | None):
        self.root, self.budget = Path(root).resolve(), budget
        self.used = 0
        self.writes: list[list] = []  # [path, bytes written] per file opened for writing, in order

    def __enter__(self):
        self._saved = [(builtins, "open", builtins.open), (io, "open", io.open),
                       (shutil, "_USE_CP_SENDFILE", shutil._USE_CP_SENDFILE)]
        real_open = builtins.open

        def budgeted_open(file, mode="r", *args, **kwargs):
            handle = real_open(file, mode, *args, **kwargs)
            writing = any(flag in mode for flag in "wax+")
            under = isinstance(file, (str, Path)) and Path(file).resolve().is_relative_to(self.root)
            return _Budgeted(self, handle, str(file)) if writing and under else handle

        def save_file(tensors, filename, metadata=None):
            data = safetensors.torch.save(tensors, metadata=metadata)
            with budgeted_open(filename, "wb") as f:
                f.write(data)

        import importlib

        for module_name, name in SAVE_FILE_NAMES:
            module = importlib.import_module(module_name)
            self._saved.append((module, name, getattr(module, name)))
            setattr(module, name, save_file)
        builtins.open = io.open = budgeted_open
        shutil._USE_CP_SENDFILE = False  # copies through Python's writes (sendfile would bypass them)
        return self

    def __exit__(self, *exc):
        for module, name, value in reversed(self._saved):
            setattr(module, name, value)

    def fill_points(self) -> list[int]:
        """Budgets that fill the disk at the start and in the middle of every file this disk saw written."""
        points, before = [], 0
        for _, size in self.writes:
            points += [before, before + size // 2]
            before += size
        return sorted(set(points))

    @property
    def total(self) -> int:
        return sum(size for _, size in self.writes)
