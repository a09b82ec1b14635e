#!/usr/bin/env bash
# `make gpu-check`: the GPU check on a GPU machine (docs/gpu.md), with the machine's own python and torch, in
# one command that keeps to $GPU_BUDGET_S seconds (default 480: 8 minutes of the machine), the install
# of the carried wheels included.
#   1. installs the carried wheels (.gpu-wheels/, from `make gpu-wheels`) into .gpu-site/, never into the
#      machine's environment; without .gpu-wheels/ the environment is used as it is;
#   2. without --tiny: refuses unless torch sees CUDA, then runs the check at Qwen3-4B's shapes with the
#      arguments given (`--only a,c` runs a subset, in its order; without it every check runs, in
#      gpu_check.CHECKS' order, the ones never run on a device first: `--only rollout_loop,head_update_graph,cycle_cost,trainer_step` takes
#      about 6 minutes on an H100, the install included, and fits GPU_BUDGET_S=550); no check starts within $GPU_RESERVE_S (90) seconds of the
#      budget's end, and a check still running at its end is stopped (SIGTERM): the JSON keeps what was done.
#      GPU_SMOKE=1 first runs the check at tiny shapes on CUDA (about 45 s on an H100);
#      with --tiny: runs only that, with the arguments given.
# Everything lands in $OUT (the device tool's folder that comes back), else runs/gpu/: the JSONs, a log per
# run (trainer_step's runs: gpu_check_trainer_runs/), environment.txt and timing.txt. GPU_HOST_COMMIT (the
# host's `git rev-parse HEAD`, written into the command) is the commit the JSON records. Exit status: the last
# run's (0 passed, 1 a check failed, 2 could not run, 3 passed what ran but the deadline skipped some checks, 124
# cut off by the budget).
set -uo pipefail
started=$SECONDS
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-runs/gpu}
BUDGET=${GPU_BUDGET_S:-480}
RESERVE=${GPU_RESERVE_S:-90}
mkdir -p "$OUT"

if [[ -d .gpu-wheels && ! -f .gpu-site/.installed ]]; then
  rm -rf .gpu-site
  if "$PYTHON" -m pip --version >/dev/null 2>&1; then
    "$PYTHON" -m pip install -q --no-deps --no-index --find-links .gpu-wheels --target .gpu-site \
      -r benchmarks/gpu_check/wheels.txt || { echo "gpu_check/run.sh: installing .gpu-wheels/ failed" >&2; exit 2; }
  else  # no pip: a wheel of these is a zip to extract (pure, abi3, or this CPython's)
    "$PYTHON" - <<'PY' || { echo "gpu_check/run.sh: extracting .gpu-wheels/ failed" >&2; exit 2; }
import pathlib, sys, zipfile
tag = f"-cp{sys.version_info.major}{sys.version_info.minor}-"
for wheel in sorted(pathlib.Path(".gpu-wheels").glob("*.whl")):
    if "-none-" in wheel.name or "abi3" in wheel.name or tag in wheel.name:
        zipfile.ZipFile(wheel).extractall(".gpu-site")
PY
  fi
  touch .gpu-site/.installed
fi
echo "install: $((SECONDS - started)) s" > "$OUT/timing.txt"
if [[ -d .gpu-site ]]; then
  export PYTHONPATH="$PWD/.gpu-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}

{
  date -u +%Y-%m-%dT%H:%M:%SZ
  echo "GPU_HOST_COMMIT=${GPU_HOST_COMMIT:-(not set: the JSON records the git HEAD of this copy)}"
  nvidia-smi 2>&1 || echo "(no nvidia-smi)"
  "$PYTHON" -c "import sys, torch, transformers; print(sys.version); \
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available()); \
print('transformers', transformers.__version__, transformers.__file__)"
} > "$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt"

tiny=0
for arg in "$@"; do
  [[ "$arg" == --tiny ]] && tiny=1
done
if [[ $tiny == 1 ]]; then
  "$PYTHON" -m benchmarks.gpu_check.gpu_check --json "$OUT/gpu_check_tiny.json" "$@" 2>&1 | tee "$OUT/gpu_check_tiny.log"
  exit "${PIPESTATUS[0]}"
fi
if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check/run.sh: the check at Qwen3-4B's shapes needs CUDA, and torch sees none here" \
       "(environment.txt says why); \`make gpu-check ARGS=--tiny\` runs the CPU version." >&2
  exit 2
fi
if [[ ${GPU_SMOKE:-0} == 1 ]]; then
  "$PYTHON" -m benchmarks.gpu_check.gpu_check --tiny --device cuda --json "$OUT/gpu_check_tiny_cuda.json" 2>&1 \
    | tee "$OUT/gpu_check_tiny_cuda.log"
  echo "smoke: $((SECONDS - started)) s" >> "$OUT/timing.txt"
fi
left=$((BUDGET - (SECONDS - started)))
if (( left < RESERVE )); then
  echo "gpu_check/run.sh: $left s of the $BUDGET s budget left, less than the $RESERVE s a check needs" >&2
  exit 124
fi
timeout --signal=TERM --kill-after=15 "$((left - 5))" \
  "$PYTHON" -m benchmarks.gpu_check.gpu_check --json "$OUT/gpu_check.json" --deadline-s "$((left - RESERVE))" "$@" 2>&1 \
  | tee "$OUT/gpu_check.log"
status=${PIPESTATUS[0]}
echo "check: $((SECONDS - started)) s (exit $status)" >> "$OUT/timing.txt"
exit "$status"
