"""Check (c) of the GPU check: one RL step's head update against one policy forward + backward over the
same responses, timed and measured side by side in one run.

- policy: the whole model (all its layers) over the responses in micro-batches, gradient checkpointing
  on as the example scripts train it: forward, the token log-probs (fp32 log-softmax), their mean,
  backward (`bench_common.policy_step`). Its final-norm hidden states are what the head reads.
- head update: DCA + VGM over the same responses' records (K=5, τ≈3, top-64, cycles in chunks of the plan's
  `chunk_cycles`: the product's CUDA default, 4,096; the paper's are 1,024),
  reading those hidden states (`bench_common.head_update`), as the trainer does when the policy's own
  training forward hands them over;
- own forward: the no-grad policy forward a head update runs where it cannot read the policy's training
  forward (several policy steps per RL step, the lag probe, joint mode).
With a draft vocabulary (`--draft-vocab N`), each repeat also times the head update over N ids alone (the product's
`--growmtp_draft_vocab`: logits from the lm_head's N rows, sliced once per update; `core/draft_vocab.DraftRows`),
on the same records and hidden states, and the ratio of the two updates is reported beside the policy's.
No optimizer step on either side. The repeats alternate policy, own forward and head update; times are
medians. Peak memory is CUDA's peak allocation above what was allocated before each run: the models,
their gradients (allocated beforehand, as they live across a step) and the hidden states already held.

Both sides are sums over units of fixed size (micro-batches of responses; chunks of cycles), so
their times grow with the number of responses alike and the ratio of a few dozen responses is the
ratio of 512; their peaks are per unit and do not grow at all. What does grow is the hidden states the
head update reads, 2 x H bytes per token, reported apart. The number of responses timed is the one asked
for, or fewer where one warm-up pass says that `budget_s` would not hold them (said in the output).
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.gpu_check.gpu_report import Row
from benchmarks.gpu_check.gpu_world import Plan
from benchmarks.shared.bench_common import accepted_at_tau, head_update, policy_hiddens, sync
from openrlhf_growmtp.core import MTPHead, SequenceRecord
from openrlhf_growmtp.core.draft_vocab import DraftVocab
from growmtp_lab.worlds.toy import synthetic_record

RECORD_VOCAB = 1024  # records' ids are drawn over the first 1,024 ids: which ids they hold costs nothing


def make_records(plan: Plan, count: int, first_seed: int = 0) -> list[SequenceRecord]:
    """`count` responses of exactly one length (so micro-batches need no padding): prompt, cycles at τ
    covering ~response_tokens, then the few committed tokens that make every response equally long."""
    drawn = []
    for i in range(count):
        g = torch.Generator().manual_seed(first_seed + i)
        drawn.append(accepted_at_tau(max(1, int(plan.response_tokens / plan.tau)), plan.tau, plan.k, g))
    length = max(plan.prompt_tokens + sum(a) + len(a) for a in drawn) + 1
    vocab = min(RECORD_VOCAB, plan.config.vocab_size)
    return [synthetic_record(prompt_len=plan.prompt_tokens, accepted=a, depth=plan.k, topk=plan.topk,
                             vocab_size=vocab, hidden_size=None, seed=first_seed + i,
                             trailing_tokens=length - plan.prompt_tokens - sum(a) - len(a))
            for i, a in enumerate(drawn)]


class Meter:
    """Seconds and peak bytes (CUDA's peak allocation above the level at entry; None on a CPU) of a block."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        sync(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        sync(self.device)
        self.seconds = time.perf_counter() - self.t0
        self.peak_mb = None
        if self.device.type == "cuda":
            self.peak_mb = (torch.cuda.max_memory_allocated(self.device) - self.base) / 2**20


class Sides:
    """The three passes that (c) times, over one list of records: the policy's forward + backward (it hands over
    the hidden states), the policy's own no-grad forward, and the head update."""

    def __init__(self, plan: Plan, policy, head: MTPHead, vocab: DraftVocab | None = None):
        self.plan, self.policy, self.head, self.device = plan, policy, head, policy.device
        self.vocab = vocab  # also time the head update over these ids alone
        for module in (policy, head):  # gradients live across a step: allocated before anything is measured
            for p in module.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)

    def policy_pass(self, records):
        self.policy.zero_grad(set_to_none=False)
        return policy_hiddens(self.policy, records, self.plan.micro_batch, self.device)

    def own_forward(self, records):
        batch = self.plan.micro_batch
        with torch.no_grad():
            for lo in range(0, len(records), batch):
                self.policy.model(input_ids=torch.stack([r.token_ids for r in records[lo:lo + batch]]).to(self.device))

    def head_pass(self, records, hiddens, vocab: DraftVocab | None = None):
        self.head.zero_grad(set_to_none=False)
        self.head.draft_vocab = vocab
        try:
            stats = head_update(self.head, records, hiddens, self.plan.chunk_cycles)
        finally:
            self.head.draft_vocab = None
        if not stats.finite:
            raise RuntimeError("the head update's loss is not finite")
        return stats

    def responses_within_budget(self, log) -> list[SequenceRecord]:
        """Warm-up on one micro-batch (first-call costs out of the timing), then the records of as many responses
        as the budget holds at the warm-up's cost per response (at most the plan's)."""
        plan, batch = self.plan, self.plan.micro_batch
        records = make_records(plan, batch)
        hiddens = self.policy_pass(records)
        self.own_forward(records)
        self.head_pass(records, hiddens)
        if self.vocab is not None:
            self.head_pass(records, hiddens, self.vocab)
        with Meter(self.device) as policy_once:
            hiddens = self.policy_pass(records)
        with Meter(self.device) as forward_once:
            self.own_forward(records)
        with Meter(self.device) as head_once:
            self.head_pass(records, hiddens)
        per_response = (policy_once.seconds + forward_once.seconds + head_once.seconds) / batch
        fit = int(plan.budget_s / (plan.repeats * per_response)) // batch * batch
        responses = max(batch, min(plan.responses, fit))
        log(f"  (c) warm-up: {per_response:.2f} s per response per repeat; timing {responses} responses "
            f"({plan.responses} asked, {plan.repeats} repeats, budget {plan.budget_s:.0f} s)")
        return records + make_records(plan, responses - batch, first_seed=batch)

    def timed(self, records) -> tuple[dict, dict, object]:
        """Seconds and peaks of each side, the repeats alternating the three; the last head update's stats."""
        sides = ("policy", "own_forward", "head") + (("head_subset",) if self.vocab is not None else ())
        times, peaks = {key: [] for key in sides}, {key: [] for key in sides}
        stats = None
        for _ in range(self.plan.repeats):
            meters = {}
            with Meter(self.device) as meters["policy"]:
                hiddens = self.policy_pass(records)
            with Meter(self.device) as meters["own_forward"]:
                self.own_forward(records)
            with Meter(self.device) as meters["head"]:
                stats = self.head_pass(records, hiddens)
            if self.vocab is not None:
                with Meter(self.device) as meters["head_subset"]:
                    self.head_pass(records, hiddens, self.vocab)
            del hiddens
            for key, meter in meters.items():
                times[key].append(meter.seconds)
                peaks[key].append(meter.peak_mb)
        return times, peaks, stats


