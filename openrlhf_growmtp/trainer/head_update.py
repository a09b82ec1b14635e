"""The head update of one RL step, run on every data-parallel rank inside the policy's training step.

Each rank reconstructs and scores the cycles of its own samples (transport-free mode: the target hidden
states come from a forward of the pre-update policy over the committed sequences). ZeRO-3 gathers
parameters and reduces gradients collectively, so every rank must run the same sequence of module calls
and backwards whatever its share of the records: ranks with fewer batches or chunks run zero-weighted
filler work, and the finiteness check is agreed across ranks before every backward.

Gradient scale: each rank's loss is normalised by its own cycle count, then rescaled so that, after
DeepSpeed averages over ranks and divides by gradient accumulation, the head's gradient is the gradient
of the summed loss over all cycles of the call on all ranks, divided by `cycles_per_step` (by default
the call's own cycle count: the mean loss). A trainer that calls once per micro-batch passes the mean
number of cycles per optimizer step, so that each optimizer step's gradient is its cycles' summed loss
over that mean, and exactly the mean loss when one optimizer step takes every record.

No openrlhf or DeepSpeed import here: the caller passes `backward` (DeepSpeed's engine backward).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..core.head import MTPHead
from ..core.reconstruction import DEFAULT_CHUNK_CYCLES, check_batch, count_chunks, head_loss_backward
from ..core.records import RecordError, SequenceRecord


@dataclass(frozen=True)
class HeadUpdateConfig:
    kind: str = "dca"
    vgm: bool = True
    chunk_cycles: int = DEFAULT_CHUNK_CYCLES
    teacher_forcing: bool = False
    joint: bool = False  # the head loss also reaches the backbone (through the hidden states)
    hidden_batch_size: int = 8  # sequences per backbone forward when recomputing hidden states


@dataclass
class HeadStepTotals:
    """Sums over every rank of one or more `update_head` calls; `metrics()` gives the logged values.

    Calls add up (`add`) so that a step made of several calls (one per micro-batch) reports one loss and
    one α_k per step: means over all of its cycles, not means of per-call means.
    """

    k: int = 0
    teacher_forcing: bool = False
    cycles: float = 0.0
    loss_sum: float = 0.0  # sum over cycles of the per-cycle loss (NaN once a call was not finite)
    mass_sum: float = 0.0  # sum over cycles and draft positions of the recorded top-k's target mass
    alpha_sum: list[float] = field(default_factory=list)  # [K] per draft position
    alpha_count: list[float] = field(default_factory=list)  # [K] cycles whose loss reads that position
    finite: bool = True
    seconds: float = 0.0

    def add(self, other: HeadStepTotals) -> None:
        if other.k:
            if not self.k:
                self.k, self.alpha_sum, self.alpha_count = other.k, [0.0] * other.k, [0.0] * other.k
            self.alpha_sum = [a + b for a, b in zip(self.alpha_sum, other.alpha_sum or [0.0] * self.k)]
            self.alpha_count = [a + b for a, b in zip(self.alpha_count, other.alpha_count or [0.0] * self.k)]
        self.teacher_forcing = self.teacher_forcing or other.teacher_forcing
        self.cycles += other.cycles
        self.loss_sum += other.loss_sum
        self.mass_sum += other.mass_sum
        self.finite = self.finite and other.finite
        self.seconds += other.seconds

    def metrics(self) -> dict[str, float]:
        cycles = max(self.cycles, 1.0)
        metrics = {"head_cycles": self.cycles, "head_finite": 1.0 if self.finite else 0.0,
                   "head_loss": self.loss_sum / cycles if self.finite else float("nan"),
                   "head_update_s": self.seconds}
        if self.k:
            # The recorded top-k's share of the target's mass: the sparse alpha estimate can exceed the true
            # alpha by at most 1 minus it (objectives.py), so a small value says the alphas are loose.
            metrics["head_topk_mass"] = self.mass_sum / max(self.cycles * self.k, 1.0)
            if not self.teacher_forcing:
                # per position, over the cycles whose loss reads it (under VGM: those that reached it)
                metrics.update(_alphas("head_alpha", self.alpha_sum + self.alpha_count, self.k))
        return metrics


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _all_reduce(values: list[float], op) -> list[float]:
    if not (dist.is_available() and dist.is_initialized()):
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=_device())
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_ranks(local: bool) -> bool:
    """True only if `local` is true on every rank."""
    return _all_reduce([1.0 if local else 0.0], dist.ReduceOp.MIN)[0] > 0.5


def agree_finite(local_finite: bool) -> bool:
    """True only if the chunk loss is finite on every rank (all ranks then backpropagate or all stop)."""
    return all_ranks(local_finite)


def agree_max(local_count: int) -> int:
    """The largest of the ranks' counts (every rank then runs that many prefix pieces, with passengers)."""
    return int(_all_reduce([float(local_count)], dist.ReduceOp.MAX)[0])


