"""The envelope of each example recipe at its default settings, by arithmetic (derived, not measured).

    python -m benchmarks.envelope [--json docs/data/envelope/envelope.json]

Per recipe (examples/scripts/common.sh: 4 training GPUs under ZeRO-3 with the reference colocated, 4 vLLM
engines at --vllm.gpu_memory_utilization 0.8, 64 prompts x 8 samples, 1,024-token prompts at most, the preset's
micro-batches):
- a training GPU: `openrlhf_growmtp.memory_estimate`'s terms (the policy's and the reference's weights, the
  head and its update's measured peak, one micro-batch's logits in training and in the experience forward, the
  checkpointed layers' inputs), which the dry run also reads; each preset's micro-batches are the largest that
  fit the card less its margin, and `tests/benchmarks/test_envelope.py` holds the presets to that;
- an engine GPU: vLLM's pool (0.8 of the card), the bf16 weights inside it, the KV cache left, and how many
  sequences of the recipe's full length that cache holds at once against the requests each engine gets;
- host and Ray object store: the packed records of one RL step through the object store, and what each
  training rank holds unpacked (docs/guide.md, Memory), at tau 1 (a random head) and tau 3;
- seconds per RL step: Qwen3-4B only, from the H100 check's terms (docs/gpu_results.md: the CUDA-graph loop's
  rollout, the measured ZeRO-3 training step scaled to 64 responses of 256 + 8,192 tokens per GPU and 36 layers,
  the head's update), rescaled to the scripts' layout (512 responses over 4 training GPUs and 4 engines).
Left out, and so not bounded here: one layer's recompute, allocator fragmentation, NCCL and CUDA-graph buffers,
DeepSpeed's gather buckets (memory_estimate.MARGIN keeps a tenth of the card for them); Qwen3.5's checkpointed
layers' inputs (its layer count is not kept here). Measure with GROWMTP_SMOKE=1 at full length.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from openrlhf_growmtp.memory_estimate import ModelShape, TrainingLayout, training_gpu, usable_gib

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
MIB = 2**20
GPU_DATA = "docs/data/gpu/"  # the H100 check's kept runs (docs/gpu_results.md)
STEP_JSON = GPU_DATA + "trainer_step_head_update_graph_cycle_cost_2026-11-27.json"  # cycle_cost.end_to_end
LOOP_JSON = GPU_DATA + "rollout_loop_2026-11-27.json"  # rollout_loop.rollout (CUDA graphs)
HEAD_PEAK_JSON = GPU_DATA + "head_checks_chunk4096_2026-11-27.json"  # head_update_cost.peak_mb.head (Qwen3-4B)
DERIVED_JSON = GPU_DATA + "derived_2026-11-27.json"  # training.strict_step_over_plain_per_token
SAVE_STEPS, SMOKE_STEPS, SMOKE_RESPONSES, SMOKE_TOKENS = 50, 3, 8 * 4, 512  # common.sh's defaults
CARD_GIB = 80.0  # an H100 80GB: what the per-GPU figures are read against
TRAIN_RANKS, ENGINES, GPU_MEMORY_UTILIZATION = 4, 4, 0.8
PROMPTS, SAMPLES, PROMPT_TOKENS, CHUNK_CYCLES = 64, 8, 1024, 4096


@dataclass(frozen=True)
class Recipe:
    script: str
    params: float  # the policy's parameters (Qwen3-4B and MiMo-7B counted from their config fields below)
    params_source: str
    family: str
    hidden: int
    layers: int | None  # decoder layers (None: not kept here)
    layers_with_kv: int | None  # layers whose KV cache grows with every token (None: not derived)
    kv_heads: int
    head_dim: int
    vocab: int
    k: int
    response_tokens: int
    head_params: float  # bench_memory.py's count at the real shapes (docs/guide.md, Memory)
    micro_batch: int  # the preset's --train.micro_batch_size (common.sh)
    rollout_micro_batch: int  # the preset's --rollout.micro_batch_size


def dense_params(layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, mlp: int, vocab: int,
                 tied: bool, qwen2: bool) -> float:
    """A Qwen2 / Qwen3 decoder's parameters from its config fields: projections, MLP, norms (Qwen3's q/k norms),
    Qwen2's q/k/v biases, the embedding and (untied) the lm_head."""
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    extra = (heads + 2 * kv_heads) * head_dim if qwen2 else 2 * head_dim  # q/k/v biases, or q/k norms
    per_layer = attention + 3 * hidden * mlp + 2 * hidden + extra
    return layers * per_layer + vocab * hidden * (1 if tied else 2) + hidden


