#!/usr/bin/env bash
# The ablation arms, each changing one thing from the GrowMTP default (DCA, VGM on, detached):
#   ce | kl | tv          the head objective
#   no_vgm                 verify-gated masking off
#   teacher_forcing        train on the committed response instead of the recorded draft paths
#   joint | frozen         head gradients also reach the backbone / the head is never updated
# usage: ablation.sh <arm> [math|code [extra flags]]; MODEL=<preset> (default mimo_7b_sft, K=5)
source "$(dirname "$0")/common.sh"
arm=${1:?ablation arm}
domain=${2:-math}
shift $(( $# >= 2 ? 2 : 1 ))
case "$arm" in
  ce|kl|tv)        flags=(--growmtp_loss "$arm") ;;
  no_vgm)          flags=(--growmtp_no_vgm) ;;
  teacher_forcing) flags=(--growmtp_teacher_forcing) ;;
  joint|frozen)    flags=(--growmtp_mode "$arm") ;;
  *) echo "unknown ablation arm '$arm' (ce, kl, tv, no_vgm, teacher_forcing, joint, frozen)" >&2; exit 2 ;;
esac
model=${MODEL:-mimo_7b_sft}
RUN_NAME=${RUN_NAME:-${model}_${domain}_${arm}} run_growmtp "$model" "$domain" "${flags[@]}" "$@"