def check_cost(plan: Plan, policy, head: MTPHead, log, draft_vocab: int | None = None) -> tuple[list[Row], dict]:
    """(c); with `draft_vocab` N, also the head update over N ids (`gpu_draft_vocab.draft_vocab_ids`)."""
    vocab = None
    if draft_vocab is not None:
        from benchmarks.gpu_check.gpu_draft_vocab import draft_vocab_ids

        vocab = DraftVocab(draft_vocab_ids(plan.config.vocab_size, draft_vocab, torch.device("cpu")),
                           plan.config.vocab_size)
    sides = Sides(plan, policy, head, vocab)
    records = sides.responses_within_budget(log)
    times, peaks, stats = sides.timed(records)
    responses = len(records)
    median = {k: statistics.median(v) for k, v in times.items()}
    peak = {k: (max(v) if v[0] is not None else None) for k, v in peaks.items()}
    tokens = sum(int(r.token_ids.numel()) for r in records)
    cycles = sum(r.num_cycles for r in records)
    hidden_mb = tokens * plan.config.hidden_size * 2 / 2**20
    ratio = median["head"] / median["policy"]
    ratio_forward = (median["head"] + median["own_forward"]) / median["policy"]
    memory_ratio = None if peak["policy"] is None else peak["head"] / peak["policy"]
    details = {
        "responses": responses, "responses_asked": plan.responses, "scaled_by_budget": responses < plan.responses,
        "paper_responses_per_step": 512, "prompt_tokens": plan.prompt_tokens, "response_tokens": plan.response_tokens,
        "tokens": tokens, "cycles": cycles, "tau": 1.0 + sum(float(r.accepted.float().sum()) for r in records) / cycles,
        "k": plan.k, "chunk_cycles": plan.chunk_cycles, "micro_batch": plan.micro_batch, "gradient_checkpointing": True,
        "repeats": plan.repeats, "budget_s": plan.budget_s, "seconds": times, "median_s": median,
        "peak_mb": peak, "hidden_states_mb": hidden_mb,
        "hidden_states_mb_at_512_responses": hidden_mb * 512 / responses,
        "time_ratio": ratio, "time_ratio_with_own_forward": ratio_forward, "memory_ratio": memory_ratio,
        "head_loss": stats.loss, "head_alpha_mean": stats.alpha_mean,
        "policy_tokens_per_s": tokens / median["policy"], "head_cycles_per_s": cycles / median["head"],
        "head_s_per_cycle": median["head"] / cycles, "policy_s_per_token": median["policy"] / tokens,
        "path": "eager: bench_common.head_update, the trainer's chunked head update (DCA + VGM), chunks of "
                f"{plan.chunk_cycles} cycles",
    }
    rows = _rows(plan, details)
    if vocab is not None:
        details.update(draft_vocab=vocab.size, subset_over_all=median["head_subset"] / median["head"],
                       time_ratio_subset=median["head_subset"] / median["policy"])
        rows += [Row("c", f"time: head update over {vocab.size:,} ids / over every id (eager, same records)",
                     f"{details['subset_over_all']:.3f}", f"{median['head_subset']:.2f} s / {median['head']:.2f} s",
                     None, {"ratio": details["subset_over_all"]}),
                 Row("c", f"time: head update over {vocab.size:,} ids / policy fwd+bwd",
                     f"{details['time_ratio_subset']:.3f}", f"{median['head_subset']:.2f} s / {median['policy']:.2f} s",
                     None, {"ratio": details["time_ratio_subset"]})]
    return rows, details


