"""The head update of the paper's algorithm (Algorithm 1, lines 4-11) over a batch of verification records.

The words (cycle, draft position, draft path, chain length, chunk, objective, head α_k, VGM, DCA, ...) are
the README's glossary (README.md, "Glossary"); the symbols here:

- cycle r of a record (`records.py`): start s_r, drafts d_{r,1..K}, the target's top-k log-probs log p_{r,k}
  at every draft position k = 1..K, accepted count a_r;
- q_{r,k}: the head's distribution at draft position k, on the draft path [c_r, d_{r,1}, ..., d_{r,k-1}]
  (c_r the committed context), rebuilt from the records (`reconstruction.py`), not resampled;
- α_{r,k} = Σ_d min(p_{r,k}(d), q_{r,k}(d)), estimated on the recorded top-k plus one residual bin
  (`objectives.py`);
- j_r = a_r + 1 the first rejection (K + 1 when every draft passed); the chain length L_r = min(j_r, K)
  under VGM, K without;
- a cycle's DCA objective: -log Σ_{l≤L_r} Π_{i≤l} α_{r,i}; the ablations swap in TV, CE or KL, or train on
  the committed response instead of the draft paths (teacher forcing, `teacher_forcing.py`);
- the batch loss is the mean over cycles; its gradient reaches the head's parameters only (recorded p
  and j are constants; the backbone's hidden states enter detached unless they carry a graph);
- with `max_depth` K set, cycles drafted at a depth d < K that accepted all d drafts also train positions
  d+1..K along the committed sequence (`committed.py`): the committed chain adds its loss to the cycle's.

`head_loss_backward` is the algorithm box: for each chunk, reconstruct the draft paths, score log q at the
recorded top-k into alpha and each cycle's objective (`score`), and backpropagate; `measure_head_loss` runs
the same chunks without the backward; the committed chains run after the draft paths, as a second
plan of chunks scored from position d on. What data-parallel
ranks agree on (every chunk's work, padding chunks, records that fit) is the plan's (`chunk_plan.py`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

from .chunk_plan import ChunkPlan
from .chunks import Chunk
from .committed import committed_chains
from .lockstep import ONE_RANK, Lockstep
from .objectives import chain_lengths, head_loss_per_cycle_at
from .records import SequenceRecord
from .reconstruction import DEFAULT_CHUNK_CYCLES
from .topk_logq import TopKLogQ, group_bounds


@dataclass(frozen=True)
class HeadLossConfig:
    objective: str = "dca"  # objectives.OBJECTIVES
    vgm: bool = True
    chunk_cycles: int | None = DEFAULT_CHUNK_CYCLES  # None: one chunk
    teacher_forcing: bool = False
    alpha_estimate: str = "residual"  # objectives.ALPHA_ESTIMATES
    hybrid_lambda: float | None = None  # the hybrid objective's weight of CE (objectives.hybrid_lambda)
    # K: cycles drafted at a depth below it also train the positions past that depth on their committed chains
    # (`committed.py`); None: only the drafted positions train (a fixed K drafts every position anyway)
    max_depth: int | None = None


@dataclass
class HeadLossStats:
    """What one head update measured: its loss, and the head's α per draft position."""

    loss: float = 0.0  # batch loss (mean over cycles, or over teacher-forced chains)
    num_cycles: int = 0
    num_chunks: int = 0
    # per draft position k, over the cycles that reached k (every earlier draft accepted; with or without
    # VGM): the sum of the head's α, their count, and how many of them the engine accepted at k. The last
    # over the count is the engine's acceptance on the same cycles the α is averaged over.
    alpha_sum: list[float] = field(default_factory=list)
    alpha_count: list[float] = field(default_factory=list)
    accepted_count: list[float] = field(default_factory=list)
    finite: bool = True
    # the committed chains' share (`committed.py`), where they ran: their loss summed over chains over the
    # drafted cycles, their count, and their α at the positions each objective read
    committed: HeadLossStats | None = None

    @property
    def alpha_mean(self) -> list[float]:
        return alpha_means(self.alpha_sum, self.alpha_count)

    def add(self, scored: Scored, weight: float) -> None:
        """A chunk's share (padding chunks, of weight 0, measure nothing)."""
        if not weight:
            return
        self.loss += float(scored.loss) * weight
        # summed in fp32, as the α they are sums of
        for name, value in (("alpha_sum", scored.alpha * scored.reached), ("alpha_count", scored.reached),
                            ("accepted_count", scored.passed)):
            setattr(self, name, (torch.tensor(getattr(self, name)) + value.sum(0).cpu()).tolist())


