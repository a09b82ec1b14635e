#!/usr/bin/env bash
# `make rehearse`: every example script under GROWMTP_REHEARSAL=1 (3 RL steps each on this CPU, see common.sh),
# one after another; a summary at the end, exit 1 if any failed. A script that exits 2 saying its preset
# cannot be rehearsed on this machine is listed as such; any other exit 2 (a refused command) is a failure.
# Logs: $GROWMTP_REHEARSAL_DIR/logs (default runs/rehearsal/logs).
# usage: rehearse_all.sh [name ...]   (names as listed below; default all)
set -uo pipefail
here=$(dirname "$0")/scripts
logs=${GROWMTP_REHEARSAL_DIR:-runs/rehearsal}/logs
mkdir -p "$logs"
declare -A RUNS=(
  [qwen3_4b_math]="qwen3_4b_math.sh" [qwen3_4b_code]="qwen3_4b_code.sh"
  [mimo_7b_sft_math]="mimo_7b_sft_math.sh" [mimo_7b_sft_code]="mimo_7b_sft_code.sh"
  [qwen3_5_4b_base_math]="qwen3_5_4b_base_math.sh" [qwen3_5_4b_base_code]="qwen3_5_4b_base_code.sh"
  [baseline_ar_qwen3_4b_math]="baseline_ar.sh qwen3_4b math" [baseline_ar_mimo_7b_sft_code]="baseline_ar.sh mimo_7b_sft code"
  [baseline_frozen_k1_math]="baseline_frozen_k1.sh math" [baseline_frozen_k1_code]="baseline_frozen_k1.sh code"
  [ablation_ce]="ablation.sh ce" [ablation_kl]="ablation.sh kl" [ablation_tv]="ablation.sh tv"
  [ablation_no_vgm]="ablation.sh no_vgm" [ablation_teacher_forcing]="ablation.sh teacher_forcing"
  [ablation_joint]="ablation.sh joint" [ablation_frozen]="ablation.sh frozen"
)
ORDER=(qwen3_4b_math mimo_7b_sft_math qwen3_4b_code mimo_7b_sft_code baseline_ar_qwen3_4b_math
       baseline_frozen_k1_math ablation_ce ablation_kl ablation_tv ablation_no_vgm ablation_teacher_forcing
       ablation_joint ablation_frozen baseline_ar_mimo_7b_sft_code baseline_frozen_k1_code
       qwen3_5_4b_base_math qwen3_5_4b_base_code)
names=("$@")
[[ ${#names[@]} -gt 0 ]] || names=("${ORDER[@]}")
summary=() failed=0
for name in "${names[@]}"; do
  [[ -n "${RUNS[$name]:-}" ]] || { echo "unknown rehearsal '$name' (known: ${ORDER[*]})" >&2; exit 2; }
  read -r -a words <<< "${RUNS[$name]}"
  began=$SECONDS
  GROWMTP_REHEARSAL=1 bash "$here/${words[0]}" "${words[@]:1}" > "$logs/$name.log" 2>&1
  rc=$?
  # exit 2 is also a refused command (a bad flag, an invalid configuration): only the rehearsal's own words
  # for a preset this machine cannot run make it something other than a failure
  if [[ $rc == 0 ]]; then
    status="passed"
  elif [[ $rc == 2 ]] && grep -q 'cannot be rehearsed on this machine' "$logs/$name.log"; then
    status="not rehearsable here: $(grep -m1 -o 'on this machine: .*' "$logs/$name.log" | cut -c18-100)..."
  else
    status="FAILED (exit $rc, see $logs/$name.log)"; failed=1
  fi
  summary+=("$(printf '%-30s %4ds  %s' "$name" $((SECONDS - began)) "$status")")
  echo "${summary[-1]}"
  grep -E '^step [0-9]+:' "$logs/$name.log" | tail -1 | sed 's/^/    last /'
done
echo; printf '%s\n' "${summary[@]}"
exit $failed
