"""vLLM 0.29's Qwen3.5 text model imports on a machine without torchvision.

The chain, in the pinned versions: `vllm/model_executor/models/qwen3_5.py` imports `qwen3_vl.py`, which
imports `smart_resize` from transformers' `models/qwen2_vl/image_processing_qwen2_vl.py`, and that module
imports `torchvision.transforms.v2` at its top. The only torchvision wheel for the CPU
torch 2.13 is a CUDA build that fails on CPU, so the environment has none, and `Qwen3_5ForCausalLM` "failed
to be inspected". Serving text never calls `smart_resize` (it sizes images), and transformers 5.15 ships
the same function in its PIL-backed twin, `image_processing_pil_qwen2_vl.py`, which needs no torchvision.

`route_image_processor` makes the torchvision module's name resolve to that twin, only where torchvision is
absent and only after `check_route_contract` has shown that this is exact: vLLM imports nothing else from
that module, and both files define `smart_resize` with the same code. Any change of that layout in vLLM or
transformers raises `ImportRouteError` naming it, instead of routing. Nothing is installed, written or faked:
the name points at a real transformers module, and `from ... import Qwen2VLImageProcessor` through it
still fails (with the PIL module's name in the error).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path

TORCHVISION_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
PIL_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"
ROUTED_NAMES = ("smart_resize",)  # every name vLLM imports from TORCHVISION_MODULE
# vLLM modules on Qwen3.5's import path that import from TORCHVISION_MODULE (relative to vllm/)
IMPORTERS = ("model_executor/models/qwen3_vl.py",)


class ImportRouteError(RuntimeError):
    """vLLM's or transformers' layout no longer matches what the route was checked against."""


def route_image_processor() -> bool:
    """Point TORCHVISION_MODULE at its PIL twin when torchvision is absent. Returns whether it did."""
    if TORCHVISION_MODULE in sys.modules or importlib.util.find_spec("torchvision") is not None:
        return False  # already imported (or routed), or the real module can load
    check_route_contract()
    sys.modules[TORCHVISION_MODULE] = importlib.import_module(PIL_MODULE)
    return True


def check_route_contract() -> None:
    """Raise ImportRouteError unless routing TORCHVISION_MODULE to PIL_MODULE changes nothing vLLM uses."""
    import transformers
    import vllm

    problems = []
    vllm_root = Path(vllm.__file__).parent
    for relative in IMPORTERS:
        imported = _names_imported_from(vllm_root / relative, TORCHVISION_MODULE)
        if not imported:
            problems.append(f"vllm/{relative} no longer imports from {TORCHVISION_MODULE}: re-read the chain")
        elif set(imported) - set(ROUTED_NAMES):
            problems.append(f"vllm/{relative} imports {sorted(imported)} from {TORCHVISION_MODULE}; the route "
                            f"covers only {list(ROUTED_NAMES)}")
    models = Path(transformers.__file__).parent / "models" / "qwen2_vl"
    for name in ROUTED_NAMES:
        original = _function_code(models / "image_processing_qwen2_vl.py", name)
        twin = _function_code(models / "image_processing_pil_qwen2_vl.py", name)
        if original is None or twin is None or original != twin:
            problems.append(f"transformers' {name} in image_processing_qwen2_vl.py and image_processing_pil_qwen2_vl"
                            ".py is missing or no longer the same code")
    if problems:
        raise ImportRouteError("vllm_patches cannot route vLLM's Qwen3.5 import around torchvision:\n  - "
                               + "\n  - ".join(problems))


def _names_imported_from(path: Path, module: str) -> list[str]:
    if not path.is_file():
        return []
    tree = ast.parse(path.read_text())
    return [alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module == module
            for alias in node.names]


def _function_code(path: Path, name: str) -> str | None:
    """The function's AST without its docstring (so comments and wording may differ, code may not)."""
    if not path.is_file():
        return None
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            body = node.body[1:] if ast.get_docstring(node) is not None else node.body
            return ast.dump(node.args) + "".join(ast.dump(statement) for statement in body)
    return None
