"""LiveCodeBench's `private_test_cases` field, decoded without ever unpickling it.

LiveCodeBench ships its private tests as base64(zlib(pickle(JSON text))). Unpickling data from a dataset
runs whatever the pickle names, so the pickle is only ever parsed opcode by opcode, and accepted only when
it holds nothing but one string (`read_pickled_str`).
"""

from __future__ import annotations

import base64
import binascii
import json
import pickletools
import zlib
from typing import Any

_PICKLE_STR_OPS = {"UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8"}
_PICKLE_BOOKKEEPING_OPS = {"PROTO", "FRAME", "MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"}


def read_pickled_str(data: bytes) -> str | None:
    """The text of a pickle whose whole content is one str, read opcode by opcode and never unpickled.

    `pickletools.genops` only parses the opcode stream; nothing is imported, constructed or called. Any
    opcode other than protocol/framing/memo bookkeeping, one string and STOP (at the very end) gives None.
    """
    text = None
    try:
        for opcode, arg, position in pickletools.genops(data):
            if opcode.name in _PICKLE_STR_OPS and text is None:
                text = arg
            elif opcode.name == "STOP":
                return text if position == len(data) - 1 else None
            elif opcode.name not in _PICKLE_BOOKKEEPING_OPS:
                return None
    except Exception:  # a truncated or corrupt opcode stream: not a readable string
        return None
    return None


def decode_lcb_private_tests(field: Any, allow_pickled_str: bool = False) -> list | None:
    """LiveCodeBench `private_test_cases` as a list of test dicts, or None when it cannot be read safely.

    Accepted encodings: an already-decoded list; plain JSON text; base64(zlib(JSON text)). LiveCodeBench
    itself ships base64(zlib(pickle(JSON text))); that is never unpickled, and is read only when
    `allow_pickled_str` is set and the pickle holds nothing but one string (see `read_pickled_str`).
    An empty field is an empty list.
    """
    if isinstance(field, list):
        return field
    if field is None or (isinstance(field, str) and not field.strip()):
        return []
    if not isinstance(field, str):
        return None
    try:
        parsed = json.loads(field)
        return parsed if isinstance(parsed, list) else None
    except json.JSONDecodeError:
        pass
    try:
        raw = zlib.decompress(base64.b64decode(field.strip(), validate=True))
    except (binascii.Error, ValueError, zlib.error):
        return None
    text: str | None
    if raw[:1] == b"\x80":  # a pickle's PROTO opcode
        text = read_pickled_str(raw) if allow_pickled_str else None
    else:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = None
    if text is None:
        return None
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        return None
    return parsed if isinstance(parsed, list) else None
