"""The chunks one head update runs on this rank: its own, then zero-weight padding to the busiest rank's.

Data-parallel ranks run the head update in lockstep (`lockstep.py`): each computes its own work per chunk
(`chunks.ChunkWork`), the ranks agree once on the busiest rank's, and a rank with fewer chunks runs
padding chunks of one dummy cycle whose loss weighs 0. A record that does not fit the head fails on every
rank before any model work.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from .chunks import Chunk, ChunkWork
from .lockstep import Lockstep
from .recompute import elementwise_recomputed, worth_recomputing
from .records import RecordError, SequenceRecord
from .reconstruction import ChunkLayout, DraftPaths, check_batch, plan_chunks
from .teacher_forcing import TeacherForcedChains, TeacherForcingLayout, teacher_forcing_layout


@dataclass
class PlannedChunk:
    """Chunk `index` of `source` (this rank's chunks, or the padding chunk), with the work every rank runs."""

    source: DraftPaths | TeacherForcedChains
    index: int
    work: ChunkWork
    weight: float  # of each cycle's loss in the batch loss: 1 / the batch's cycles; 0 for padding

    def reconstruct(self) -> Chunk:
        """The head's states at the chunk's slots, rebuilt as drafting ran them."""
        return self.source.chunk(self.index, self.work, self.weight)

    def backward(self, chunk: Chunk, grad_normed: torch.Tensor, backward) -> None:
        """Backpropagate the chunk's loss, given its gradient at the states (`head_loss.score`)."""
        surrogate = (chunk.states.normed * grad_normed).sum()  # its gradient is the loss's
        self.source.backward(self.index, self.work, surrogate, backward)


class ChunkPlan:
    """What one head update runs on this rank, agreed with the other ranks (module docstring).

    Iterating gives this rank's chunks, then its padding chunks; `num_cycles` and `num_chunks` are this
    rank's own. No chunk at all where no rank has a record; otherwise at least one on every rank (padding
    where no rank has a cycle): an update is then always one head backward at least, which the trainer
    relies on. Each cycle's loss weighs 1 / this rank's cycles, or 1 / `per_cycle` where given (committed
    chains weigh per drafted cycle).
    """

    def __init__(self, head, records: Sequence[SequenceRecord], hiddens: Sequence[torch.Tensor] | None, cfg,
                 lockstep: Lockstep, per_cycle: int | None = None):
        self.head, self.cfg, self.lockstep, self.per_cycle = head, cfg, lockstep, per_cycle
        _agree_records_fit(head, records, hiddens, lockstep)
        layout = self._layout(records)  # no model work yet
        depth, width = (records[0].depth, int(records[0].topk_ids.shape[2])) if records else (0, 0)
        count, self.depth, width = lockstep.most([len(layout.chunks), depth, width])
        if self.depth:
            count = max(count, 1)
        # every rank runs one chunk: the prefixes keep their graph into its backward (`prefix.PrefixStore`)
        one_chunk = bool(self.depth) and count == 1
        self.paths = self._source(records, hiddens, layout, one_chunk)
        self.work: list[ChunkWork] = []
        if self.depth:
            padding = _padding_cycle(head, self.depth, width, hiddens)
            self.padding = self._source(*padding, self._layout(padding[0]), one_chunk)
            mine = [self.paths.work(i) for i in range(len(self.paths))]
            mine += [self.padding.work(0)] * (count - len(self.paths))
            agreed = lockstep.most([n for w in mine for n in w.as_list()])
            self.work = [ChunkWork(*agreed[3 * i:3 * i + 3]) for i in range(count)]

    def _layout(self, records) -> ChunkLayout | TeacherForcingLayout:
        if self.cfg.teacher_forcing:
            return teacher_forcing_layout(records, self.cfg.chunk_cycles)
        return ChunkLayout(plan_chunks(records, self.cfg.chunk_cycles), self.cfg.chunk_cycles)

    def _source(self, records, hiddens, layout, one_chunk: bool):
        if self.cfg.teacher_forcing:
            return TeacherForcedChains(self.head, records, hiddens, layout)
        return DraftPaths(self.head, records, hiddens, layout, self.cfg.vgm, one_chunk)

    @property
    def num_cycles(self) -> int:
        return self.paths.total

    @property
    def num_chunks(self) -> int:
        return len(self.paths)

    def __iter__(self) -> Iterator[PlannedChunk]:
        for i, work in enumerate(self.work):
            if i < len(self.paths):
                yield PlannedChunk(self.paths, i, work, 1.0 / (self.per_cycle or self.paths.total))
            else:
                yield PlannedChunk(self.padding, 0, work, 0.0)

    def recomputing(self, train: bool):
        """Elementwise work recomputed in backward where a chunk's activations are large (`recompute.py`)."""
        chunk_slots = None if self.cfg.chunk_cycles is None else self.cfg.chunk_cycles * self.depth
        if train and self.work and worth_recomputing(self.head, chunk_slots):
            return elementwise_recomputed(self.head)
        return contextlib.nullcontext()

    def every_finite(self, loss: torch.Tensor) -> bool:
        """Whether the chunk's loss is finite on every rank (no rank then backpropagates it)."""
        return self.lockstep.every(bool(torch.isfinite(loss)))


def _agree_records_fit(head, records, hiddens, lockstep: Lockstep) -> None:
    error = ""
    try:
        check_batch(head, records, hiddens)
    except RecordError as err:
        error = str(err)
    if not lockstep.every(not error):
        raise RecordError(error or "a malformed record on another data-parallel rank (see its log)")


def padding_record(depth: int, width: int, hidden_size: int) -> SequenceRecord:
    """A record of one cycle (its drafts all rejected) in the head's shapes, for rank padding: a two-token
    prompt, the cycle's recovered token and one more, the top `width` ids at uniform log-probs. What it holds
    is never read into a loss or a gradient (its weight is 0); its shapes set the padding's module calls."""
    length = 4  # prompt x_0 x_1, the cycle's recovered token at 2 (start s = 1), and one more
    topk_ids = torch.arange(width).expand(1, depth, width).clone()
    return SequenceRecord(token_ids=torch.zeros(length, dtype=torch.long), prompt_len=2,
                          start=torch.ones(1, dtype=torch.long), drafts=torch.zeros(1, depth, dtype=torch.long),
                          topk_ids=topk_ids, topk_logprobs=torch.full((1, depth, width), -math.log(width)),
                          accepted=torch.zeros(1, dtype=torch.long), hidden=torch.zeros(length, hidden_size))


def _padding_cycle(head, depth: int, width: int, hiddens) -> tuple[list[SequenceRecord], list[torch.Tensor]]:
    """One padding cycle (`padding_record`), whose loss weighs 0. Where the batch's hidden states carry a graph
    (joint mode), the padding's does too, so that its backward reaches the same modules."""
    config = head.config
    record = padding_record(depth, min(width, config.vocab_size), config.hidden_size)
    like = hiddens[0] if hiddens else None
    param = next(head.parameters())
    hidden = record.hidden.to(device=param.device, dtype=param.dtype)
    if like is not None and like.requires_grad:
        hidden = hidden + like.sum().to(hidden.dtype) * 0.0
    return [record], [hidden]
