#!/usr/bin/env bash
# The autoregressive baseline of any run: the same GRPO settings, no draft head (--growmtp_k 0).
# usage: baseline_ar.sh <qwen3_4b|qwen3_5_4b_base|mimo_7b_sft> <math|code> [extra flags]
source "$(dirname "$0")/common.sh"
model=${1:?model preset}; domain=${2:?domain}
shift 2
K=0 run_growmtp "$model" "$domain" "$@"
