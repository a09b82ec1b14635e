"""What GrowMTP adds to memory at the real shapes of Qwen3-4B, Qwen3.5-4B-Base and MiMo-7B, measured on CPU.

Each family's config is built here from its released config's fields (hidden size, heads, head width, MLP,
vocabulary, tying); nothing is downloaded. Three parts:

1. **Records.** Real `SequenceRecord`s of one response (`bench_common.records_at_tau`: cycles of mean accepted
   τ − 1) at each K and top-k, packed as the engine sends them. Printed: bytes of the packed record per response
   and per generated token, in transport-free mode (the default: the trainer recomputes H_p) and in exact mode
   (the engine's bf16 hidden states ride along), and the bytes the record holds in the trainer once unpacked
   (ids as int64). The count is the packed tensors' own bytes (`record_tensor_bytes`); the safetensors header
   is printed apart.
2. **The head.** Its parameters, counted on the meta device (no memory), and what training them holds under
   DeepSpeed's bf16 mixed precision: bf16 weights and gradients (2 + 2 bytes a parameter) and Adam's fp32 master
   copy, m and v (4 + 4 + 4); ZeRO-2 divides Adam's state and the gradients across the training ranks, ZeRO-3
   the weights too. The embedding and lm_head are the backbone's, shared, never copied.
3. **The update's peak per chunk.** One head update (DCA + VGM, backward included, bf16) over one response whose
   cycles fill one chunk, at several chunk sizes: the peak of the bytes malloc has handed out above the level at
   entry, sampled every millisecond (`shared/peak_memory.PeakMemory`), with the head, its gradients, the
   backbone's embedding and the record already resident. A line through (chunk, peak) by least squares, read
   at the chunk sizes the trainer uses (1,024 on a CPU, 4,096 on a GPU). This is the CPU's plan: the lm_head
   scores a chunk in groups of 2^26 logits here and 2^28 on a GPU, so a GPU's peak has a larger constant part;
   the GPU check measured it (docs/gpu.md).

    python -m benchmarks.bench_memory [--chunks 192,320,448] [--families qwen3_4b,qwen3_5_4b,mimo_7b] [--json]
    python -m benchmarks.bench_memory --parts records,head --out docs/data/memory/records_and_head.json  # kept
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig, Qwen2Config
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

from benchmarks.shared.peak_memory import PeakMemory
from benchmarks.shared.bench_common import fit_line, qwen3_4b_config, records_at_tau
from benchmarks.shared.cpu_runs import provenance
from openrlhf_growmtp.core import (
    HeadLossConfig,
    MTPHead,
    SequenceRecord,
    head_loss_backward,
    init_random_head_,
    make_head_config,
)
from openrlhf_growmtp.core.families import get_family

MiB = 2**20
# bytes per parameter that DeepSpeed's bf16 mixed precision holds for a trained parameter
WEIGHT_BYTES, GRAD_BYTES = 2, 2  # bf16
ADAM_BYTES = 4 + 4 + 4  # fp32 master copy, Adam's m and v
DRAW_VOCAB = 1024  # the records' ids are drawn over these (which ids a record holds does not change its bytes)


@dataclass(frozen=True)
class Shape:
    name: str
    family: str
    config: PretrainedConfig


def qwen3_5_4b_config() -> Qwen3_5TextConfig:
    """Qwen3.5-4B-Base's text config at its real widths (its full-attention layer is what the MTP head uses):
    hidden 2560, 16 query / 4 key-value heads of 256, MLP 9216, vocabulary 248,320, tied embeddings."""
    return Qwen3_5TextConfig(hidden_size=2560, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
                             intermediate_size=9216, num_hidden_layers=1, vocab_size=248320, tie_word_embeddings=True,
                             initializer_range=0.02, rms_norm_eps=1e-6, max_position_embeddings=262144,
                             attn_output_gate=True, mtp_num_hidden_layers=1,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                              "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                                              "mrope_section": [11, 11, 10]})


def mimo_7b_config() -> Qwen2Config:
    """MiMo-7B's config at its real widths: hidden 4096, 32 query / 8 key-value heads of 128, MLP 11008,
    vocabulary 151,680, untied embeddings, one native MTP layer."""
    return Qwen2Config(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=11008,
                       num_hidden_layers=1, vocab_size=151680, tie_word_embeddings=False, initializer_range=0.02,
                       rms_norm_eps=1e-5, max_position_embeddings=32768, rope_theta=640000.0,
                       num_nextn_predict_layers=1)


SHAPES = {"qwen3_4b": Shape("Qwen3-4B", "qwen3", qwen3_4b_config()),
          "qwen3_5_4b": Shape("Qwen3.5-4B-Base", "qwen3_5", qwen3_5_4b_config()),
          "mimo_7b": Shape("MiMo-7B", "mimo", mimo_7b_config())}


# ---- 1. records ----------------------------------------------------------------------------------------------
def record_tensor_bytes(blob: bytes) -> tuple[int, int]:
    """(tensor bytes, header bytes) of a packed record: safetensors is an 8-byte length, a JSON header, then the
    tensors' raw bytes."""
    header = 8 + int.from_bytes(blob[:8], "little")
    return len(blob) - header, header


