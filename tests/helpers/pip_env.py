"""pip as a fresh machine runs it, for the install tests (tests/test_gpu_install.py, tests/test_cpu_torch_install.py).

`public_pip_env`: no configuration file and no PIP_* variable of this machine (its local wheel directories and
indexes), only the public registry; a cache of its own, so nothing a test builds lands in the user's pip cache.
`cpu_torch_index`: a PEP 503 index holding only torch 2.13.0's CPU build, standing in for PyTorch's CPU wheel
index: its one link points at the wheel this machine's own pip sources resolve, wherever they keep it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

CPU_TORCH = "torch==2.13.0+cpu"


def registry_reachable() -> bool:
    from pip._internal.models.index import PyPI  # pip's default index, the one a bare configuration uses

    try:
        socket.create_connection((PyPI.netloc, 443), timeout=5).close()
        return True
    except OSError:
        return False


def public_pip_env(cache: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_CACHE_DIR": str(cache), "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            **extra}


def local_cpu_torch_wheel(tmp: Path) -> str | None:
    """The URL of the CPU torch wheel this machine's own pip sources resolve (None where they have none)."""
    report = tmp / "local_torch.json"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps",
                           "--quiet", "--report", str(report), CPU_TORCH], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        return None
    return json.loads(report.read_text())["install"][0]["download_info"]["url"]


def cpu_torch_index(root: Path, wheel_url: str) -> str:
    """A simple index at `root` whose only project is torch, linking to `wheel_url`; its URL."""
    project = root / "torch"
    project.mkdir(parents=True)
    name = wheel_url.rsplit("/", 1)[-1]
    (project / "index.html").write_text(f'<html><body><a href="{wheel_url}">{name}</a></body></html>\n')
    return root.resolve().as_uri()
