"""The envelope of each example recipe at its default settings, by arithmetic (derived, not measured).

    python benchmarks/envelope.py [--json docs/data/envelope/envelope.json]

Per recipe (examples/scripts/common.sh: 4 training GPUs under ZeRO-3 with the reference colocated, 4 vLLM
engines at --vllm.gpu_memory_utilization 0.8, 64 prompts x 8 samples, 1,024-token prompts at most):
- a training GPU: the policy's bf16 weights, gradients and Adam state (16 bytes a parameter) and the reference's
  bf16 weights (2), each split over the ranks; the head's the same way; the measured peak of the head update at
  chunks of 4,096 (H100, Qwen3-4B; the other families add their CPU lines' difference, docs/guide.md); and one
  micro-batch's logits over the vocabulary (bf16, and fp32 for the log-softmax), the largest single activation;
- an engine GPU: vLLM's pool (0.8 of the card), the bf16 weights inside it, the KV cache left, and how many
  sequences of the recipe's full length that cache holds at once against the requests each engine gets;
- host and Ray object store: the packed records of one RL step through the object store, and what each
  training rank holds unpacked (docs/guide.md, Memory), at tau 1 (a random head) and tau 3;
- seconds per RL step: Qwen3-4B only, from the H100 check's terms (docs/gpu_results.md: the CUDA-graph loop's
  rollout, the measured ZeRO-3 training step scaled to 64 responses of 256 + 8,192 tokens per GPU and 36 layers,
  the head's update), rescaled to the scripts' layout (512 responses over 4 training GPUs and 4 engines).
Left out, and so not bounded here: the checkpointed layers' saved inputs and one layer's recompute, allocator
fragmentation, NCCL and CUDA-graph buffers, DeepSpeed's gather buckets. Measure with GROWMTP_SMOKE=1.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
MIB = 2**20
GPU_DATA = "docs/data/gpu/"  # the H100 check's kept runs (docs/gpu_results.md)
STEP_JSON = GPU_DATA + "trainer_step_head_update_graph_cycle_cost_2026-11-27.json"  # cycle_cost.end_to_end
LOOP_JSON = GPU_DATA + "rollout_loop_2026-11-27.json"  # rollout_loop.rollout (CUDA graphs)
HEAD_PEAK_JSON = GPU_DATA + "head_checks_chunk4096_2026-11-27.json"  # head_update_cost.peak_mb.head (Qwen3-4B)
CARD_GIB = 80.0  # an H100 80GB: what the per-GPU figures are read against
TRAIN_RANKS, ENGINES, GPU_MEMORY_UTILIZATION = 4, 4, 0.8
PROMPTS, SAMPLES, MICRO_BATCH, PROMPT_TOKENS = 64, 8, 4, 1024
POLICY_BYTES, REFERENCE_BYTES = 16, 2  # bf16 weights + grads + fp32 master, m, v; bf16 weights


@dataclass(frozen=True)
class Recipe:
    script: str
    params: float  # the policy's parameters (Qwen3-4B and MiMo-7B counted from their config fields below)
    params_source: str
    layers_with_kv: int | None  # layers whose KV cache grows with every token (None: not derived)
    kv_heads: int
    head_dim: int
    vocab: int
    k: int
    response_tokens: int
    head_params: float  # bench_memory.py's count at the real shapes (docs/guide.md, Memory)
    head_peak_extra_mib: float  # the family's CPU line above Qwen3-4B's at 4,096 cycles (docs/guide.md)


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
    Recipe("qwen3_4b_math.sh, qwen3_4b_code.sh", QWEN3_4B, "config fields (36 layers, hidden 2,560)", 36, 8, 128,
           151936, 5, 8192, 114.0e6, 0.0),
    Recipe("qwen3_5_4b_base_math.sh, _code.sh", 4.0e9, "nominal (the model's name); its layer count is not kept "
           "here", None, 4, 256, 248320, 3, 16384, 120.6e6, 230.0),
    Recipe("mimo_7b_sft_math.sh, _code.sh", MIMO_7B, "config fields (36 layers, hidden 4,096)", 36, 8, 128, 151680,
           5, 8192, 210.8e6, 820.0),
)


def record_bytes_per_token(k: int, topk: int, tau: float) -> float:
    """Packed record bytes per generated token: per cycle the start (4), K drafts (4 each), K x top-k ids (4)
    and log-probs (bf16, 2), the accepted count (1); per token its id (4) (docs/guide.md, Memory)."""
    return (6 * k * topk + 4 * k + 5) / tau + 4


def training_gpu(r: Recipe, head_peak_mib: float) -> dict:
    tokens = PROMPT_TOKENS + r.response_tokens
    out = {"policy_gib": r.params * POLICY_BYTES / TRAIN_RANKS / GIB,
           "reference_gib": r.params * REFERENCE_BYTES / TRAIN_RANKS / GIB,
           "head_gib": r.head_params * POLICY_BYTES / TRAIN_RANKS / GIB,
           "head_update_peak_gib": (head_peak_mib + r.head_peak_extra_mib) * MIB / GIB,
           "micro_batch_logits_gib": MICRO_BATCH * tokens * r.vocab * (2 + 4) / GIB}
    out["sum_gib"] = sum(out.values())
    return out


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


def envelope() -> dict:
    read = lambda name: json.loads((ROOT / name).read_text())  # noqa: E731
    head_peak = read(HEAD_PEAK_JSON)["head_update_cost"]["peak_mb"]["head"]
    return {"derived": True, "card_gib": CARD_GIB, "sources": [STEP_JSON, LOOP_JSON, HEAD_PEAK_JSON],
            "layout": {"training_ranks": TRAIN_RANKS, "engines": ENGINES, "gpu_memory_utilization":
                       GPU_MEMORY_UTILIZATION, "responses_per_step": PROMPTS * SAMPLES, "micro_batch": MICRO_BATCH},
            "recipes": [{**asdict(r), "training_gpu": training_gpu(r, head_peak), "engine_gpu": engine_gpu(r),
                         "records": records(r)} for r in RECIPES],
            "qwen3_4b_step": step_seconds(read(STEP_JSON), read(LOOP_JSON))}


def describe(env: dict) -> str:
    lines = [f"envelope (derived by arithmetic; per-GPU figures against an {env['card_gib']:.0f} GiB card)"]
    for r in env["recipes"]:
        t, e = r["training_gpu"], r["engine_gpu"]
        lines.append(f"{r['script']}: {r['params'] / 1e9:.2f} B parameters ({r['params_source']})")
        lines.append(f"  training GPU: policy {t['policy_gib']:.1f} + reference {t['reference_gib']:.1f} + head "
                     f"{t['head_gib']:.2f} + head update {t['head_update_peak_gib']:.1f} + one micro-batch's logits "
                     f"{t['micro_batch_logits_gib']:.1f} = {t['sum_gib']:.1f} GiB, activations left out")
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
