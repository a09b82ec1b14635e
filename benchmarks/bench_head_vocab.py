"""The head update over a draft vocabulary's rows against the update over every id, at Qwen3-4B's shapes on this
CPU (`--growmtp_draft_vocab`, `core/draft_vocab.DraftRows`).

One head (Qwen3-4B's fc, one decoder layer and norms at hidden 2,560, its tied embedding and lm_head over 151,936
ids, random weights, in --dtype) and the same records (one response of ~--tokens tokens after a
--prompt-token prompt, K = 5 at τ ≈ --tau, top-64), updated (`head_loss_backward`: DCA + VGM, chunks of the CPU's
default) in two arms, measured side by side in one run:
  all      the head over every id (no draft vocabulary)
  subset   the head over --subset ids: logits [M, N] from the lm_head's N rows, sliced once per update
Each of --rounds rounds times both arms once, the first arm alternating from round to round; the medians, minima
and maxima are per update and per cycle, and `ratio` is the subset's median over every id's (each round's ratio
beside it). The subset holds a random half of the ids the records' top-k are drawn from (the first 4,096) and
random ids above them, so about half of the recorded ids fall outside it (log q = -inf there).

Exactness, in the same run: the subset arm against the masked full-vocabulary computation it replaces (the
lm_head over every id, -inf outside the subset: `draft_vocab.MaskedLMHead`), in --dtype on the timed records and,
where --dtype is not float32 (the default is), in fp32 on --check-cycles cycles of another response: the loss's
and each parameter gradient's largest difference relative to its own scale.

--dtype: bfloat16 is the trainer's; a CPU without bf16 matrix instructions (AVX2 only: torch runs bf16 products
through its reference GEMM, several times slower than fp32's) times float32, the default here.

    python -m benchmarks.bench_head_vocab [--tokens 2048] [--subset 32768] [--rounds 5] [--dtype float32] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from benchmarks.shared.bench_common import qwen3_4b_config, records_at_tau
from openrlhf_growmtp.core import HeadLossConfig, MTPHead, head_loss_backward, init_random_head_, make_head_config
from openrlhf_growmtp.core.draft_vocab import DraftVocab, MaskedLMHead
from openrlhf_growmtp.core.families import get_family
from openrlhf_growmtp.core.reconstruction import chunk_cycles_for
from openrlhf_growmtp.measure.provenance import provenance

K, TOPK, RECORD_IDS = 5, 64, 4096  # the records' top-k ids are drawn over the first RECORD_IDS ids


def build_head(dtype: torch.dtype, seed: int) -> MTPHead:
    """Qwen3-4B's head on a tied embedding / lm_head of its real shape (N(0, 0.02), as from scratch)."""
    config = qwen3_4b_config(1)
    embed = nn.Embedding(config.vocab_size, config.hidden_size)
    with torch.no_grad():
        embed.weight.normal_(0.0, config.initializer_range, generator=torch.Generator().manual_seed(seed))
    lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    lm_head.weight = embed.weight  # tied, as Qwen3-4B's
    head = init_random_head_(MTPHead(make_head_config(config, get_family("qwen3")), embed, lm_head), seed)
    embed.to(dtype)
    head.to(dtype)
    for p in head.parameters():
        p.grad = torch.zeros_like(p)  # they exist across a step: not the update's
    return head


def draft_vocab(size: int, vocab_size: int, seed: int) -> DraftVocab:
    """Half of the records' ids and random ids above them, `size` in all."""
    g = torch.Generator().manual_seed(seed)
    low = torch.randperm(RECORD_IDS, generator=g)[:RECORD_IDS // 2]
    high = RECORD_IDS + torch.randperm(vocab_size - RECORD_IDS, generator=g)[:size - low.numel()]
    return DraftVocab(torch.cat([low, high]).sort().values, vocab_size)


def update(head: MTPHead, records, hiddens, chunk_cycles: int):
    for p in head.parameters():
        p.grad.zero_()
    return head_loss_backward(head, records, hiddens, HeadLossConfig(chunk_cycles=chunk_cycles))


def timed(fn) -> tuple[object, float]:
    began = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - began


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def differences(head: MTPHead, vocab: DraftVocab, records, hiddens, chunk_cycles: int) -> dict:
    """The subset arm against the masked full-vocabulary computation on the same head: relative differences."""
    head.draft_vocab = vocab
    rows = update(head, records, hiddens, chunk_cycles)
    rows_grads = {name: p.grad.float().clone() for name, p in head.named_parameters()}
    lm_head = head.lm_head
    head.draft_vocab = None
    head.bind(head.embed_tokens, MaskedLMHead(lm_head, vocab))
    try:
        masked = update(head, records, hiddens, chunk_cycles)
    finally:
        head.bind(head.embed_tokens, lm_head)
    grads = {name: float((rows_grads[name] - p.grad.float()).abs().max() / p.grad.float().abs().max())
             for name, p in head.named_parameters()}
    return {"cycles": rows.num_cycles, "loss_subset": rows.loss, "loss_masked": masked.loss,
            "loss_rel_diff": abs(rows.loss - masked.loss) / abs(masked.loss),
            "grad_rel_diff_max": max(grads.values()), "grad_rel_diff": grads}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048, help="response length")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--tau", type=float, default=3.0)
    parser.add_argument("--subset", type=int, default=32768, help="the draft vocabulary's size")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--check-cycles", type=int, default=64, help="cycles of the fp32 exactness check (0: none)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the JSON here")
    args = parser.parse_args()
    if args.rounds < 1 or args.subset < RECORD_IDS or args.tokens < 1:
        parser.error(f"--rounds >= 1, --subset >= {RECORD_IDS} and --tokens >= 1, got {args.rounds}, {args.subset}, "
                     f"{args.tokens}")
    return args


