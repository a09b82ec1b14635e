# Shared block of the example scripts: cluster layout, the paper's GRPO settings, model presets, data.
# Source it, then call `run_growmtp <model> <domain> [extra flags...]` (see README "Running on GPUs").
#
# Environment (every default is the public name; point them at local copies on an offline cluster):
#   QWEN3_4B, QWEN3_5_4B_BASE, MIMO_7B_SFT   model directories (default: the hub ids)
#   MATH_SOURCE, CODE_SOURCE                 dataset source for prepare_data (default: the hub ids)
#   MATH_DATA, CODE_DATA                     prepared prompt files (default: data/<name>.<model>.jsonl, made once
#                                            per model: prompts over PROMPT_TOKENS of its tokenizer are dropped)
#   K, HEAD                                  override the preset's depth / head ("random", "native", a dir)
#   ACTOR_NODES, ACTOR_GPUS                  nodes for the policy (and its colocated reference) and GPUs on each
#                                            (default 1 x 4)
#   VLLM_ENGINES, VLLM_TP                    vLLM engines in all, on any node with free GPUs, and GPUs per engine
#                                            (default 4 x 1); the default layout fills one 8-GPU node
#   MAX_NUM_SEQS                             requests each vLLM engine decodes at once (default: vLLM's); set
#                                            it alike for a run and its baseline_ar.sh
#   OUTPUT_ROOT                              where every run writes (default ./runs); on a cluster a directory
#                                            of the shared filesystem that every node mounts at the same path
#   RUN_NAME                                 the run's name, <run> below (default <model>_<domain>_k<K>): a
#                                            second run of one script and K needs its own, or RUN_ROOT, as it
#                                            would write into the first one's directory
#   RUN_ROOT                                 one run's checkpoints, logs and exports (default OUTPUT_ROOT/<run>);
#                                            under GROWMTP_SMOKE=1 the smoke writes to RUN_ROOT_smoke instead
#   GROWMTP_RAY_TMP                          Ray's temporary directory on a CPU run (default: Ray's /tmp/ray)
#   DATA_ROOT                                the prepared prompt files (default ./data; shared on a cluster)
#   PYTHON                                   interpreter (default python)
#   GROWMTP_DRY_RUN=1                        build the command, run every startup check, exit 0 before Ray
#   GROWMTP_REHEARSAL=1                      run the script's own command for 3 RL steps on this machine's CPU
#                                            (below); GROWMTP_REHEARSAL_DIR holds its world and runs
#   GROWMTP_SMOKE=1                          a few RL steps at short lengths, then a verdict (below)
set -euo pipefail

PYTHON=${PYTHON:-python}
ACTOR_NODES=${ACTOR_NODES:-1}
ACTOR_GPUS=${ACTOR_GPUS:-4}
VLLM_ENGINES=${VLLM_ENGINES:-4}
VLLM_TP=${VLLM_TP:-1}
PROMPT_TOKENS=1024  # prompts over 1024 tokens are dropped by prepare_data; --data.max_len is prompt + response
# Absolute paths: the launcher writes its checkpoints and the initial head under them, and every node's actors
# read them (a relative path would name another directory in a `ray job submit` working directory)
if [[ -n "${RAY_ADDRESS:-}" && -z "${OUTPUT_ROOT:-}" ]]; then
  echo "note: RAY_ADDRESS is set but OUTPUT_ROOT is not: outputs go under $PWD/runs, which is this job's working" \
       "directory; set OUTPUT_ROOT (and DATA_ROOT) to the shared filesystem (docs/guide.md, Running on a cluster)" >&2
fi
OUTPUT_ROOT=$(realpath -m "${OUTPUT_ROOT:-runs}")
DATA_ROOT=$(realpath -m "${DATA_ROOT:-data}")

