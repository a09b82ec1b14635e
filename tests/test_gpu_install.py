"""The GPU install as docs/guide.md writes it ("Install on GPUs"): its commands, read from the page, run in
order in a fresh venv against the public registry for Linux x86_64 (this machine's pip configuration and
PIP_* variables off: `helpers.pip_env`).

Each command is first resolved by pip (`--dry-run --report`); then, so that the next command meets what this one
leaves behind, it is run for real, with two stand-ins: torch's CUDA build (gigabytes of CUDA libraries) is
replaced by its CPU build of the same version, and flash-attn is built without its CUDA kernels
(FLASH_ATTENTION_SKIP_CUDA_BUILD; FLASH_ATTENTION_FORCE_BUILD skips its look for a prebuilt wheel, which a CPU
torch cannot name). The last command is resolved only.
What it checks: every command resolves in the documented order, flash-attn's build finds what it imports, the
pins are the ones the docs name (torch, vLLM, OpenRLHF, DeepSpeed, Ray, transformers, flash-attn); vLLM's torch
pin is the torch resolved; torch is the registry's CUDA build, whose CUDA version the docs state; flash-attn
comes as a source release; `.[gpu]` finds torch and flash-attn installed and builds neither.
What it cannot check: that the wheels load on a given driver or GPU, that flash-attn's kernels compile, other
Python versions, or anything at run time.
Needs the registry (skipped without it) and this machine's CPU torch wheel (the stand-in); slow (2.5 minutes here,
most of it installing the stand-in torch and resolving `.[gpu]`): `make test-slow`.
"""

from __future__ import annotations

import json
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from helpers.pip_env import local_cpu_torch_wheel, public_pip_env, registry_reachable

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guide.md"
PINS = {"torch": "2.13.0", "vllm": "0.29.0", "openrlhf": "0.11.2", "deepspeed": "0.19.6", "ray": "2.55.0",
        "transformers": "5.15.0", "flash-attn": "2.8.3"}


def _name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def documented_block() -> list[str]:
    """The command lines of the guide's install step: its first fenced block."""
    step = GUIDE.read_text(encoding="utf-8").split("**1. Install on GPUs.**", 1)[1]
    return [line for line in step.split("```\n", 2)[1].splitlines() if line.strip()]


def documented_pip_installs() -> list[list[str]]:
    """The arguments of each `pip install` of the install step, in order, comments dropped."""
    words = [shlex.split(line, comments=True) for line in documented_block()]
    return [w[2:] for w in words if w[:2] == ["pip", "install"]]


def test_the_install_starts_in_a_fresh_venv_and_installs_only_with_pip():
    first, *rest = documented_block()
    assert " -m venv " in first  # the plugin refuses other vLLMs: its own environment
    assert all(shlex.split(line, comments=True)[:2] == ["pip", "install"] for line in rest)


@pytest.fixture(scope="module")
def steps(tmp_path_factory) -> list[dict[str, dict]]:
    """Each documented command's resolution (name -> pip's report item), the documented commands applied in order."""
    if (platform.system(), platform.machine()) != ("Linux", "x86_64"):
        pytest.skip("resolves for this machine's platform, which must be Linux x86_64")
    if not registry_reachable():
        pytest.skip("the package registry is not reachable")
    tmp = tmp_path_factory.mktemp("gpu_install")
    cpu_torch = local_cpu_torch_wheel(tmp)
    if cpu_torch is None:
        pytest.skip("this machine's pip sources have no CPU torch 2.13.0 to stand in for the CUDA build")
    subprocess.run([sys.executable, "-m", "venv", str(tmp / "venv")], check=True, timeout=300)
    python = str(tmp / "venv" / "bin" / "python")
    env = public_pip_env(tmp / "cache", FLASH_ATTENTION_SKIP_CUDA_BUILD="TRUE", FLASH_ATTENTION_FORCE_BUILD="TRUE")

    def pip(*args: str) -> None:
        done = subprocess.run([python, "-m", "pip", "install", "--quiet", *args], capture_output=True, text=True,
                              env=env, cwd=ROOT, timeout=1200)
        assert done.returncode == 0, f"pip install {shlex.join(args)}:\n{done.stderr[-4000:]}"

    commands, out = documented_pip_installs(), []
    for i, args in enumerate(commands):
        report = tmp / f"step{i}.json"
        pip("--dry-run", "--report", str(report), *args)
        out.append({_name(item["metadata"]["name"]): item for item in json.loads(report.read_text())["install"]})
        if i == len(commands) - 1:
            break
        if "torch" in out[-1]:  # its CPU build of the same version stands in for the CUDA build
            assert out[-1]["torch"]["metadata"]["version"] == PINS["torch"]
            pip(unquote(urlparse(cpu_torch).path))
        else:
            pip(*args)
    return out


@pytest.mark.slow
def test_the_documented_commands_resolve_in_order_to_the_pinned_stack(steps):
    versions = {name: step[name]["metadata"]["version"] for step in steps for name in PINS if name in step}
    assert versions == PINS
    last = steps[-1]
    assert f"torch=={PINS['torch']}" in last["vllm"]["metadata"]["requires_dist"]  # vLLM's wheel: exactly this torch
    openrlhf_requires = last["openrlhf"]["metadata"]["requires_dist"]
    assert {f"flash-attn=={PINS['flash-attn']}", f"deepspeed=={PINS['deepspeed']}"} <= set(openrlhf_requires)
    # the steps before left torch and flash-attn installed: `.[gpu]` neither replaces nor rebuilds them
    assert "torch" not in last and "flash-attn" not in last


@pytest.mark.slow
def test_torch_is_the_cuda_build_the_docs_name_and_flash_attn_is_built_from_source(steps):
    torch = next(step["torch"] for step in steps if "torch" in step)
    wheel = torch["download_info"]["url"].rsplit("/", 1)[-1]
    assert wheel.endswith("_x86_64.whl") and "+cpu" not in wheel  # the registry's default build: CUDA
    requires = torch["metadata"]["requires_dist"]
    toolkit = next(re.search(r"cuda-toolkit\[.*\]==(\d+)\.(\d+)", r) for r in requires if r.startswith("cuda-toolkit"))
    cuda = f"{toolkit.group(1)}.{toolkit.group(2)}"
    assert any(r.startswith(f"nvidia-nccl-cu{toolkit.group(1)}==") for r in requires)
    assert f"CUDA {cuda}" in GUIDE.read_text(), \
        f"docs/guide.md should name the CUDA version torch {PINS['torch']} is built with"
    flash_attn = next(step["flash-attn"] for step in steps if "flash-attn" in step)
    assert flash_attn["download_info"]["url"].endswith(".tar.gz")  # no wheel on the registry
