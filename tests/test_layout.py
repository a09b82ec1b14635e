"""The house's doors, read from the source (ast, no import): the product (openrlhf_growmtp, vllm_patches) imports
neither the lab (growmtp_lab) nor benchmarks/; the lab does not import benchmarks/; no benchmark imports another
(what they share is benchmarks/shared/) and no CPU benchmark imports the GPU check; neither the lab nor a
benchmark edits sys.path."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported(path: Path) -> set[str]:
    """Every absolute module a file imports, at any depth of its body (function-level imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}  # `from benchmarks import bench_x`
    return names


def files(*folders: str) -> list[Path]:
    found = [p for folder in folders for p in sorted((ROOT / folder).rglob("*.py"))]
    assert found, folders  # the walk itself could find nothing and pass
    return found


def offending(paths: list[Path], forbidden) -> list[str]:
    return [f"{p.relative_to(ROOT)}: {name}" for p in paths for name in sorted(imported(p)) if forbidden(p, name)]


def top(name: str) -> str:
    return name.split(".")[0]


def test_the_product_imports_neither_the_lab_nor_benchmarks():
    assert not offending(files("openrlhf_growmtp", "vllm_patches"),
                         lambda p, name: top(name) in ("growmtp_lab", "benchmarks", "tests", "helpers"))


def test_the_lab_does_not_import_benchmarks_or_tests():
    assert not offending(files("growmtp_lab"), lambda p, name: top(name) in ("benchmarks", "tests", "helpers"))


def _bench_module(name: str) -> str | None:
    """`benchmarks.bench_x[.attr]` -> "bench_x"; `benchmarks.gpu_check...` -> "gpu_check"; shared and the
    package itself -> None."""
    parts = name.split(".")
    if parts[0] != "benchmarks" or len(parts) < 2 or parts[1] == "shared":
        return None
    return parts[1]


def test_no_benchmark_imports_another_and_no_cpu_benchmark_imports_the_gpu_check():
    def forbidden(path: Path, name: str) -> bool:
        other = _bench_module(name)
        if other is None:
            return False
        if path.parent.name == "gpu_check":  # the GPU check's own modules import one another
            return other != "gpu_check"
        return other != path.stem  # a CPU benchmark: only the shared room

    assert not offending(files("benchmarks"), forbidden)


@pytest.mark.parametrize("folder", ["benchmarks", "growmtp_lab"])
def test_no_script_edits_sys_path(folder):  # (the product's one edit is cpu_support's flash_attn shim on CPU)
    edits = [f"{p.relative_to(ROOT)}" for p in files(folder)
             if any(verb in p.read_text() for verb in ("sys.path.insert", "sys.path.append", "sys.path[:0]"))]
    assert not edits