def backbone_hidden_states(backbone: nn.Module, records: Sequence[SequenceRecord], num_batches: int,
                           batch_size: int, grad: bool) -> list[torch.Tensor]:
    """H_p [T, H] per record from the backbone (final-norm output), in exactly `num_batches` forwards.

    Sequences are right-padded, which leaves every real position's causal hidden state unchanged. Ranks
    with fewer batches run one-token filler forwards so ZeRO-3's parameter gathers stay in step.
    """
    device = _device()
    hiddens: list[torch.Tensor] = []
    with torch.set_grad_enabled(grad):
        for b in range(num_batches):
            batch = records[b * batch_size:(b + 1) * batch_size]
            if not batch:
                backbone(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device))
                continue
            lengths = [int(rec.token_ids.shape[0]) for rec in batch]
            ids = torch.zeros(len(batch), max(lengths), dtype=torch.long, device=device)
            mask = torch.zeros_like(ids)
            for i, rec in enumerate(batch):
                ids[i, :lengths[i]] = rec.token_ids.to(device)
                mask[i, :lengths[i]] = 1
            out = backbone(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, Tmax, H]
            hiddens.extend(out[i, :lengths[i]] for i in range(len(batch)))
    return hiddens


def rows_per_sample(last_hidden: torch.Tensor, attention_mask: torch.Tensor) -> list[torch.Tensor]:
    """Each sample's hidden states [T_i, H] (its valid tokens, in order) from a training forward's final
    hidden states: padded [B, T, H] over attention_mask [B, T], or packed [1, sum T_i, H] (the valid tokens
    of every row, in row order, as OpenRLHF's Actor unpads them)."""
    mask = attention_mask.bool()
    if last_hidden.shape[:2] == mask.shape:
        flat = last_hidden[mask]
    else:
        flat = last_hidden.reshape(-1, last_hidden.shape[-1])
        if flat.shape[0] != int(mask.sum()):
            raise ValueError(f"hidden states of {flat.shape[0]} packed tokens for {int(mask.sum())} valid tokens")
    return list(flat.split(mask.sum(-1).tolist()))


def filler_record(head: MTPHead, k: int, topk: int) -> SequenceRecord:
    """A one-cycle record in the head's shapes; its loss is multiplied by zero (rank padding only)."""
    config = head.config
    return SequenceRecord.make_dummy(prompt_len=2, accepted=(0,), depth=k, topk=min(topk, config.vocab_size),
                                     vocab_size=config.vocab_size, hidden_size=config.hidden_size)


def total_cycles(records: Sequence[SequenceRecord]) -> float:
    """These records' cycles, summed over every rank."""
    return _all_reduce([float(sum(rec.num_cycles for rec in records))], dist.ReduceOp.SUM)[0]


