"""Where a kept figure came from: the commit, the command, the machine and the date, written beside the data.

Every figure the README and docs quote comes from a file under docs/data/ that carries this block
(`provenance()`), so that anyone can tell what produced it and run it again. A speed figure's block also holds
a calibration of its machine (`provenance(calibrate=True)`, `calibration.py`): the CPU's name does not tell two
machines apart that decode at twice each other's speed.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def git_commit(root: Path = ROOT) -> str:
    """HEAD's hash, with "+dirty" when tracked files differ from it ("unknown" outside a git checkout)."""
    def git(*args):
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)

    head = git("rev-parse", "HEAD")
    if head.returncode != 0:
        return "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    return head.stdout.strip() + ("+dirty" if dirty else "")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine() -> dict:
    import torch

    info = {"cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        import vllm

        info["vllm"] = vllm.__version__
    except ImportError:
        pass
    return info


def provenance(command: list[str] | None = None, calibrate: bool = False, **extra) -> dict:
    """The provenance block of a kept file: commit, command (default: this process's), machine, UTC date; with
    `calibrate`, the machine's calibration measured now (about 2 s)."""
    info = machine()
    if calibrate:
        from .calibration import calibrate as measure

        info["calibration"] = measure()
    return {"commit": git_commit(),
            "command": shlex.join(command if command is not None else [Path(sys.executable).name, *sys.argv]),
            "machine": info,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            **extra}
