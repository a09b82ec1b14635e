#!/usr/bin/env bash
# MiMo-7B-SFT on TACO-Verified: its native MTP head, K=5 (the depth study: K=3 or K=7 in the environment).
source "$(dirname "$0")/common.sh"
run_growmtp mimo_7b_sft code "$@"