def record_bytes(hidden_size: int | None, k: int, topk: int, tau: float, tokens: int, prompt: int,
                 seed: int = 0) -> dict:
    """Bytes of one response's record at depth K and top-k: packed transport-free, unpacked in the trainer, and
    (with `hidden_size`) packed in exact mode, with the engine's bf16 hidden states."""
    rec = records_at_tau(tokens, prompt, tau, k, topk, DRAW_VOCAB, hidden_size=None, seed=seed)
    lean = rec.pack()
    in_trainer = SequenceRecord.unpack(lean).nbytes
    generated = rec.num_generated
    lean_tensors, header = record_tensor_bytes(lean)
    out = {"k": k, "topk": topk, "tau": 1.0 + float(rec.accepted.float().mean()), "cycles": rec.num_cycles,
           "tokens": int(rec.token_ids.shape[0]), "generated": generated,
           "packed_bytes": lean_tensors, "header_bytes": header, "packed_bytes_per_token": lean_tensors / generated,
           "unpacked_bytes": in_trainer, "unpacked_bytes_per_token": in_trainer / generated}
    if hidden_size is not None:
        rec.hidden = torch.zeros(rec.token_ids.shape[0], hidden_size, dtype=torch.bfloat16)
        exact_tensors, _ = record_tensor_bytes(rec.pack())
        out.update(exact_bytes=exact_tensors, exact_bytes_per_token=exact_tensors / generated)
    return out


# ---- 2. the head and its optimizer state ---------------------------------------------------------------------
def head_parameters(shape: Shape) -> int:
    with torch.device("meta"):
        head = MTPHead(make_head_config(shape.config, get_family(shape.family)))
    return sum(p.numel() for p in head.parameters())


def head_training_bytes(params: int, ranks: int, zero_stage: int) -> dict:
    """Bytes a trained head holds per training rank: ZeRO-2 partitions Adam's state and the gradients across the
    ranks, ZeRO-3 the weights too (it gathers a module's weights while the module runs)."""
    if zero_stage not in (2, 3) or ranks < 1:
        raise ValueError(f"zero_stage must be 2 or 3 and ranks >= 1, got {zero_stage}, {ranks}")
    weight_split = ranks if zero_stage == 3 else 1
    return {"weights": params * WEIGHT_BYTES / weight_split, "grads": params * GRAD_BYTES / ranks,
            "adam": params * ADAM_BYTES / ranks}