QWEN3_4B = dense_params(36, 2560, 32, 8, 128, 9728, 151936, tied=True, qwen2=False)
MIMO_7B = dense_params(36, 4096, 32, 8, 128, 11008, 151680, tied=False, qwen2=True)
RECIPES = (
    Recipe("qwen3_4b_math.sh, qwen3_4b_code.sh", QWEN3_4B, "config fields (36 layers, hidden 2,560)", "qwen3", 2560,
           36, 36, 8, 128, 151936, 5, 8192, 114.0e6, micro_batch=4, rollout_micro_batch=4),
    Recipe("qwen3_5_4b_base_math.sh, _code.sh", 4.0e9, "nominal (the model's name); its layer count is not kept "
           "here", "qwen3_5", 2560, None, None, 4, 256, 248320, 3, 16384, 120.6e6, micro_batch=1,
           rollout_micro_batch=2),
    Recipe("mimo_7b_sft_math.sh, _code.sh", MIMO_7B, "config fields (36 layers, hidden 4,096)", "mimo", 4096, 36, 36,
           8, 128, 151680, 5, 8192, 210.8e6, micro_batch=2, rollout_micro_batch=4),
)


def record_bytes_per_token(k: int, topk: int, tau: float) -> float:
    """Packed record bytes per generated token: per cycle the start (4), K drafts (4 each), K x top-k ids (4)
    and log-probs (bf16, 2), the accepted count (1); per token its id (4) (docs/guide.md, Memory)."""
    return (6 * k * topk + 4 * k + 5) / tau + 4


def recipe_training_gpu(r: Recipe, micro_batch: int | None = None, rollout_micro_batch: int | None = None) -> dict:
    """memory_estimate's terms for a recipe, at its preset's micro-batches unless others are given."""
    shape = ModelShape(params=r.params, vocab=r.vocab, hidden=r.hidden, layers=r.layers, head_params=r.head_params,
                       family=r.family)
    layout = TrainingLayout(ranks=TRAIN_RANKS, zero_stage=3, adam_offload=False, reference=True, trains_head=True,
                            chunk_cycles=CHUNK_CYCLES, tokens=PROMPT_TOKENS + r.response_tokens,
                            micro_batch=micro_batch or r.micro_batch,
                            rollout_micro_batch=rollout_micro_batch or r.rollout_micro_batch, checkpointing=True)
    return training_gpu(shape, layout)


def engine_gpu(r: Recipe) -> dict:
    pool = GPU_MEMORY_UTILIZATION * CARD_GIB
    weights = (r.params + r.head_params) * 2 / GIB
    out = {"pool_gib": pool, "weights_gib": weights, "kv_cache_gib": pool - weights,
           "requests_per_engine": PROMPTS * SAMPLES / ENGINES}
    if r.layers_with_kv is not None:
        per_token = 2 * r.layers_with_kv * r.kv_heads * r.head_dim * 2  # keys and values, bf16
        full_length = PROMPT_TOKENS + r.response_tokens + 2 * r.k  # the engines' headroom for drafts
        out.update(kv_bytes_per_token=per_token,
                   full_length_sequences_at_once=out["kv_cache_gib"] * GIB / (per_token * full_length))
    return out


def records(r: Recipe) -> dict:
    responses = PROMPTS * SAMPLES
    out = {}
    for tau in (1.0, 3.0):
        packed = record_bytes_per_token(r.k, 64, tau) * r.response_tokens
        out[f"tau_{tau:g}"] = {"object_store_gib_per_step": packed * responses / GIB,
                               "per_rank_unpacked_gib": packed * 1.7 * responses / TRAIN_RANKS / GIB}
    return out


