"""The `gpu` extra resolves to one consistent set of packages for Linux x86_64 with CUDA (docs/guide.md, "Install
on GPUs"): pip's resolver run on this project's own `.[gpu]` against the package registry, nothing installed.

What it checks: that pip finds one version of every package the extra pulls in, with no conflict, for this
machine's platform (Linux x86_64, this CPython); that the pins are the ones the docs name (torch, vLLM, OpenRLHF,
DeepSpeed, Ray, transformers, and flash-attn, which OpenRLHF pins); that vLLM's own torch pin is the torch
resolved; that torch is the registry's CUDA build (its CUDA toolkit, cuDNN and NCCL wheels), whose CUDA version
the docs state; and that flash-attn comes as a source release (built on the GPU machine).
What it cannot check: that the wheels load on a given driver or GPU, that flash-attn compiles (its metadata is
built with its CUDA build skipped), other Python versions, or anything at run time.
Needs the registry (skipped without it); slow (about a minute): `make test-slow`.
"""

from __future__ import annotations

import json
import os
import platform
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PINS = {"torch": "2.13.0", "vllm": "0.29.0", "openrlhf": "0.11.2", "deepspeed": "0.19.6", "ray": "2.55.0",
        "transformers": "5.15.0", "flash-attn": "2.8.3"}


def _registry_reachable() -> bool:
    from pip._internal.models.index import PyPI  # pip's default index, the one `--isolated` uses

    try:
        socket.create_connection((PyPI.netloc, 443), timeout=5).close()
        return True
    except OSError:
        return False


def _name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.fixture(scope="module")
def resolved(tmp_path_factory) -> dict[str, dict]:
    if (platform.system(), platform.machine()) != ("Linux", "x86_64"):
        pytest.skip("resolves for this machine's platform, which must be Linux x86_64")
    if not _registry_reachable():
        pytest.skip("the package registry is not reachable")
    report = tmp_path_factory.mktemp("pip") / "report.json"
    # --isolated: no pip configuration or PIP_* variable of this machine (local wheel indexes, the CPU torch's
    # constraint); metadata of the source releases is built with this environment's setuptools and torch, and
    # flash-attn's without its CUDA build
    env = {**os.environ, "FLASH_ATTENTION_SKIP_CUDA_BUILD": "TRUE", "DS_BUILD_OPS": "0"}
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--ignore-installed",
                             "--no-build-isolation", "--quiet", "--report", str(report), f"{ROOT}[gpu]"],
                            capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    return {_name(item["metadata"]["name"]): item for item in json.loads(report.read_text())["install"]}


@pytest.mark.slow
def test_the_gpu_extra_resolves_to_the_pinned_stack(resolved):
    versions = {name: resolved[name]["metadata"]["version"] for name in PINS if name in resolved}
    assert versions == PINS
    vllm_requires = resolved["vllm"]["metadata"]["requires_dist"]
    assert f"torch=={PINS['torch']}" in vllm_requires  # vLLM's wheel is built for exactly this torch
    openrlhf_requires = resolved["openrlhf"]["metadata"]["requires_dist"]
    assert {f"flash-attn=={PINS['flash-attn']}", f"deepspeed=={PINS['deepspeed']}"} <= set(openrlhf_requires)


@pytest.mark.slow
def test_torch_is_the_cuda_build_the_docs_name_and_flash_attn_is_built_from_source(resolved):
    wheel = resolved["torch"]["download_info"]["url"].rsplit("/", 1)[-1]
    assert wheel.endswith("_x86_64.whl") and "+cpu" not in wheel  # the registry's default build: CUDA
    requires = resolved["torch"]["metadata"]["requires_dist"]
    toolkit = next(re.search(r"cuda-toolkit\[.*\]==(\d+)\.(\d+)", r) for r in requires if r.startswith("cuda-toolkit"))
    cuda = f"{toolkit.group(1)}.{toolkit.group(2)}"
    assert any(r.startswith(f"nvidia-nccl-cu{toolkit.group(1)}==") for r in requires)
    guide = (ROOT / "docs" / "guide.md").read_text()
    assert f"CUDA {cuda}" in guide, f"docs/guide.md should name the CUDA version torch {PINS['torch']} is built with"
    assert resolved["flash-attn"]["download_info"]["url"].endswith(".tar.gz")  # no wheel on the registry