def _rows(plan: Plan, d: dict) -> list[Row]:
    median, peak, responses = d["median_s"], d["peak_mb"], d["responses"]
    scale = f"{responses} of 512 responses" + (" (cut by the time budget)" if responses < plan.responses else "")
    mem = "CUDA only" if d["memory_ratio"] is None else f"{peak['head']:.0f} / {peak['policy']:.0f} MB"
    return [
        Row("c", f"time: head update / policy fwd+bwd, {scale}", f"{d['time_ratio']:.3f}",
            f"{median['head']:.2f} s / {median['policy']:.2f} s (medians of {plan.repeats})", None,
            {"ratio": d["time_ratio"]}),
        Row("c", f"head update per cycle (eager, chunks of {plan.chunk_cycles}), {d['cycles']} cycles at tau "
            f"{d['tau']:.2f}; policy fwd+bwd per token", f"{d['head_s_per_cycle'] * 1e6:.2f} us per cycle",
            f"policy {d['policy_s_per_token'] * 1e6:.2f} us per token, {d['tokens']} tokens", None,
            {"head_s_per_cycle": d["head_s_per_cycle"], "policy_s_per_token": d["policy_s_per_token"]}),
        Row("c", "time: (head update + own no-grad forward) / policy fwd+bwd",
            f"{d['time_ratio_with_own_forward']:.3f}", f"own forward {median['own_forward']:.2f} s", None,
            {"ratio": d["time_ratio_with_own_forward"]}),
        Row("c", "peak memory: head update / policy fwd+bwd",
            "-" if d["memory_ratio"] is None else f"{d['memory_ratio']:.3f}", mem, None, {"ratio": d["memory_ratio"]}),
    ]
