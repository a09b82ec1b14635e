"""The head update of one RL step, run on every data-parallel rank inside the policy's training step.

Each rank reconstructs and scores the cycles of its own samples (transport-free mode: the target hidden
states come from a forward of the pre-update policy over the committed sequences). ZeRO-3 gathers
parameters and reduces gradients collectively, so every rank must run the same sequence of module calls
and backwards whatever its share of the records: ranks with fewer batches or chunks run zero-weighted
filler work, and the finiteness check is agreed across ranks before every backward.

Gradient scale: each rank's loss is normalised by its own cycle count, then rescaled so that, after
DeepSpeed averages over ranks and divides by gradient accumulation, the head's gradient is the gradient
of the mean loss over all cycles of the step on all ranks.

No openrlhf or DeepSpeed import here: the caller passes `backward` (DeepSpeed's engine backward).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
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


def agree_finite(local_finite: bool) -> bool:
    """True only if the chunk loss is finite on every rank (all ranks then backpropagate or all stop)."""
    return _all_reduce([1.0 if local_finite else 0.0], dist.ReduceOp.MIN)[0] > 0.5


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


def filler_record(head: MTPHead, k: int, topk: int) -> SequenceRecord:
    """A one-cycle record in the head's shapes; its loss is multiplied by zero (rank padding only)."""
    config = head.config
    return SequenceRecord.make_dummy(prompt_len=2, accepted=(0,), depth=k, topk=min(topk, config.vocab_size),
                                     vocab_size=config.vocab_size, hidden_size=config.hidden_size)


def update_head(head: MTPHead, backbone: nn.Module, records: Sequence[SequenceRecord], cfg: HeadUpdateConfig,
                backward: Callable[[torch.Tensor], None], gradient_accumulation: int = 1) -> dict[str, float]:
    """Accumulate this step's head gradients on every rank; returns step metrics (identical on all ranks).

    `backward(loss)` must run DeepSpeed's engine backward (which divides by `gradient_accumulation`).
    Records arrive validated from the engine boundary; here they are only checked to fit the head
    (`check_batch`). If a record on any rank does not, every rank raises before any model work; if a
    chunk loss is not finite on any rank, every rank stops backpropagating and the result has finite=0.
    """
    began = time.perf_counter()
    error = ""
    try:
        check_batch(head, records)
    except RecordError as err:
        error = str(err)
    if _all_reduce([1.0 if error else 0.0], dist.ReduceOp.MAX)[0] > 0.5:
        raise RecordError(error or "a malformed record on another data-parallel rank (see its log)")

    joint = cfg.joint
    # Joint mode backpropagates through the backbone once per rank: one chunk (None), one graph.
    chunk_cycles = None if joint else cfg.chunk_cycles
    local_cycles = sum(rec.num_cycles for rec in records)
    local_chunks = count_chunks(records, chunk_cycles, cfg.teacher_forcing) if records else 0
    local_batches = math.ceil(len(records) / cfg.hidden_batch_size)
    local_k = records[0].depth if records else 0
    max_chunks, max_batches, k = _all_reduce([local_chunks, local_batches, local_k], dist.ReduceOp.MAX)
    (total_cycles,) = _all_reduce([float(local_cycles)], dist.ReduceOp.SUM)
    metrics = {"head_cycles": total_cycles, "head_finite": 1.0}
    if max_chunks == 0:
        metrics.update(head_loss=0.0, head_update_s=time.perf_counter() - began)
        return metrics

    k, dtype = int(k), next(head.parameters()).dtype
    topk = int(records[0].topk_ids.shape[2]) if records else head.config.vocab_size
    hiddens = backbone_hidden_states(backbone, records, int(max_batches), cfg.hidden_batch_size, grad=joint)
    scale = _world_size() * gradient_accumulation * local_cycles / max(total_cycles, 1.0)

    def weighted(weight: float) -> Callable[[torch.Tensor], None]:
        return lambda loss: backward(loss * weight)

    finite, stats = True, None
    if records:
        hiddens = [h.to(dtype) for h in hiddens]
        stats = head_loss_backward(head, records, hiddens, kind=cfg.kind, vgm=cfg.vgm, chunk_cycles=chunk_cycles,
                                   teacher_forcing=cfg.teacher_forcing, backward=weighted(scale), agree=agree_finite,
                                   check=False)
        finite = stats.finite
    filler = filler_record(head, k, topk)
    for _ in range(int(max_chunks) - local_chunks):
        if not finite:
            break
        hidden = filler.hidden.to(dtype).to(_device())
        if joint:  # the filler must reach the backbone too, like the real chunk on other ranks
            hidden = backbone_hidden_states(backbone, [filler], 1, 1, grad=True)[0] * 0 + hidden
        filled = head_loss_backward(head, [filler], [hidden], kind=cfg.kind, vgm=cfg.vgm,
                                    chunk_cycles=chunk_cycles, teacher_forcing=cfg.teacher_forcing,
                                    backward=weighted(0.0), agree=agree_finite, check=False)
        finite = filled.finite

    local_sum = stats.loss * local_cycles if stats is not None and stats.finite else 0.0
    alpha_sum = stats.alpha_sum if stats is not None and stats.alpha_sum else [0.0] * k
    alpha_count = stats.alpha_count if stats is not None and stats.alpha_count else [0.0] * k
    # The recorded top-k's share of the target's mass: the sparse alpha estimate can exceed the true alpha
    # by at most 1 minus it (objectives.py), so a small value says the alphas above are loose.
    local_mass = sum(float(torch.logsumexp(rec.topk_logprobs.float(), dim=-1).exp().sum()) for rec in records)
    sums = _all_reduce([local_sum, local_mass] + alpha_sum + alpha_count, dist.ReduceOp.SUM)
    metrics["head_finite"] = 1.0 if finite else 0.0
    metrics["head_loss"] = sums[0] / max(total_cycles, 1.0) if finite else float("nan")
    metrics["head_topk_mass"] = sums[1] / max(total_cycles * k, 1.0)  # mean over cycles and draft positions
    if not cfg.teacher_forcing:
        # per position, over the cycles whose loss reads it (under VGM: those that reached it)
        for position, (value, count) in enumerate(zip(sums[2:2 + k], sums[2 + k:]), start=1):
            metrics[f"head_alpha_{position}"] = value / max(count, 1.0)
    metrics["head_update_s"] = time.perf_counter() - began
    return metrics
