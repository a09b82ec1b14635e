"""A head directory's files as files: their names, the error that names them, a safetensors file's header read and
checked whole without its data, safetensors' own errors named, a weight file's non-finite tensors, and a set of
tensor shapes against the set a config implies. `checkpoint.py` builds on these."""

from __future__ import annotations

import contextlib
import json
import struct
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .head_config import HEAD_CONFIG_FIELD

HEAD_WEIGHTS = "model.safetensors"
HEAD_CONFIG = "config.json"


class HeadCheckpointError(ValueError):
    """A head or backbone checkpoint that cannot serve as asked (the message says which file and why)."""


def nonfinite_tensors(head_dir: str | Path) -> list[str]:
    """The names of a head directory's tensors that hold an infinite or NaN value (read one at a time)."""
    path = Path(head_dir) / HEAD_WEIGHTS
    read_safetensors_header(path)  # whole, or a sentence saying why not
    with naming_errors(path), safe_open(str(path), framework="pt") as f:
        return [name for name in f.keys() if not bool(torch.isfinite(f.get_tensor(name)).all())]


def read_safetensors_header(path: str | Path) -> dict:
    """A safetensors file's header (tensor name -> dtype, shape, data_offsets; "__metadata__"), read without its
    data, once the file is known whole: HeadCheckpointError naming the file where it is missing, cut short (its
    tensors end past its last byte), or not safetensors at all."""
    path = Path(path)
    if not path.is_file():
        raise HeadCheckpointError(f"{path}: missing")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        (length,) = struct.unpack("<Q", head) if len(head) == 8 else (size,)
        try:
            header = json.loads(f.read(length)) if 8 + length <= size else None
        except (ValueError, UnicodeDecodeError):
            header = None
    try:
        end = 8 + length + max((int(meta["data_offsets"][1]) for name, meta in header.items()
                                if name != "__metadata__"), default=0)
    except (AttributeError, KeyError, TypeError, ValueError, IndexError):  # not a header, or a JSON of another kind
        header = None
    if not isinstance(header, dict):
        raise HeadCheckpointError(f"{path}: not a whole safetensors file ({size} bytes; its header does not read): "
                                  "cut short by a full disk or a copy, or another format")
    if end != size:
        raise HeadCheckpointError(f"{path}: {'cut short' if end > size else 'has bytes past its tensors'}: its header "
                                  f"places its tensors up to byte {end:,}, the file holds {size:,}; write it again")
    return header


@contextlib.contextmanager
def naming_errors(path: Path):
    """safetensors' own errors (a file changed under us) as HeadCheckpointError naming the file."""
    try:
        yield
    except SafetensorError as err:
        raise HeadCheckpointError(f"{path}: does not read as safetensors ({err})") from None


def check_shapes(expected: dict[str, tuple], found: dict[str, tuple], source: Path, config) -> None:
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing or unexpected:
        raise HeadCheckpointError(f"{source}: head parameters do not match the {getattr(config, HEAD_CONFIG_FIELD)} "
                                  f"head: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, shape in sorted(found.items()):
        if shape != expected[name]:
            raise HeadCheckpointError(f"{source}: {name} has shape {shape}, the head expects {expected[name]}")