# ---- 3. the update's peak per chunk --------------------------------------------------------------------------
def backbone_pieces(shape: Shape, dtype: torch.dtype) -> tuple[nn.Embedding, nn.Linear]:
    cfg = shape.config
    embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
    with torch.no_grad():
        embed.weight.normal_(0.0, 0.02)
    lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
    if cfg.tie_word_embeddings:
        lm_head.weight = embed.weight
    else:
        with torch.no_grad():
            lm_head.weight.normal_(0.0, 0.02)
    for p in (embed.weight, lm_head.weight):
        p.requires_grad_(False)  # the backbone's: the head loss never trains them (detached mode)
    return embed, lm_head


def chunk_peaks(shape: Shape, chunks: list[int], k: int, topk: int, tau: float, prompt: int = 128,
                dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Peak MiB above entry of one head update whose one response's cycles fill one chunk, per chunk size."""
    embed, lm_head = backbone_pieces(shape, dtype)
    head = MTPHead(make_head_config(shape.config, get_family(shape.family)), embed, lm_head)
    head = init_random_head_(head, 0).to(dtype)
    for p in head.parameters():  # the gradients live across a step's chunks: not one chunk's memory
        p.grad = torch.zeros_like(p)
    out = []
    for chunk in chunks:
        # int(tokens / τ) cycles: exactly `chunk`
        rec = records_at_tau(int(chunk * tau), prompt, tau, k, topk, min(DRAW_VOCAB, shape.config.vocab_size),
                             hidden_size=None, seed=chunk)
        hidden = torch.randn(rec.token_ids.shape[0], shape.config.hidden_size,
                             generator=torch.Generator().manual_seed(1)).to(dtype)
        cfg = HeadLossConfig(chunk_cycles=chunk)
        t0 = time.perf_counter()
        with PeakMemory() as memory:
            stats = head_loss_backward(head, [rec], [hidden], cfg)
        out.append({"chunk": rec.num_cycles, "peak_mib": memory.mb, "peak_rss_mib": memory.rss_mb,
                    "seconds_sampled": time.perf_counter() - t0, "finite": stats.finite,
                    "chunks_run": stats.num_chunks})
        del rec, hidden
        gc.collect()
    del head, embed, lm_head
    gc.collect()
    return out


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join(SHAPES), help=f"comma-separated, of {sorted(SHAPES)}")
    parser.add_argument("--chunks", default="192,320,448",
                        help="chunk sizes measured (two at least; above ~160 every lm_head group is full)")
    parser.add_argument("--depths", default="3,5,7", help="K for the record table")
    parser.add_argument("--topks", default="32,64,128", help="top-k widths for the record table (at K = 5)")
    parser.add_argument("--tokens", type=int, default=8192, help="response length of the record table")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--ranks", type=int, default=4, help="training ranks sharing the head's state under ZeRO")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {','.join(PARTS)}")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of every number")
    parser.add_argument("--out", type=Path, help="also write every number, with the run's provenance, to this file")
    args = parser.parse_args()
    args.part_names = args.parts.split(",")
    if unknown_parts := [p for p in args.part_names if p not in PARTS]:
        parser.error(f"--parts of {','.join(PARTS)} (unknown: {unknown_parts})")
    args.names = args.families.split(",")
    unknown = [n for n in args.names if n not in SHAPES]
    args.chunk_sizes = sorted({int(c) for c in args.chunks.split(",")})
    if unknown or len(args.chunk_sizes) < 2 or min(args.chunk_sizes) < 1:
        parser.error(f"--families of {sorted(SHAPES)} (unknown: {unknown}); --chunks two sizes >= 1 "
                     f"(got {args.chunk_sizes})")
    return args