# GROWMTP_REHEARSAL=1: the script's exact command on a tiny local stand-in of its model (the family's real
# config fields, vocabulary size, special tokens and tokenizer length; `growmtp_lab/rehearse.py`) and 6 raw rows of
# its dataset in the source's schema, converted by prepare_data as usual. Only sizes shrink: one training
# rank, one engine, 2 prompts x 4 samples per step (3 steps), 64-token responses. Every other flag is the
# script's. Prints tau, alpha_k, reward and times per step; exits non-zero on any failure.
REHEARSAL=${GROWMTP_REHEARSAL:-0}
REHEARSAL_DIR=$(realpath -m "${GROWMTP_REHEARSAL_DIR:-runs/rehearsal}")
REHEARSAL_SIZES=(--rollout.batch_size 2 --rollout.n_samples_per_prompt 4 --train.batch_size 8)

# GROWMTP_SMOKE=1: before a long run, a few RL steps of the script's own command at short lengths, with the
# engines' head compared with the trainer's after every sync (--growmtp_check_sync), then a verdict
# (`python -m openrlhf_growmtp.cli.smoke`): records equal vLLM's own counters, the heads equal, tau and the head
# loss finite, memory per device, seconds per phase. Before it starts it lists the paths no GPU has run yet and
# the fallback for each. A GPU run (below) runs on the GPUs at the script's layout and model: SMOKE_STEPS RL
# steps (default 3) of 8 prompts x 4 samples, SMOKE_TOKENS-token responses (default 512). A CPU run (or
# GROWMTP_REHEARSAL=1) runs the rehearsal below on the CPU instead (vLLM's CPU build).
SMOKE=${GROWMTP_SMOKE:-0}
SMOKE_STEPS=${SMOKE_STEPS:-3}
SMOKE_TOKENS=${SMOKE_TOKENS:-512}
SMOKE_PROMPTS=8
# CPU or GPU as the launcher decides it (cpu_support.decide_run): the Ray cluster's GPUs where RAY_ADDRESS names
# one, else this machine's CUDA; GROWMTP_CPU=1 or 0 decides instead
if [[ "$SMOKE" == 1 && "$REHEARSAL" != 1 && "${GROWMTP_DRY_RUN:-0}" != 1 ]] &&
   why=$("$PYTHON" -c "from openrlhf_growmtp import cpu_support as c; why = c.decide_run(); print(why); exit(not c.needed())"); then
  echo "GROWMTP_SMOKE=1: a CPU run ($why); the smoke runs on this CPU, as a rehearsal (docs/rehearsal.md)"
  REHEARSAL=1 SMOKE_STEPS=3
fi
if [[ "$REHEARSAL" == 1 ]]; then
  # a rehearsal is a CPU run on any machine, CUDA or not: the launcher's decision (cpu_support reads GROWMTP_CPU),
  # whichever switch asked for the rehearsal
  export GROWMTP_REHEARSAL=1 GROWMTP_CPU=1
  ACTOR_NODES=1 ACTOR_GPUS=1 VLLM_ENGINES=1 VLLM_TP=1
fi

# The paper's policy optimisation: GRPO (group-normalised advantages), negative-advantage weight 0.5,
# dual clip, token-level averaging, KL 0.01 as a loss against the fixed initial policy, AdamW at a
# constant 1e-6, clip 0.2; 64 prompts x 8 samples and one policy step per RL step; temperature 1,
# top-p 1; data order seed 1.
GRPO=(
  --algo.advantage.estimator group_norm
  --growmtp_neg_adv_weight 0.5
  --actor.eps_clip 0.2 --actor.dual_clip 3.0
  --actor.loss_agg_mode token-mean
  --algo.kl.use_loss --algo.kl.init_coef 0.01 --algo.kl.estimator k3
  --actor.adam.lr 1e-6 --actor.lr_scheduler constant --actor.lr_warmup_ratio 0
  --rollout.batch_size 64 --rollout.n_samples_per_prompt 8 --train.batch_size 512 --train.max_epochs 1
  --rollout.temperature 1.0 --rollout.top_p 1.0
  --train.seed 1
)

