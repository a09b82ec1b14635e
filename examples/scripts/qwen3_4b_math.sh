#!/usr/bin/env bash
# Qwen3-4B on DAPO-Math-17K: a random head grown from scratch, K=5, thinking mode, 8192-token responses.
source "$(dirname "$0")/common.sh"
run_growmtp qwen3_4b math "$@"