def step_seconds(step: dict, loop: dict) -> dict:
    """Qwen3-4B's RL step in seconds at the scripts' layout, from the H100 check's per-GPU terms (64 responses a
    GPU on 8 GPUs): the scripts put 128 responses on each of 4 training GPUs and 4 engines."""
    e2e, rollout = step["cycle_cost"]["end_to_end"], loop["rollout_loop"]["rollout"]
    per_gpu = (PROMPTS * SAMPLES / TRAIN_RANKS) / 64  # 2: twice the responses per training GPU and per engine
    train, head = e2e["train_s"] * per_gpu, e2e["head_s"] * per_gpu
    ar_rollout = rollout["ar_s"] * per_gpu  # decode steps of 64 sequences, twice over (the KV cache's bound below)
    spec_rollout = rollout["spec_s"] * per_gpu
    return {"autoregressive_s": ar_rollout + train, "growmtp_at_tau_2.91_s": spec_rollout + train + head,
            "rollout_ar_s": ar_rollout, "rollout_growmtp_s": spec_rollout, "train_s": train, "head_update_s": head,
            "rollout_speedup": rollout["speedup"]}


def expectations(step: dict, strict_over_plain: float) -> dict:
    """What a user plans by, per recipe, from Qwen3-4B's step above (its training measured at 13 layers under
    strict determinism, `strict_over_plain` times the plain forward and backward per token; `..._plain` divides
    the training by it, what the step would take at the plain cost) and common.sh's settings: the other recipes
    scaled by their parameters, the rollout by the response cap and the training by prompt + response (a first-order
    guess: linear in both); the checkpoint interval every SAVE_STEPS RL steps; the smoke's steps (SMOKE_RESPONSES
    responses of SMOKE_TOKENS at most) by the same terms, the start-up left out (not measured on a GPU)."""
    base = RECIPES[0]
    train_plain = step["train_s"] / strict_over_plain
    per_training_gpu = PROMPTS * SAMPLES / TRAIN_RANKS  # 128 responses
    smoke_rollout = step["rollout_ar_s"] / 2 * SMOKE_TOKENS / base.response_tokens  # a 64-sequence step bounds 8
    smoke_share = SMOKE_RESPONSES / TRAIN_RANKS * (PROMPT_TOKENS + SMOKE_TOKENS) / (
        per_training_gpu * (PROMPT_TOKENS + base.response_tokens))
    out = {"strict_over_plain_per_token": strict_over_plain, "save_steps": SAVE_STEPS,
           "smoke": {"steps": SMOKE_STEPS, "step_s": smoke_rollout + step["train_s"] * smoke_share,
                     "step_s_plain": smoke_rollout + train_plain * smoke_share}, "recipes": []}
    for r in RECIPES:
        params = r.params / base.params
        rollout = step["rollout_ar_s"] * params * r.response_tokens / base.response_tokens
        tokens = params * (PROMPT_TOKENS + r.response_tokens) / (PROMPT_TOKENS + base.response_tokens)
        ar, ar_plain = rollout + step["train_s"] * tokens, rollout + train_plain * tokens
        out["recipes"].append({"script": r.script, "scaled_from_qwen3_4b": r is not base,
                               "autoregressive_step_s": ar, "autoregressive_step_s_plain": ar_plain,
                               "checkpoint_every_h": SAVE_STEPS * ar / 3600,
                               "checkpoint_every_h_plain": SAVE_STEPS * ar_plain / 3600,
                               "hours_per_100_steps": 100 * ar / 3600,
                               "hours_per_100_steps_plain": 100 * ar_plain / 3600})
    out["qwen3_4b_growmtp_step_s_plain"] = step["growmtp_at_tau_2.91_s"] - step["train_s"] + train_plain
    return out


