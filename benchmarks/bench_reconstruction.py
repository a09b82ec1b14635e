"""Batched vs chain-by-chain draft-path reconstruction (forward + DCA/VGM backward), side by side.

Chain by chain is how a drafter runs: one incremental head KV cache per response, each cycle appends its
newly committed entries, runs its K chain steps one at a time, and crops them again. Batched is
`head_loss_backward`: the prefix's keys and values once per sequence, and K chain forwards per chunk of
cycles whose attention scores only the keys each query sees.

Prints a table of time, speed-up and identity (max |log q| and max |grad| differences) per cycle count,
then the memory held for backward per chunk size and per response length, with `memory_growth` = that
memory at 4,096 cycles / at 512 (same chunk of 256). On CPU memory is the bytes of the unique tensors
autograd saved for backward, per backward call, without the head's parameters, in two parts: the
activations (what chunking bounds; `memory_growth`) and the batch's prefix state (the prefix keys and
values with their gradients, 2 x 2 x kv x head_dim fp32 values per token, resident for a sequence's
chunks like the hidden states they are made of; `memory_growth_with_prefix_state` counts both). On a GPU
it is CUDA's peak allocation, everything included. Last, the peak memory of one 1024-cycle chunk at
Qwen3-4B's head shape and real vocabulary in bf16: CUDA's peak allocation, or on CPU the sampled peak of
the bytes malloc has handed out (`PeakMemory`; its peak resident memory, which also holds what glibc
keeps after frees, is printed next to it). With --json the last line is one JSON object.

    python -m benchmarks.bench_reconstruction [--json] [--cycles 64 256 1024] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import weakref

import torch
from torch import nn
from transformers import Qwen3Config

from benchmarks.shared.bench_common import qwen3_4b_config, sync
from benchmarks.shared.peak_memory import measure_peak
from openrlhf_growmtp.core import (
    HeadLossConfig,
    Lockstep,
    MTPHead,
    SequenceRecord,
    head_loss_backward,
    init_random_head_,
    make_head_config,
    reconstruct_draft_logits,
)
from openrlhf_growmtp.core.families import get_family
from openrlhf_growmtp.core.objectives import head_loss_per_cycle
from growmtp_lab.reference_drafting import chain_by_chain
from growmtp_lab.worlds.toy import synthetic_record

K, TOPK = 5, 64


def build_head(device: str, seed: int = 0) -> MTPHead:
    # Qwen3-4B's layer layout (GQA 2:1, qk-norm, head_dim 128) at a size that runs on 2 CPU cores.
    config = Qwen3Config(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         intermediate_size=768, num_hidden_layers=1, vocab_size=4096, initializer_range=0.02)
    g = torch.Generator().manual_seed(seed)
    embed, lm_head = nn.Embedding(4096, 256), nn.Linear(256, 4096, bias=False)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(4096, 256, generator=g))
        lm_head.weight.copy_(torch.randn(4096, 256, generator=g) * 0.05)
    head = init_random_head_(MTPHead(make_head_config(config, get_family("qwen3")), embed, lm_head), seed)
    with torch.no_grad():  # a partly trained head: larger weights than the init, so q is not uniform
        for p in head.parameters():
            if p.ndim == 2:
                p.mul_(4.0)
    return head.to(device)


def make_record(num_cycles: int, seed: int = 0) -> SequenceRecord:
    """One response of num_cycles cycles (mean accepted ~1.6, i.e. tau ~2.6), prompt of 128 tokens."""
    g = torch.Generator().manual_seed(seed)
    accepted = torch.multinomial(torch.tensor([0.25, 0.25, 0.2, 0.12, 0.08, 0.1]), num_cycles, replacement=True,
                                 generator=g).tolist()
    return synthetic_record(prompt_len=128, accepted=accepted, depth=K, topk=TOPK, vocab_size=4096,
                            hidden_size=256, seed=seed)


def grads_of(head: MTPHead) -> torch.Tensor:
    flat = torch.cat([p.grad.flatten() for p in head.parameters()])
    for p in head.parameters():
        p.grad = None
    return flat


def compare(head: MTPHead, rec: SequenceRecord, device: str) -> dict:
    # Batched first: timed after the serial run, it ran 20-40% slower while the serial run's logits were
    # still alive (allocator state), which would flatter nothing but the serial path.
    times = []
    for _ in range(3):  # the median of three: one run is too short to time alone
        sync(device)
        t0 = time.perf_counter()
        head_loss_backward(head, [rec], cfg=HeadLossConfig(objective="dca", chunk_cycles=1024))
        sync(device)
        times.append(time.perf_counter() - t0)
        batched_grad = grads_of(head)
    batched_s = statistics.median(times)
    with torch.no_grad():
        batched_logq = reconstruct_draft_logits(head, [rec]).log_softmax(-1)

    sync(device)
    t0 = time.perf_counter()
    logits = chain_by_chain(head, [rec])
    acc = rec.accepted.to(device)
    loss, _ = head_loss_per_cycle(logits, rec.topk_ids.to(device), rec.topk_logprobs.to(device), acc, "dca")
    loss.mean().backward()
    sync(device)
    serial_s = time.perf_counter() - t0
    serial_grad, serial_logq = grads_of(head), logits.detach().log_softmax(-1)
    return {"cycles": rec.num_cycles, "k": K, "serial_s": serial_s, "batched_s": batched_s,
            "speedup": serial_s / batched_s,
            "max_abs_diff": (batched_logq - serial_logq).abs().max().item(),
            "grad_max_abs_diff": (batched_grad - serial_grad).abs().max().item(),
            "grad_max_abs": serial_grad.abs().max().item()}


class SavedBytes:
    """Bytes of the unique storages autograd holds for backward per backward call (CPU memory proxy), in two
    parts: activations, and the batch's prefix state -- the prefix keys and values, leaves computed once
    per batch (core/prefix.py), doubled for their gradient accumulators of the same size (a piece of a
    prefix's closing backward saves a view of that accumulator: state, not new memory). The head's
    parameters (model state, saved by every linear layer) count in neither."""

    def __init__(self, head: MTPHead):
        self.params = {p.untyped_storage().data_ptr() for p in head.parameters()}
        self.leaves: list[weakref.ref] = []
        self.ptrs, self.activations, self.state = set(), 0, 0
        self.peak_activations, self.peak_state = 0, 0

    def _is_leaf_gradient(self, key: int) -> bool:
        grads = (ref() for ref in self.leaves)
        return any(t is not None and t.grad is not None and t.grad.untyped_storage().data_ptr() == key for t in grads)

    def pack(self, t: torch.Tensor):
        key = t.untyped_storage().data_ptr()
        if key not in self.ptrs and key not in self.params:
            self.ptrs.add(key)
            if t.is_leaf and t.requires_grad:
                self.leaves.append(weakref.ref(t))
                self.state += 2 * t.untyped_storage().nbytes()
            elif not self._is_leaf_gradient(key):
                self.activations += t.untyped_storage().nbytes()
        return t

    def backward_done(self) -> None:
        self.peak_activations = max(self.peak_activations, self.activations)
        self.peak_state = max(self.peak_state, self.state)
        self.ptrs, self.activations, self.state = set(), 0, 0


def peak_memory_mb(head: MTPHead, rec: SequenceRecord, chunk: int, device: str) -> dict:
    """{"activations": MB, "prefix_state": MB} on CPU (`SavedBytes`); on CUDA both are in "activations"."""
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        head_loss_backward(head, [rec], cfg=HeadLossConfig(chunk_cycles=chunk))
        grads_of(head)
        return {"activations": torch.cuda.max_memory_allocated() / 2**20, "prefix_state": 0.0}
    meter = SavedBytes(head)

    def backward(loss):
        meter.backward_done()
        loss.backward()

    with torch.autograd.graph.saved_tensors_hooks(meter.pack, lambda t: t):
        head_loss_backward(head, [rec], cfg=HeadLossConfig(chunk_cycles=chunk), lockstep=Lockstep(backward=backward))
    grads_of(head)
    return {"activations": meter.peak_activations / 2**20, "prefix_state": meter.peak_state / 2**20}


def real_shape_chunk(device: str, cycles: int = 1024, dtype: torch.dtype = torch.bfloat16) -> dict:
    """One chunk's head update (forward + backward) at Qwen3-4B's head: hidden 2560, 32 query / 8 kv heads of
    128, MLP 9728, the real vocabulary of 151,936 (tied embedding), bf16 as the trainer runs it. Peak memory
    above what the head (with its gradients), the backbone's embedding and the record already hold."""
    config = qwen3_4b_config()
    embed = nn.Embedding(151936, 2560, dtype=dtype)
    lm_head = nn.Linear(2560, 151936, bias=False, dtype=dtype)
    with torch.no_grad():
        embed.weight.normal_(0.0, 0.02)
    lm_head.weight = embed.weight  # Qwen3-4B ties them
    head = init_random_head_(MTPHead(make_head_config(config, get_family("qwen3")), embed, lm_head), 0)
    head = head.to(device=device, dtype=dtype)
    accepted = torch.multinomial(torch.tensor([0.25, 0.25, 0.2, 0.12, 0.08, 0.1]), cycles, replacement=True,
                                 generator=torch.Generator().manual_seed(2)).tolist()
    # drawn over the first 4,096 ids (a [cycles, K, 151936] draw would dwarf what is measured); all are valid
    rec = synthetic_record(prompt_len=128, accepted=accepted, depth=K, topk=TOPK, vocab_size=4096,
                           hidden_size=2560, seed=2)
    hidden = rec.hidden.to(device=device, dtype=dtype)
    for p in head.parameters():  # the head's gradients exist across a step's chunks: not the chunk's memory
        p.grad = torch.zeros_like(p)
    sync(device)
    t0 = time.perf_counter()
    stats = head_loss_backward(head, [rec], [hidden], HeadLossConfig(chunk_cycles=cycles))
    sync(device)
    seconds = time.perf_counter() - t0
    cfg = HeadLossConfig(chunk_cycles=cycles)
    _, peak, rss = measure_peak(lambda: head_loss_backward(head, [rec], [hidden], cfg), device)
    return {"cycles": cycles, "tokens": int(rec.token_ids.numel()), "dtype": str(dtype).replace("torch.", ""),
            "peak_mb": peak, "peak_rss_mb": rss, "seconds": seconds, "finite": stats.finite}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--cycles", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    head = build_head(args.device)
    unit = "CUDA peak MB" if args.device == "cuda" else "saved-for-backward MB"

    print(f"draft-path reconstruction, K={K}, top-{TOPK}, head H=256 V=4096, device={args.device}")
    print(f"{'cycles':>7} {'chain-by-chain s':>17} {'batched s':>10} {'speed-up':>9} {'max|dlogq|':>11} "
          f"{'max|dgrad|':>11} {'max|grad|':>10}")
    rows = []
    for cycles in args.cycles:
        row = compare(head, make_record(cycles), args.device)
        rows.append(row)
        print(f"{cycles:>7} {row['serial_s']:>17.2f} {row['batched_s']:>10.3f} {row['speedup']:>8.1f}x "
              f"{row['max_abs_diff']:>11.2e} {row['grad_max_abs_diff']:>11.2e} {row['grad_max_abs']:>10.2e}")

    largest = max(args.cycles)
    rec = make_record(largest)
    print(f"\nmemory per chunk size ({largest} cycles, {rec.token_ids.numel()} tokens; {unit}: activations, "
          "prefix state)")
    chunk_memory = {}
    for chunk in (64, 256, 1024):
        chunk_memory[chunk] = peak_memory_mb(head, rec, chunk, args.device)
        mb = chunk_memory[chunk]
        print(f"  chunk {chunk:>5}: {mb['activations']:8.1f} {mb['prefix_state']:8.1f}")

    print(f"\nmemory per response length at chunk 256 ({unit}: activations, prefix state)")
    length_memory = {}
    for cycles in (512, 1024, 2048, 4096):
        long_rec = make_record(cycles, seed=1)
        length_memory[cycles] = peak_memory_mb(head, long_rec, 256, args.device)
        print(f"  {cycles:>5} cycles ({long_rec.token_ids.numel():>5} tokens): "
              f"{length_memory[cycles]['activations']:8.1f} {length_memory[cycles]['prefix_state']:8.1f}")

    growth = length_memory[4096]["activations"] / length_memory[512]["activations"]
    with_state = sum(length_memory[4096].values()) / sum(length_memory[512].values())
    print(f"  memory_growth (4096 / 512 cycles): {growth:.2f} (activations), {with_state:.2f} with the prefix state")

    real = real_shape_chunk(args.device)
    rss = "" if real["peak_rss_mb"] is None else f" (resident {real['peak_rss_mb']:.0f} MB)"
    print(f"\none {real['cycles']}-cycle chunk at Qwen3-4B's head (H=2560, V=151,936, {real['dtype']}, "
          f"{real['tokens']} tokens): peak {real['peak_mb']:.0f} MB above the model{rss}, {real['seconds']:.1f} s")

    result = dict(rows[-1])
    result.update({"device": args.device, "memory_unit": unit,
                   "memory_mb_by_chunk": chunk_memory, "memory_mb_by_cycles_at_chunk_256": length_memory,
                   "memory_growth": growth, "memory_growth_with_prefix_state": with_state,
                   "real_shape_chunk": real, "rows": rows})
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