CLUSTER=(
  --actor.num_nodes "$ACTOR_NODES" --actor.num_gpus_per_node "$ACTOR_GPUS"
  --ref.num_nodes "$ACTOR_NODES" --ref.num_gpus_per_node "$ACTOR_GPUS" --train.colocate_actor_ref
  --vllm.num_engines "$VLLM_ENGINES" --vllm.tensor_parallel_size "$VLLM_TP" --vllm.gpu_memory_utilization 0.8
  --ds.zero_stage 3 --ds.param_dtype bf16 --actor.gradient_checkpointing_enable
)

# preset <model>: MODEL_PATH, the head, its depth K and the response cap, as in the paper; the micro-batches of
# training and of the experience forward (MICRO, ROLLOUT_MICRO): the largest whose estimate per training GPU fits
# an 80 GiB card less a tenth (docs/guide.md, the envelope: one micro-batch's logits alone are 7.8 GiB a sequence
# at Qwen3-4B's and MiMo's 9,216 tokens, 24.2 at Qwen3.5's 17,408); the dry run warns when a run's does not
preset() {
  case "$1" in
    qwen3_4b)        MODEL_PATH=${QWEN3_4B:-Qwen/Qwen3-4B};              PRESET_HEAD=random; PRESET_K=5; MAX_NEW=8192
                     MICRO=4 ROLLOUT_MICRO=4 ;;
    qwen3_5_4b_base) MODEL_PATH=${QWEN3_5_4B_BASE:-Qwen/Qwen3.5-4B-Base}; PRESET_HEAD=native; PRESET_K=3; MAX_NEW=16384
                     MICRO=1 ROLLOUT_MICRO=2 ;;
    mimo_7b_sft)     MODEL_PATH=${MIMO_7B_SFT:-XiaomiMiMo/MiMo-7B-SFT};   PRESET_HEAD=native; PRESET_K=5; MAX_NEW=8192
                     MICRO=2 ROLLOUT_MICRO=4 ;;
    *) echo "unknown model preset '$1' (qwen3_4b, qwen3_5_4b_base, mimo_7b_sft)" >&2; return 2 ;;
  esac
}

# data <domain> <model>: the prepared prompt file and the reward function. The file is made once per model
# from the source (after `preset`, which sets MODEL_PATH): the prompt cap counts with the model's tokenizer.
data() {
  local name source
  case "$1" in
    math) name=dapo-math;     source=${MATH_SOURCE:-BytedTsinghua-SIA/DAPO-Math-17k}
          PROMPT_DATA=${MATH_DATA:-$DATA_ROOT/dapo-math-17k.$2.jsonl}; REWARD=openrlhf_growmtp/rewards/math_reward.py ;;
    code) name=taco-verified; source=${CODE_SOURCE:-likaixin/TACO-verified}
          PROMPT_DATA=${CODE_DATA:-$DATA_ROOT/taco-verified.$2.jsonl}; REWARD=openrlhf_growmtp/rewards/code_reward.py ;;
    *) echo "unknown domain '$1' (math, code)" >&2; return 2 ;;
  esac
  REWARD=$("$PYTHON" -c "import openrlhf_growmtp, pathlib; print(pathlib.Path(openrlhf_growmtp.__file__).parent.parent / '$REWARD')")
  prepare "$name" "$source" "$PROMPT_DATA" --max-prompt-tokens "$PROMPT_TOKENS" --tokenizer "$MODEL_PATH"
}

# prepare <dataset> <source> <out> [prepare_data flags]: write <out> once; skipped under GROWMTP_DRY_RUN=1
prepare() {
  local dataset=$1 source=$2 out=$3
  shift 3
  if [[ "${GROWMTP_DRY_RUN:-0}" != 1 && ! -f "$out" ]]; then
    mkdir -p "$(dirname "$out")"
    "$PYTHON" -m openrlhf_growmtp.cli.prepare_data "$dataset" "$source" "$out" "$@"
  fi
}

