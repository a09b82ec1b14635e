"""The GPU check's reference drafter: the loop of `gpu_loop.py` run eagerly from prompts with a record tap, its
records as the engine records them (`core/records.py` has the terms), for check `trainer_step` (`gpu_trainer.py`).

`drafting_loop` builds the loop over every layer of the policy, its caches sized for the responses; `calibrate`
(`gpu_loop.py`) sets its head's tau on it; `draft_rollouts` runs it until every sequence has its tokens.
`Records`, the tap, keeps each sequence's committed tokens and each of its cycles: its start s, its drafts, the
target's full-vocabulary top-k log-probs at the K draft positions, and its accepted count; the records are cut to
one common length (trailing cycles that pass it dropped). Every cycle run, kept or not, counts in the loop's
counters, which hold the first drafts' acceptance to sum min(p_1, q_1) (`reference_drafting.acceptance_z`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import Qwen3ForCausalLM

from benchmarks.gpu_check.gpu_loop import Loop
from benchmarks.shared.bench_common import sync
from benchmarks.shared.cycle_timing import KVBuffer, policy_caches
from openrlhf_growmtp.core import MTPHead, SequenceRecord


class Records:
    """The record tap: each sequence's committed tokens and its cycles (start s, drafts, the target's top-k
    ids and log-probs at the K draft positions, accepted), kept on the host."""

    def __init__(self, topk: int):
        self.topk, self.prompt = topk, 0
        self.tokens: list[list[int]] = []
        self.cycles: list[list[tuple]] = []

    def started(self, prompts: torch.Tensor, first: torch.Tensor) -> None:
        self.prompt = prompts.shape[1]
        self.tokens = [row + [t] for row, t in zip(prompts.tolist(), first.tolist())]
        self.cycles = [[] for _ in self.tokens]

    def verified(self, start, drafts, logits, accepted, emitted) -> None:
        """One cycle of every sequence: logits [B, K, V] the target's at the draft positions (fp32)."""
        top = torch.log_softmax(logits, dim=-1).topk(self.topk, dim=-1)
        # a copy of the drafts: on a CPU .cpu() would hand back the loop's own tensor, which the next cycle rewrites
        ids, values, drafts = top.indices.cpu(), top.values.cpu(), drafts.to("cpu", copy=True)
        for b, (s, a, e) in enumerate(zip(start.tolist(), accepted.tolist(), emitted.tolist())):
            self.tokens[b] += drafts[b, :a].tolist() + [e]
            self.cycles[b].append((s, drafts[b], ids[b], values[b], a))

    def committed(self) -> int:
        """The fewest response tokens a sequence has committed."""
        return min(len(t) for t in self.tokens) - self.prompt

    def records(self) -> tuple[list[SequenceRecord], list[int]]:
        """The records cut to one common length (trailing cycles that pass it dropped), and the kept cycles'
        accepted counts."""
        length = min(len(t) for t in self.tokens)
        records, kept = [], []
        for tokens, cycles in zip(self.tokens, self.cycles):
            mine = [c for c in cycles if c[0] + c[4] + 2 <= length - 1]
            kept.extend(c[4] for c in mine)
            records.append(SequenceRecord(
                token_ids=torch.tensor(tokens[:length]), prompt_len=self.prompt,
                start=torch.tensor([c[0] for c in mine]), drafts=torch.stack([c[1] for c in mine]),
                topk_ids=torch.stack([c[2] for c in mine]), topk_logprobs=torch.stack([c[3] for c in mine]),
                accepted=torch.tensor([c[4] for c in mine]), hidden=None, temperature=1.0))
        return records, kept


@dataclass
class Rollouts:
    records: list[SequenceRecord]
    tau: float  # 1 + mean accepted, over the kept cycles
    cycles: int  # the kept cycles
    seconds: float
    phases: dict[str, float]  # seconds: "prefill", "head" (first and steps), "verify" (sampling, commit, record)
    counts: dict[str, float]  # the loop's counters over every cycle run (`acceptance_z`)


def drafting_loop(policy: Qwen3ForCausalLM, head: MTPHead, prompts: torch.Tensor, response_tokens: int, k: int,
                  topk: int, seed: int = 0) -> Loop:
    """The reference drafter: a loop over `prompts` [B, P] (equal lengths) with a `Records` tap, every policy
    layer, its caches sized for `response_tokens` cycles (a cycle commits 1..K + 1 tokens of each sequence)."""
    batch, length = prompts.shape
    capacity = length + (response_tokens + 1) * (k + 1)
    config, weight = head.config, head.embed_tokens.weight
    head_kv = KVBuffer.empty(batch, config.num_key_value_heads, capacity, config.head_dim, weight.device,
                             weight.dtype)
    return Loop(policy, policy.config.num_hidden_layers, head, policy_caches(policy, batch, capacity), head_kv,
                length, capacity, k, seed, prompts=prompts, tap=Records(topk))


def draft_rollouts(loop: Loop, response_tokens: int) -> Rollouts:
    """A `drafting_loop` run from its prompts until every sequence has `response_tokens` new tokens; the
    records cut to one common length, the seconds of each phase."""
    phases = dict.fromkeys(("prefill", "head", "verify"), 0.0)
    sync(loop.device)
    started = mark = time.perf_counter()

    def lap(phase: str) -> None:
        nonlocal mark
        sync(loop.device)
        now = time.perf_counter()
        phases[phase] += now - mark
        mark = now

    loop.reset()
    lap("prefill")
    while loop.tap.committed() < response_tokens:
        loop.run("first")
        for _ in range(loop.k - 1):
            loop.run("step")
        lap("head")
        loop.run("verify")
        lap("verify")
    records, kept = loop.tap.records()
    return Rollouts(records=records, tau=1.0 + sum(kept) / max(1, len(kept)), cycles=len(kept),
                    seconds=mark - started, phases=phases, counts={n: float(t) for n, t in loop.counts.items()})
