#!/usr/bin/env bash
# Held-out evaluation of a finished run, as in the paper's tables: AIME24 / AIME25 / AMC23 (Mean@16) and
# LiveCodeBench v6's AtCoder and LeetCode slices (Pass@4, 6 s per test), at temperature 1.0 and top-p 0.7,
# up to 16384 tokens, at the depth the run's head was trained at, with held-out tau per benchmark.
# usage: evaluate.sh <run dir, e.g. runs/qwen3_4b_math_k5> [math|code|all [extra evaluate flags]]
# Reads <run>/final (the policy) and <run>/final/growmtp_head; writes <run>/eval (EVAL_OUT).
#
# Benchmarks are prepared once into DATA_ROOT (default ./data, as for the training scripts) from AIME24_SOURCE,
# AIME25_SOURCE, AMC23_SOURCE (hub ids by default) and LCB_SOURCE (default DATA_ROOT/livecodebench/test6.jsonl:
# LiveCodeBench's test6.jsonl, downloaded from livecodebench/code_generation_lite: its hub loader is a script,
# which `datasets` no longer runs). AIME24_DATA, AIME25_DATA, AMC23_DATA,
# LCB_ATCODER_DATA and LCB_LEETCODE_DATA name prepared files instead.
if [[ "${GROWMTP_REHEARSAL:-0}" == 1 ]]; then  # before common.sh turns on the CPU path and anything is prepared
  echo "evaluate.sh has no rehearsal: GROWMTP_REHEARSAL=1 rehearses the training scripts (docs/rehearsal.md)" >&2
  exit 2
fi
source "$(dirname "$0")/common.sh"
run=${1:?run directory}
domains=${2:-all}
shift $(( $# >= 2 ? 2 : 1 ))
case "$domains" in
  math|code|all) ;;
  *) echo "unknown domain '$domains' (math, code, all)" >&2; exit 2 ;;
esac

if [[ "$domains" != math ]]; then
  LCB_ATCODER_DATA=${LCB_ATCODER_DATA:-$DATA_ROOT/lcb_v6_atcoder.jsonl}
  LCB_LEETCODE_DATA=${LCB_LEETCODE_DATA:-$DATA_ROOT/lcb_v6_leetcode.jsonl}
  lcb_source=${LCB_SOURCE:-$DATA_ROOT/livecodebench/test6.jsonl}
  # a local file no step writes: refused before any benchmark is prepared, not after the math ones
  if [[ ( ! -f "$LCB_ATCODER_DATA" || ! -f "$LCB_LEETCODE_DATA" ) && ! -e "$lcb_source" && ( "$lcb_source" == *.jsonl \
        || "$lcb_source" == *.json || "$lcb_source" == *.parquet || "$lcb_source" == */*/* ) ]]; then
    echo "LiveCodeBench: $lcb_source does not exist (LCB_SOURCE). Download test6.jsonl from the hub dataset" \
      "livecodebench/code_generation_lite to that path, set LCB_SOURCE to your copy, or evaluate 'math' only" >&2
    exit 2
  fi
fi

benchmarks=()
if [[ "$domains" != code ]]; then
  AIME24_DATA=${AIME24_DATA:-$DATA_ROOT/aime24.jsonl}
  AIME25_DATA=${AIME25_DATA:-$DATA_ROOT/aime25.jsonl}
  AMC23_DATA=${AMC23_DATA:-$DATA_ROOT/amc23.jsonl}
  prepare aime24 "${AIME24_SOURCE:-HuggingFaceH4/aime_2024}" "$AIME24_DATA" --split train
  prepare aime25 "${AIME25_SOURCE:-math-ai/aime25}" "$AIME25_DATA" --split test
  prepare amc23 "${AMC23_SOURCE:-math-ai/amc23}" "$AMC23_DATA" --split test
  benchmarks+=(--math "aime24=$AIME24_DATA" --math "aime25=$AIME25_DATA" --math "amc23=$AMC23_DATA")
fi
if [[ "$domains" != math ]]; then
  # the private tests ship pickled: --read-pickled-tests reads them as opcodes and never unpickles
  for platform in atcoder leetcode; do
    out_var=LCB_${platform^^}_DATA
    prepare livecodebench "$lcb_source" "${!out_var}" \
      --platform "$platform" --read-pickled-tests
    benchmarks+=(--code "lcb_$platform=${!out_var}")
  done
fi

cmd=("$PYTHON" -m openrlhf_growmtp.cli.evaluate --model "$run/final" --head "$run/final/growmtp_head"
  "${benchmarks[@]}" --math-samples 16 --code-samples 4 --temperature 1.0 --top-p 0.7 --max-tokens 16384
  --time-limit-s 6 --out "${EVAL_OUT:-$run/eval}" "$@")
echo "+ ${cmd[*]}"
"${cmd[@]}"