def record_tables(args, report: dict) -> None:
    depths = [int(d) for d in args.depths.split(",")]
    topks = [int(t) for t in args.topks.split(",")]
    print(f"records: one response of {args.prompt} + {args.tokens} tokens, bytes per generated token and MiB per "
          "response; packed (what the engine sends, transport-free: the default) and unpacked in the trainer (ids "
          "as int64): the same for every family")
    rows = [record_bytes(None, k, 64, tau, args.tokens, args.prompt) for k in depths for tau in (1.0, 3.0)]
    rows += [record_bytes(None, 5, t, 3.0, args.tokens, args.prompt) for t in topks if t != 64]
    for r in rows:
        print(f"  K={r['k']} top-{r['topk']:<3} τ {r['tau']:.2f} ({r['cycles']:>4} cycles): packed "
              f"{r['packed_bytes_per_token']:5.0f} B/token, {r['packed_bytes'] / MiB:5.2f} MiB; unpacked "
              f"{r['unpacked_bytes_per_token']:5.0f} B/token, {r['unpacked_bytes'] / MiB:5.2f} MiB "
              f"(header {r['header_bytes']} B)")
    report["records"] = rows
    print("exact mode (the engine's bf16 hidden states ride along), K=5 top-64 τ 3:")
    for name in args.names:
        shape = SHAPES[name]
        r = record_bytes(shape.config.hidden_size, 5, 64, 3.0, args.tokens, args.prompt)
        print(f"  {shape.name} (hidden {shape.config.hidden_size}): {r['exact_bytes_per_token']:5.0f} B/token, "
              f"{r['exact_bytes'] / MiB:5.2f} MiB per response")
        report["families"][name]["exact_record"] = r


def head_table(args, report: dict) -> None:
    print(f"\nthe head: parameters, and per training rank of {args.ranks} (bf16 weights + bf16 grads + fp32 "
          "master, m, v)")
    for name in args.names:
        shape = SHAPES[name]
        params = head_parameters(shape)
        entry = {"parameters": params}
        for stage in (2, 3):
            parts = head_training_bytes(params, args.ranks, stage)
            entry[f"zero{stage}_bytes_per_rank"] = parts
        report["families"][name]["head"] = entry
        z2, z3 = (sum(entry[f"zero{s}_bytes_per_rank"].values()) / MiB for s in (2, 3))
        print(f"  {shape.name}: {params / 1e6:.1f} M parameters, {params * WEIGHT_BYTES / MiB:.0f} MiB in bf16; "
              f"trained: {params * (WEIGHT_BYTES + GRAD_BYTES + ADAM_BYTES) / MiB:.0f} MiB on one rank, "
              f"{z2:.0f} MiB per rank under ZeRO-2, {z3:.0f} under ZeRO-3")


def peak_table(args, report: dict) -> None:
    print("\nthe update's peak per chunk (bf16, K=5, top-64, τ 3, CPU plan), MiB above entry; fit a + b × cycles")
    for name in args.names:
        shape = SHAPES[name]
        t0 = time.perf_counter()
        peaks = chunk_peaks(shape, args.chunk_sizes, k=5, topk=64, tau=3.0)
        fit = fit_line([p["chunk"] for p in peaks], [p["peak_mib"] for p in peaks])
        line = ", ".join(f"{p['chunk']}: {p['peak_mib']:.0f}" for p in peaks)
        print(f"  {shape.name}: {line}  ->  {fit.a:.0f} + {fit.b:.3f} × cycles (residuals "
              f"{', '.join(f'{r:+.0f}' for r in fit.residuals)}); at 1024: {fit.at(1024):.0f}, at 4096: "
              f"{fit.at(4096):.0f} MiB  [{time.perf_counter() - t0:.0f} s]")
        report["families"][name]["chunk_peaks"] = peaks
        report["families"][name]["chunk_fit"] = fit.as_dict()


PARTS = {"records": record_tables, "head": head_table, "peaks": peak_table}  # the docstring's 1, 2 and 3


def main() -> None:
    args = parse_args()
    report: dict = {"ranks": args.ranks, "tokens": args.tokens, "prompt": args.prompt,
                    "families": {name: {} for name in args.names}}
    for name in args.part_names:
        PARTS[name](args, report)
    if args.json:
        print(json.dumps(report))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**provenance(sys.argv[1:]), **report}, indent=1) + "\n")


if __name__ == "__main__":
    main()