def alpha_means(alpha_sum: Sequence[float], alpha_count: Sequence[float]) -> list[float]:
    """α per draft position over the cycles whose loss reads it, from their sums and counts."""
    return [total / max(count, 1.0) for total, count in zip(alpha_sum, alpha_count)]


@dataclass
class Scored:
    """One chunk scored: its summed loss, the gradient of weight x that sum at the states, α, which
    (cycle, position) drafting reached and which the engine accepted."""

    loss: torch.Tensor  # [] sum over the chunk's cycles
    grad_normed: torch.Tensor | None  # [M, H], None when not training
    alpha: torch.Tensor  # [N, K]
    reached: torch.Tensor  # [N, K] bool: positions 1..min(a_r + 1, K), every earlier draft accepted
    passed: torch.Tensor  # [N, K] bool: positions 1..a_r, accepted by the engine


def head_loss_backward(head, records: Sequence[SequenceRecord], hiddens: Sequence[torch.Tensor] | None = None,
                       cfg: HeadLossConfig = HeadLossConfig(), lockstep: Lockstep = ONE_RANK) -> HeadLossStats:
    """Accumulate the gradient of the batch loss into the head's .grad, chunk by chunk (`_over_chunks`).

    hiddens: H_p [T, H] per record (the trainer's), or None to read each record's own. A record that does
    not fit the head fails on every rank before any model work (RecordError naming the record and field).
    If a chunk's loss is not finite on some rank, no rank backpropagates it and the stats say
    finite=False: the caller must then drop this update (earlier chunks may have added gradients).
    """
    return _over_chunks(head, records, hiddens, cfg, lockstep, train=True)


def measure_head_loss(head, records: Sequence[SequenceRecord], hiddens: Sequence[torch.Tensor] | None = None,
                      cfg: HeadLossConfig = HeadLossConfig(), lockstep: Lockstep = ONE_RANK) -> HeadLossStats:
    """The batch loss and the head's α as `head_loss_backward` measures them, over the same chunks (the ranks
    in lockstep alike), without a backward or any gradient: a reading of the head as it is."""
    with torch.no_grad():
        return _over_chunks(head, records, hiddens, cfg, lockstep, train=False)


def _over_chunks(head, records: Sequence[SequenceRecord], hiddens: Sequence[torch.Tensor] | None,
                 cfg: HeadLossConfig, lockstep: Lockstep, train: bool) -> HeadLossStats:
    """The draft paths' chunks, then (where cycles were drafted shallower than `cfg.max_depth`) the committed
    chains' (`committed.py`), weighed per drafted cycle. Every rank takes the same branch: the depth is agreed."""
    plan = ChunkPlan(head, records, hiddens, cfg, lockstep)  # this rank's chunks, then padding
    # a draft vocabulary's lm_head rows, sliced once for all chunks, where any rank has one (agreed: plan.work)
    rows = head.sliced_draft_rows(lockstep.gathered) if plan.work else contextlib.nullcontext()
    with rows:
        stats = _run(plan, head, cfg, train)
        depth = plan.depth
        if stats.finite and cfg.max_depth is not None and not cfg.teacher_forcing and 0 < depth < cfg.max_depth:
            chains, chain_hiddens = committed_chains(head, records, hiddens, depth, cfg.max_depth, lockstep)
            chain_cfg = replace(cfg, vgm=True)  # a chain's length is where its targets end (committed.py)
            chain_plan = ChunkPlan(head, chains, chain_hiddens, chain_cfg, lockstep, per_cycle=plan.num_cycles)
            stats.committed = _run(chain_plan, head, chain_cfg, train, first_position=depth)
            stats.finite = stats.committed.finite
    return stats


def _run(plan: ChunkPlan, head, cfg: HeadLossConfig, train: bool, first_position: int = 0) -> HeadLossStats:
    """The algorithm box: for each chunk, reconstruct, score, and (`train`) backpropagate."""
    stats = HeadLossStats(num_cycles=plan.num_cycles, num_chunks=plan.num_chunks,
                          alpha_sum=[0.0] * plan.depth, alpha_count=[0.0] * plan.depth,
                          accepted_count=[0.0] * plan.depth)
    with plan.recomputing(train):
        for planned in plan:
            chunk = planned.reconstruct()  # the draft paths, as drafted
            scored = score(head, chunk, cfg, planned.work.score_groups, train, first_position)  # log q -> α -> loss
            if not plan.every_finite(scored.loss):  # never backpropagate a non-finite loss
                stats.loss, stats.finite = float("nan"), False
                break
            if train:
                planned.backward(chunk, scored.grad_normed, plan.lockstep.backward)
            stats.add(scored, planned.weight)
    return stats