def step_hidden_states(backbone: nn.Module, records: Sequence[SequenceRecord], cfg: HeadUpdateConfig
                       ) -> list[torch.Tensor]:
    """H_p [T, H] per record of this rank from the current backbone, in the same number of forwards on
    every rank (with a graph in joint mode). Read them before the policy's optimizer step."""
    local_batches = math.ceil(len(records) / cfg.hidden_batch_size)
    (max_batches,) = _all_reduce([local_batches], dist.ReduceOp.MAX)
    return backbone_hidden_states(backbone, records, int(max_batches), cfg.hidden_batch_size, grad=cfg.joint)


def update_head(head: MTPHead, backbone: nn.Module, records: Sequence[SequenceRecord], cfg: HeadUpdateConfig,
                backward: Callable[[torch.Tensor], None], gradient_accumulation: int = 1,
                hiddens: Sequence[torch.Tensor] | None = None,
                cycles_per_step: float | None = None) -> HeadStepTotals:
    """Accumulate the head gradients of these records on every rank; returns the call's totals (identical
    on all ranks).

    `backward(loss)` must run DeepSpeed's engine backward (which divides by `gradient_accumulation`).
    Records arrive validated from the engine boundary; here they are only checked to fit the head
    (`check_batch`). If a record on any rank does not, every rank raises before any model work; if a
    chunk loss is not finite on any rank, every rank stops backpropagating and the totals say finite=False.
    `hiddens` (from `step_hidden_states`) saves the backbone forward for a caller that keeps them.
    `cycles_per_step` divides the summed loss (module docstring); None: this call's cycles on all ranks.
    """
    began = time.perf_counter()
    _agree_records_fit(head, records)
    local_cycles = sum(rec.num_cycles for rec in records)
    cycles = total_cycles(records)
    totals = HeadStepTotals(teacher_forcing=cfg.teacher_forcing, cycles=cycles)
    plan = _plan(records, cfg)
    if plan is not None:
        if hiddens is None:
            hiddens = step_hidden_states(backbone, records, cfg)
        divisor = cycles_per_step if cycles_per_step is not None else cycles
        scale = _world_size() * gradient_accumulation * local_cycles / divisor if local_cycles else 0.0
        stats, finite = _run_chunks(head, backbone, records, hiddens, cfg, plan,
                                    lambda weight: (lambda loss: backward(loss * weight)), scale)
        k = plan[1]
        local_sum = stats.loss * local_cycles if stats is not None and stats.finite else 0.0
        local_mass = sum(float(torch.logsumexp(rec.topk_logprobs.float(), dim=-1).exp().sum()) for rec in records)
        sums = _all_reduce([local_sum, local_mass] + _alpha_sums(stats, k), dist.ReduceOp.SUM)
        totals.k, totals.finite, totals.mass_sum = k, finite, sums[1]
        totals.loss_sum = sums[0] if finite else float("nan")
        totals.alpha_sum, totals.alpha_count = sums[2:2 + k], sums[2 + k:2 + 2 * k]
    totals.seconds = time.perf_counter() - began
    return totals


def head_alpha_on(head: MTPHead, records: Sequence[SequenceRecord], hiddens: Sequence[torch.Tensor],
                  cfg: HeadUpdateConfig, prefix: str = "lag_alpha") -> dict[str, float]:
    """The head's α_k on these records, as `update_head` measures it, without a gradient step.

    With the head after its optimizer step and the hidden states read before the policy's, this is the
    α of the updated head on the records of the policy it was trained for; the next step's `head_alpha_k`
    is the same head's α on the next policy's records, and the difference is the one-step lag.
    Every rank runs the same chunks (with fillers), like `update_head`.
    """
    if cfg.teacher_forcing:
        raise ValueError("the lag probe reads the draft paths; teacher forcing has none")
    plan = _plan(records, cfg)
    if plan is None:
        return {}
    hiddens = [h.detach() for h in hiddens]
    with torch.no_grad():
        stats, _ = _run_chunks(head, None, records, hiddens, replace(cfg, joint=False), plan,
                               lambda weight: (lambda loss: None), 0.0)
    return _alphas(prefix, _all_reduce(_alpha_sums(stats, plan[1]), dist.ReduceOp.SUM), plan[1])