# run_growmtp <model> <domain> [extra flags]: K and HEAD from the preset unless set in the environment;
# K=0 is the autoregressive baseline (no head at all).
run_growmtp() {
  local model=$1 domain=$2
  shift 2
  preset "$model"
  local k=${K:-$PRESET_K} head=${HEAD:-$PRESET_HEAD}
  local run=${RUN_NAME:-${model}_${domain}_k${k}}
  if [[ "$SMOKE" == 1 ]]; then
    run=${run}_smoke  # never a real run's directory: the smoke starts from an empty one
    MAX_NEW=$SMOKE_TOKENS
  fi
  local root
  root=$(realpath -m "${RUN_ROOT:-$OUTPUT_ROOT/$run}")
  if [[ "$SMOKE" == 1 && -n "${RUN_ROOT:-}" ]]; then
    root=${root%_smoke}_smoke  # RUN_ROOT names the real run: the smoke writes beside it, never into it
  fi
  if [[ "$REHEARSAL" == 1 ]]; then
    # a CPU run on any machine (GROWMTP_CPU=1, exported above, decides it, CUDA or not); its engines need vLLM's
    # CPU build
    "$PYTHON" -c "import sys; from openrlhf_growmtp.cpu_support import rehearsal_install_problem as p; m = p()
sys.exit(m and 'GROWMTP_REHEARSAL=1: ' + m)"
    "$PYTHON" -m growmtp_lab.rehearse world "$REHEARSAL_DIR/world" "$model"
    MODEL_PATH=$REHEARSAL_DIR/world/$model MAX_NEW=64 root=$REHEARSAL_DIR/runs/$run
    MATH_SOURCE=$REHEARSAL_DIR/world/dapo-math.jsonl MATH_DATA=$REHEARSAL_DIR/world/dapo-math.$model.jsonl
    CODE_SOURCE=$REHEARSAL_DIR/world/taco-verified.jsonl CODE_DATA=$REHEARSAL_DIR/world/taco-verified.$model.jsonl
    rm -f "$MATH_DATA" "$CODE_DATA"
    # <rehearsal dir>/runs/<run> starts empty; emptied only if an earlier rehearsal made it (the smoke's own below)
    if [[ "$SMOKE" != 1 && "${GROWMTP_DRY_RUN:-0}" != 1 ]]; then
      fresh_own_dir "$root" "$REHEARSAL_MARKER" "GROWMTP_REHEARSAL=1" "a rehearsal" GROWMTP_REHEARSAL_DIR
    fi
  fi
  if [[ "$SMOKE" != 1 && "$REHEARSAL" != 1 && -f "$root/ckpt/_actor/latest" && " $* " != *" --ckpt.load_enable "* ]]
  then  # a second run into the first one's directory would rotate its checkpoints away and replace its export
    echo "$root already holds a run's checkpoints ($root/ckpt): resume it by appending --ckpt.load_enable, or" \
         "start another run with RUN_NAME or RUN_ROOT set elsewhere" >&2
    return 2
  fi
  data "$domain" "$model"
  local cmd=("$PYTHON" -m openrlhf_growmtp.cli.train_ppo_ray
    --actor.model_name_or_path "$MODEL_PATH"
    "${CLUSTER[@]}" --train.micro_batch_size "$MICRO" --rollout.micro_batch_size "$ROLLOUT_MICRO" "${GRPO[@]}"
    --data.prompt_dataset "$PROMPT_DATA" --data.input_key prompt --data.label_key label --data.apply_chat_template
    --data.max_len $((PROMPT_TOKENS + MAX_NEW)) --rollout.max_new_tokens "$MAX_NEW"
    --reward.remote_url "$REWARD"
    --ckpt.path "$root/ckpt" --ckpt.save_steps 50 --ckpt.output_dir "$root/final"
    --logger.tensorboard_dir "$root/tensorboard"
    --growmtp_k "$k")
  if [[ -n "${MAX_NUM_SEQS:-}" ]]; then
    cmd+=(--vllm.max_num_seqs "$MAX_NUM_SEQS")
  fi
  if [[ "$k" != 0 ]]; then
    # chunks of 4096 cycles: a GPU's default (docs/gpu_results.md: the update's time and peak at 1024 and 4096);
    # a rehearsal's updates hold fewer cycles than either, so it runs one chunk
    cmd+=(--growmtp_head "$head" --growmtp_chunk_cycles 4096)
    if [[ -n "${DRAFT_VOCAB:-}" ]]; then  # draft over the run's DRAFT_VOCAB most frequent token ids (docs/guide.md)
      cmd+=(--growmtp_draft_vocab "$DRAFT_VOCAB")
    fi
  elif [[ "${MATCHED_RUNNER:-0}" == 1 ]]; then
    cmd+=(--vllm.runner growmtp)  # the autoregressive arm on GrowMTP's runner and scheduling (a matched baseline)
  fi
  if [[ "$REHEARSAL" == 1 ]]; then
    cmd+=("${REHEARSAL_SIZES[@]}")
  elif [[ "$SMOKE" == 1 ]]; then
    cmd+=(--rollout.batch_size "$SMOKE_PROMPTS" --rollout.n_samples_per_prompt 4
          --train.batch_size $((SMOKE_PROMPTS * 4)) --data.max_samples $((SMOKE_PROMPTS * SMOKE_STEPS)))
  fi
  if [[ "$SMOKE" == 1 ]]; then
    cmd+=(--growmtp_check_sync)
    # <run>_smoke starts empty (the verdict reads this run's steps only); emptied only if an earlier smoke made it
    [[ "${GROWMTP_DRY_RUN:-0}" == 1 ]] || fresh_smoke_dir "$root"
  fi
  cmd+=("$@")
  if [[ "$SMOKE" == 1 ]]; then
    local where=()
    [[ "$REHEARSAL" == 1 ]] && where=(--cpu)
    "$PYTHON" -m openrlhf_growmtp.cli.smoke paths "${where[@]}" -- "${cmd[@]}"
  fi
  echo "+ ${cmd[*]}"
  "${cmd[@]}"
  if [[ "$SMOKE" == 1 && "${GROWMTP_DRY_RUN:-0}" != 1 ]]; then
    local verdict=("$PYTHON" -m openrlhf_growmtp.cli.smoke verdict "$root/ckpt" --steps "$SMOKE_STEPS" --k "$k")
    if frozen "${cmd[@]}"; then
      verdict+=(--frozen)
    fi
    "${verdict[@]}"
  elif [[ "$REHEARSAL" == 1 ]]; then
    local report=("$PYTHON" -m growmtp_lab.rehearse report "$root/tensorboard" --steps 3 --k "$k")
    if frozen "${cmd[@]}"; then
      report+=(--frozen)
    fi
    if [[ "$head" == random ]]; then
      report+=(--random-head)
    elif [[ "$head" == native ]]; then  # each step held to the tau the world's build measured for the head
      report+=(--world "$MODEL_PATH")
    fi
    "${report[@]}"
  fi
}