def score(head, chunk: Chunk, cfg: HeadLossConfig, groups: int, train: bool = True, first_position: int = 0) -> Scored:
    """α and the loss of every cycle of `chunk`, and (with `train`) the gradient of weight x their sum at the
    chunk's states. The slots are scored in `groups` groups of whole cycles (`topk_logq`); a group without
    cycles scores one padding slot with weight 0 (ranks make the same lm_head calls). Positions past a
    chain's length hold a padding slot's log q or the target's own log p there: finite, and read by nothing.
    `first_position` (0-based): the objective reads positions from there on, as a chain of its own (committed
    chains); the slots before it are not scored.
    """
    states, num_cycles, depth = chunk.states, chunk.num_cycles, int(chunk.topk_ids.shape[1])
    device, first = states.normed.device, first_position
    read = torch.nonzero(states.position >= first).flatten()  # the slots the objective reads: all where first = 0
    order = read[torch.argsort(states.cycle[read] * depth + states.position[read])]  # a cycle's slots side by side
    bounds = group_bounds(states.cycle[read], num_cycles, groups)  # group g: cycles [b_g, b_g+1)
    row_bounds = torch.searchsorted(states.cycle[order], torch.tensor(bounds, device=device)).tolist()
    grad_normed = torch.zeros_like(states.normed) if train else None
    alpha = torch.zeros(num_cycles, depth, device=device)
    loss_sum = torch.zeros((), device=device)
    for g in range(groups):
        lo, hi = bounds[g], bounds[g + 1]
        rows = order[row_bounds[g]:row_bounds[g + 1]]
        pad = rows.numel() == 0
        rows = (order[:1] if order.numel() else torch.zeros(1, dtype=torch.long, device=device)) if pad else rows
        cycle, position = states.cycle[rows], states.position[rows]
        scores = TopKLogQ(head, states.normed[rows], chunk.topk_ids[cycle, position], states.temperature[cycle])
        with torch.enable_grad():
            if pad:  # weight 0, finite where a draft vocabulary leaves some log q at -inf
                loss = scores.logq.nan_to_num(neginf=0.0).sum() * 0.0
            else:
                target = chunk.topk_logprobs[lo:hi, first:].float()
                accepted = chunk.accepted[lo:hi] - first if chunk.vgm else None  # the chain from `first` on
                per_cycle, alpha[lo:hi, first:] = head_loss_per_cycle_at(
                    target.index_put((cycle - lo, position - first), scores.logq), target, accepted, cfg.objective,
                    alpha_residual=cfg.alpha_estimate == "residual", hybrid_lambda=cfg.hybrid_lambda)
                loss = per_cycle.sum()
            if train:
                (grad_logq,) = torch.autograd.grad(loss * (0.0 if pad else chunk.weight), scores.logq)
                # added, not assigned: a padding row is some group's real slot, and its gradient here is 0
                add_rows_(grad_normed, rows, scores.input_grad(grad_logq))
        loss_sum = loss_sum + loss.detach()
    positions = torch.arange(depth, device=device)[None, :]
    lengths = chain_lengths(chunk.accepted, num_cycles, depth, device=device)
    reached = (positions < lengths[:, None]) & (positions >= first)
    passed = (positions < chunk.accepted.long()[:, None]) & (positions >= first)
    return Scored(loss_sum, grad_normed, alpha, reached, passed)


def add_rows_(dest: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """dest[rows[i]] += values[i] for every i, repeated rows summed (dest [M, H], rows [n], values [n, H]).

    One kernel whether or not torch's deterministic algorithms are on, so that a strict run vouches for a
    production one. `index_add_` would not be: on CUDA it takes atomic adds (`index_add_cuda_impl`,
    aten/src/ATen/native/cuda/Indexing.cu), and under deterministic algorithms it calls
    `index_put_(..., accumulate=True)` instead. `index_put_` with accumulate takes the sort-based kernel on
    CUDA in both modes (`_index_put_impl_`, aten/src/ATen/native/TensorAdvancedIndexing.cpp: `accumulate ||
    deterministicAlgorithms()` -> `index_put_with_sort_kernel`), and checks the rows' range on the host first
    (`wrapIndexOnce`): a row out of range raises an error naming it and the size, not a device-side assert.
    """
    return dest.index_put_((rows,), values, accumulate=True)

