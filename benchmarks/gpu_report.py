"""The GPU check's rows, its one table, and its JSON (written whole or not at all)."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class Row:
    """One line of the table. `passed` is None for a measurement that has no pass/fail (the costs)."""

    check: str  # "a".."d"
    name: str
    measured: str  # as printed
    bound: str  # the bound it is held to, or the reference it is read against, as printed
    passed: bool | None
    values: dict = field(default_factory=dict)  # the numbers behind `measured` and `bound`
    skipped: bool = False  # not run: past the deadline (passed is then False: the run is not complete)

    @property
    def result(self) -> str:
        return "skipped" if self.skipped else {True: "pass", False: "FAIL", None: "measured"}[self.passed]


def table(rows: list[Row]) -> str:
    headers = ("", "check", "measured", "bound / reference", "result")
    lines = [(f"({r.check})", r.name, r.measured, r.bound, r.result) for r in rows]
    widths = [max(len(str(line[i])) for line in [headers, *lines]) for i in range(len(headers))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    rule = "  ".join("-" * w for w in widths)
    return "\n".join([fmt.format(*headers), rule, *(fmt.format(*line) for line in lines)])


def all_passed(rows: list[Row]) -> bool:
    return all(r.passed is not False for r in rows)


def exit_status(rows: list[Row]) -> int:
    """0 every check passed; 1 a check that ran failed; 3 none failed, but the deadline skipped some."""
    if any(r.passed is False and not r.skipped for r in rows):
        return 1
    return 3 if any(r.skipped for r in rows) else 0


def write_json(path: Path, payload: dict) -> None:
    """Write `payload` to `path` through a temporary file in the same folder and a rename, so a reader
    (or a run cut off by its time limit) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=2, default=_plain)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def rows_json(rows: list[Row]) -> list[dict]:
    return [{**asdict(r), "result": r.result} for r in rows]


def _plain(value):
    if hasattr(value, "item"):  # 0-d tensors and numpy scalars
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"not JSON: {type(value).__name__}")


def sci(x: float, digits: int = 1) -> str:
    return f"{x:.{digits}e}"