# fresh_own_dir <dir> <marker> <who> <maker> <where>: make <dir> an empty directory marked as <maker>'s own (a
# smoke's, a rehearsal's). A directory it did not make (no marker) is never deleted: <who> stops, naming it and
# <where>, the variable that puts the directory elsewhere.
SMOKE_MARKER=.growmtp_smoke
REHEARSAL_MARKER=.growmtp_rehearsal
fresh_own_dir() {
  local dir=$1 marker=$2 who=$3 maker=$4 where=$5
  if [[ -e "$dir" && ! -f "$dir/$marker" ]] && [[ ! -d "$dir" || -n "$(ls -A "$dir")" ]]; then
    echo "$who: $dir exists and was not made by $maker (no $marker in it); $maker deletes its own directory" \
         "before it runs, so it stops here: move that directory or set $where elsewhere" >&2
    return 2
  fi
  rm -rf "$dir"
  mkdir -p "$dir"
  touch "$dir/$marker"
}
fresh_smoke_dir() { fresh_own_dir "$1" "$SMOKE_MARKER" "GROWMTP_SMOKE=1" "a smoke" RUN_ROOT; }

# frozen <command...>: whether the command's last --growmtp_mode / --growmtp.mode is "frozen"
frozen() {
  local previous="" mode=""
  for word in "$@"; do
    if [[ "$previous" == --growmtp_mode || "$previous" == --growmtp.mode ]]; then
      mode=$word
    fi
    previous=$word
  done
  [[ "$mode" == frozen ]]
}
