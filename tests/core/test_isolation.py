"""The core imports neither openrlhf, vllm, ray nor deepspeed.

openrlhf, vllm and ray are blocked in a fresh interpreter. deepspeed is checked in the source instead:
transformers imports it on its own whenever it is installed (the trainer environment has it).
"""

import ast
from pathlib import Path

import subprocess
import sys

BLOCKER = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('openrlhf', 'vllm', 'ray'):
            raise ImportError('core must not import ' + name)
sys.meta_path.insert(0, Block())
import openrlhf_growmtp.core as core
import openrlhf_growmtp.cli.make_head
print(len(core.__all__))
"""


def test_core_imports_without_openrlhf_vllm_or_ray():
    result = subprocess.run([sys.executable, "-c", BLOCKER], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.strip()) > 10


def test_core_source_never_imports_deepspeed():
    core = Path(__file__).resolve().parents[2] / "openrlhf_growmtp" / "core"
    for path in core.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] in ("deepspeed", "openrlhf", "vllm", "ray") for n in names), (path, names)
