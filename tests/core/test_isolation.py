"""The core imports neither openrlhf, vllm, ray nor deepspeed (checked in a fresh interpreter)."""

import subprocess
import sys

BLOCKER = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('openrlhf', 'vllm', 'ray', 'deepspeed'):
            raise ImportError('core must not import ' + name)
sys.meta_path.insert(0, Block())
import openrlhf_growmtp.core as core
import openrlhf_growmtp.cli.make_head
print(len(core.__all__))
"""


def test_core_imports_without_openrlhf_vllm_ray_or_deepspeed():
    result = subprocess.run([sys.executable, "-c", BLOCKER], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.strip()) > 10
