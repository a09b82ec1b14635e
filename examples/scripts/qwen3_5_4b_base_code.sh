#!/usr/bin/env bash
# Qwen3.5-4B-Base on TACO-Verified: its native MTP head, K=3, 16384-token responses.
source "$(dirname "$0")/common.sh"
run_growmtp qwen3_5_4b_base code "$@"
