#!/usr/bin/env bash
# `make gpu-wheels`: the wheels of benchmarks/gpu_check/wheels.txt for x86_64 Linux into .gpu-wheels/, where the
# registry is reachable (here), to carry with the working tree to a GPU machine without one (docs/gpu.md).
# Untagged lines: one wheel (pure or abi3); "# per-python": one per CPython 3.10-3.14 that has one (the
# machine's Python was 3.12; a version without a wheel is reported and skipped); "# built": a wheel built
# here from the source release with this Python (PYTHON), without its native ops.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
LIST=benchmarks/gpu_check/wheels.txt
TMP=.gpu-wheels.tmp
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
           --platform manylinux1_x86_64)
requirements() {  # the requirement of each line carrying tag $1 ("" for untagged lines)
  sed -e 's/^[[:space:]]*//' "$LIST" | grep -v -e '^#' -e '^$' | while IFS= read -r line; do
    req=${line%%#*}; req=${req%"${req##*[![:space:]]}"}; tag=""
    [[ "$line" == *"# per-python"* ]] && tag=per-python
    [[ "$line" == *"# built"* ]] && tag=built
    [[ "$tag" == "$1" ]] && echo "$req"
  done
}
download() { PIP_CONSTRAINT= "$PYTHON" -m pip download -q --no-deps --only-binary=:all: "${PLATFORMS[@]}" -d "$TMP" "$@"; }

rm -rf "$TMP" && mkdir "$TMP"
mapfile -t plain < <(requirements "")
download --python-version 3.11 "${plain[@]}"
for req in $(requirements per-python); do
  found=0
  for v in 3.10 3.11 3.12 3.13 3.14; do
    if download --python-version "$v" --implementation cp --abi "cp${v/./}" "$req" 2>/dev/null; then
      found=1
    else
      echo "gpu-wheels: no wheel of $req for CPython $v (skipped)" >&2
    fi
  done
  [[ $found == 1 ]] || { echo "gpu-wheels: no wheel of $req for any CPython 3.10-3.14" >&2; exit 1; }
done
for req in $(requirements built); do
  DS_BUILD_OPS=0 PIP_CONSTRAINT= "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$TMP" "$req"
done
rm -rf .gpu-wheels .gpu-site && mv "$TMP" .gpu-wheels
du -sh .gpu-wheels