def _agree_records_fit(head: MTPHead, records: Sequence[SequenceRecord]) -> None:
    error = ""
    try:
        check_batch(head, records)
    except RecordError as err:
        error = str(err)
    if _all_reduce([1.0 if error else 0.0], dist.ReduceOp.MAX)[0] > 0.5:
        raise RecordError(error or "a malformed record on another data-parallel rank (see its log)")


def _plan(records: Sequence[SequenceRecord], cfg: HeadUpdateConfig) -> tuple[int, int, int] | None:
    """(max chunks over ranks, K, this rank's chunks), or None when no rank has a record.

    At least one chunk runs (a zero-weight filler where no rank has a cycle, e.g. every sample ended before
    its first cycle): each call is then one head backward, and under optimizer offload DeepSpeed moves the
    head's accumulated gradient to the optimizer at the boundary backward that reaches it.
    """
    # Joint mode backpropagates through the backbone once per rank: one chunk (None), one graph.
    local_chunks = count_chunks(records, _chunk_cycles(cfg), cfg.teacher_forcing) if records else 0
    local_k = records[0].depth if records else 0
    max_chunks, k = _all_reduce([local_chunks, local_k], dist.ReduceOp.MAX)
    return None if k == 0 else (max(int(max_chunks), 1), int(k), local_chunks)


def _chunk_cycles(cfg: HeadUpdateConfig) -> int | None:
    return None if cfg.joint else cfg.chunk_cycles


def _run_chunks(head, backbone, records, hiddens, cfg: HeadUpdateConfig, plan, weighted, scale: float):
    """This rank's chunks, then zero-weighted filler chunks up to the busiest rank's count."""
    max_chunks, k, local_chunks = plan
    dtype = next(head.parameters()).dtype
    chunk_cycles = _chunk_cycles(cfg)
    finite, stats = True, None
    if records:
        stats = head_loss_backward(head, records, [h.to(dtype) for h in hiddens], kind=cfg.kind, vgm=cfg.vgm,
                                   chunk_cycles=chunk_cycles, teacher_forcing=cfg.teacher_forcing,
                                   backward=weighted(scale), agree=agree_finite, check=False, agree_max=agree_max,
                                   one_chunk_everywhere=max_chunks == 1)
        finite = stats.finite
    topk = int(records[0].topk_ids.shape[2]) if records else head.config.vocab_size
    filler = filler_record(head, k, topk)
    for _ in range(max_chunks - local_chunks):
        if not finite:
            break
        hidden = filler.hidden.to(dtype).to(_device())
        if cfg.joint:  # the filler must reach the backbone too, like the real chunk on other ranks
            hidden = backbone_hidden_states(backbone, [filler], 1, 1, grad=True)[0] * 0 + hidden
        filled = head_loss_backward(head, [filler], [hidden], kind=cfg.kind, vgm=cfg.vgm,
                                    chunk_cycles=chunk_cycles, teacher_forcing=cfg.teacher_forcing,
                                    backward=weighted(0.0), agree=agree_finite, check=False, agree_max=agree_max,
                                    one_chunk_everywhere=max_chunks == 1)
        finite = filled.finite
    return stats, finite


def _alpha_sums(stats, k: int) -> list[float]:
    """This rank's per-position α sums, then counts (zeros when it has none)."""
    alpha_sum = stats.alpha_sum if stats is not None and stats.alpha_sum else [0.0] * k
    alpha_count = stats.alpha_count if stats is not None and stats.alpha_count else [0.0] * k
    return list(alpha_sum) + list(alpha_count)


def _alphas(prefix: str, sums: list[float], k: int) -> dict[str, float]:
    return {f"{prefix}_{position}": value / max(count, 1.0)
            for position, (value, count) in enumerate(zip(sums[:k], sums[k:2 * k]), start=1)}