def envelope() -> dict:
    read = lambda name: json.loads((ROOT / name).read_text())  # noqa: E731
    step = step_seconds(read(STEP_JSON), read(LOOP_JSON))
    strict = read(DERIVED_JSON)["training"]["strict_step_over_plain_per_token"]
    return {"derived": True, "card_gib": CARD_GIB, "usable_gib": usable_gib(CARD_GIB),
            "sources": [STEP_JSON, LOOP_JSON, HEAD_PEAK_JSON, DERIVED_JSON],
            "layout": {"training_ranks": TRAIN_RANKS, "engines": ENGINES, "gpu_memory_utilization":
                       GPU_MEMORY_UTILIZATION, "responses_per_step": PROMPTS * SAMPLES},
            "recipes": [{**asdict(r), "training_gpu": recipe_training_gpu(r), "engine_gpu": engine_gpu(r),
                         "records": records(r)} for r in RECIPES],
            "qwen3_4b_step": step, "expectations": expectations(step, strict)}


def describe(env: dict) -> str:
    lines = [f"envelope (derived by arithmetic; per-GPU figures against an {env['card_gib']:.0f} GiB card)"]
    for r in env["recipes"]:
        t, e = r["training_gpu"], r["engine_gpu"]
        lines.append(f"{r['script']}: {r['params'] / 1e9:.2f} B parameters ({r['params_source']})")
        inputs = (f"{t['checkpointed_inputs_gib']:.1f}" if r["layers"] else "(layer count not kept)")
        lines.append(f"  training GPU at micro-batches {r['micro_batch']} (training) and {r['rollout_micro_batch']} "
                     f"(experience): policy {t['policy_gib']:.1f} + reference {t['reference_gib']:.1f} + head "
                     f"{t['head_gib']:.2f}; training + head update {t['head_update_peak_gib']:.1f} + logits "
                     f"{t['micro_batch_logits_gib']:.1f} + checkpointed inputs {inputs} = {t['training_gib']:.1f} "
                     f"GiB; experience + logits {t['rollout_micro_batch_logits_gib']:.1f} = {t['experience_gib']:.1f} "
                     f"GiB (fits below {env['usable_gib']:.0f})")
        seqs = e.get("full_length_sequences_at_once")
        fit = (f"; its KV cache holds {seqs:.0f} sequences of full length at once, of "
               f"{e['requests_per_engine']:.0f} requests" if seqs is not None else "")
        lines.append(f"  engine GPU: vLLM's pool {e['pool_gib']:.0f} GiB, weights {e['weights_gib']:.1f}, KV cache "
                     f"{e['kv_cache_gib']:.1f}{fit}")
        rec = r["records"]
        lines.append("  records per RL step through Ray's object store: "
                     + ", ".join(f"{v['object_store_gib_per_step']:.1f} GiB at {k.replace('_', ' ')} "
                                 f"({v['per_rank_unpacked_gib']:.1f} GiB unpacked per training rank)"
                                 for k, v in rec.items()))
    s = env["qwen3_4b_step"]
    lines.append(f"Qwen3-4B, seconds per RL step at the scripts' layout: autoregressive {s['autoregressive_s']:.0f} "
                 f"(rollout {s['rollout_ar_s']:.0f}, training {s['train_s']:.0f}); GrowMTP at tau 2.91 "
                 f"{s['growmtp_at_tau_2.91_s']:.0f} (rollout {s['rollout_growmtp_s']:.0f}, head update "
                 f"{s['head_update_s']:.0f})")
    x = env["expectations"]
    lines.append(f"expectations (training from a strict 13-layer step, {x['strict_over_plain_per_token']:.1f}x "
                 "the plain cost per token; 'plain': at the plain cost):")
    for r in x["recipes"]:
        lines.append(f"  {r['script']}{' (scaled from Qwen3-4B)' if r['scaled_from_qwen3_4b'] else ''}: "
                     f"autoregressive step {r['autoregressive_step_s']:.0f} s "
                     f"(plain {r['autoregressive_step_s_plain']:.0f}),"
                     f" a checkpoint every {r['checkpoint_every_h']:.1f} h (plain {r['checkpoint_every_h_plain']:.1f})")
    lines.append(f"  the smoke (Qwen3-4B): {x['smoke']['steps']} steps of about {x['smoke']['step_s']:.0f} s "
                 f"(plain {x['smoke']['step_s_plain']:.0f}), its start-up left out")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    env = envelope()
    print(describe(env))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(env, indent=1) + "\n")


if __name__ == "__main__":
    main()