def main() -> None:
    args = parse_args()
    chunk_cycles = chunk_cycles_for("cpu")
    dtype = getattr(torch, args.dtype)
    head = build_head(dtype, args.seed)
    config = head.config
    vocab = draft_vocab(args.subset, config.vocab_size, args.seed)
    record = records_at_tau(args.tokens, args.prompt, args.tau, K, TOPK, vocab_size=RECORD_IDS,
                            hidden_size=config.hidden_size, seed=args.seed)
    records, hiddens = [record], [record.hidden.to(dtype)]
    arms = {"all": None, "subset": vocab}
    times = {arm: [] for arm in arms}
    for arm, ids in arms.items():  # warm-up
        head.draft_vocab = ids
        update(head, records, hiddens, chunk_cycles)
    for r in range(args.rounds):
        for arm in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
            head.draft_vocab = arms[arm]
            stats, seconds = timed(lambda: update(head, records, hiddens, chunk_cycles))
            assert stats.finite, arm
            times[arm].append(seconds)
    cycles = record.num_cycles
    result = {
        "provenance": provenance(seed=args.seed),
        "shapes": {"hidden": config.hidden_size, "vocab": config.vocab_size, "subset": vocab.size, "head_layers": 1,
                   "k": K, "topk": TOPK, "dtype": args.dtype, "tie_word_embeddings": True},
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "tokens": int(record.token_ids.shape[0]), "cycles": cycles, "tau": 1.0 + float(record.accepted.float().mean()),
        "chunk_cycles": chunk_cycles, "rounds": args.rounds,
        "topk_inside_share": float((~vocab.outside())[record.topk_ids].float().mean()),
        "arms": {arm: {"update_s": spread(ts), "per_cycle_ms": spread([1e3 * t / cycles for t in ts])}
                 for arm, ts in times.items()},
        "ratio": statistics.median(times["subset"]) / statistics.median(times["all"]),
        "ratio_per_round": spread([s / a for s, a in zip(times["subset"], times["all"])]),
        "check_timed": differences(head, vocab, records, hiddens, chunk_cycles),
    }
    if args.check_cycles and dtype != torch.float32:  # (in fp32 the timed check is that check)
        del head
        head32 = build_head(torch.float32, args.seed)
        short = records_at_tau(max(1, int(args.check_cycles * args.tau)), args.prompt, args.tau, K, TOPK,
                               vocab_size=RECORD_IDS, hidden_size=config.hidden_size, seed=args.seed + 1)
        result["check_fp32"] = differences(head32, vocab, [short], [short.hidden.float()], chunk_cycles)
    a, s = result["arms"]["all"], result["arms"]["subset"]
    print(f"Qwen3-4B's head (H={config.hidden_size}, V={config.vocab_size:,}, {args.dtype}) on this CPU; "
          f"{cycles} cycles at K={K}, τ={result['tau']:.2f}, chunks of {chunk_cycles}; {args.rounds} rounds")
    for name, arm in (("every id", a), (f"{vocab.size:,} ids", s)):
        print(f"  {name:>11}: {arm['update_s']['median']:7.2f} s per update (rounds {arm['update_s']['min']:.2f}-"
              f"{arm['update_s']['max']:.2f}), {arm['per_cycle_ms']['median']:6.2f} ms per cycle")
    spread_r = result["ratio_per_round"]
    print(f"  subset / every id: {result['ratio']:.3f} (per round {spread_r['min']:.3f}-{spread_r['max']:.3f})")
    for name in ("check_timed", "check_fp32"):
        if name in result:
            c = result[name]
            print(f"  {name}: {c['cycles']} cycles, loss rel. diff {c['loss_rel_diff']:.2e}, largest gradient rel. "
                  f"diff {c['grad_rel_diff_max']:.2e}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
