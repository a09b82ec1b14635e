#!/usr/bin/env bash
# MiMo-7B-SFT's native head drafting one token per cycle and never trained (the frozen K=1 baseline).
# usage: baseline_frozen_k1.sh <math|code> [extra flags]
source "$(dirname "$0")/common.sh"
domain=${1:?domain}
shift
K=1 RUN_NAME=${RUN_NAME:-mimo_7b_sft_${domain}_frozen_k1} run_growmtp mimo_7b_sft "$domain" --growmtp_mode frozen "$@"
