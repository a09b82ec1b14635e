"""Tensors across vLLM's worker RPC: one `torch.save` blob per call.

vLLM 0.29's multiprocess `collective_rpc` does not carry tensors nested in arguments or results; a
blob of bytes always crosses. Loading uses `weights_only=True`, so a blob holds tensors, containers of
them and plain values, and never runs code.

Used for: drained capture payloads (worker -> driver), head and target weights (driver -> worker),
the live head's state (worker -> driver), and the trainer's weight sync through Ray on CPU.
"""

from __future__ import annotations

import io

import torch


def dump_blob(obj) -> bytes:
    """`obj` (tensors, dicts, lists, numbers, strings) as bytes."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def load_blob(blob: bytes):
    """The object `dump_blob` wrote; refuses anything that is not bytes with a clear error."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise TypeError(f"expected the bytes of a dump_blob, got {type(blob).__name__}")
    return torch.load(io.BytesIO(blob), weights_only=True)
