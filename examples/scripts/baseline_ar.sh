#!/usr/bin/env bash
# The autoregressive baseline of any run: the same GRPO settings, no draft head (--growmtp_k 0). Its engines
# run vLLM's defaults (on a GPU: the V2 model runner, asynchronous scheduling); MATCHED_RUNNER=1 runs them on
# GrowMTP's runner and scheduling instead (--vllm.runner growmtp: V1, synchronous), a baseline matched to
# GrowMTP's engine. Against the GrowMTP run, the matched baseline measures the method's gain; the default one,
# the gain net of what GrowMTP's runner costs (docs/guide.md, "A fair baseline").
# usage: [MATCHED_RUNNER=1] baseline_ar.sh <qwen3_4b|qwen3_5_4b_base|mimo_7b_sft> <math|code> [extra flags]
source "$(dirname "$0")/common.sh"
model=${1:?model preset}; domain=${2:?domain}
shift 2
suffix=$([[ "${MATCHED_RUNNER:-0}" == 1 ]] && echo _matched || true)
K=0 RUN_NAME=${RUN_NAME:-${model}_${domain}_k0$suffix} run_growmtp "$model" "$domain" "$@"
