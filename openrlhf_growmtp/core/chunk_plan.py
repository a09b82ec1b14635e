"""The chunks one head update runs on this rank: its own, then zero-weight padding to the busiest rank's.

Data-parallel ranks run the head update in lockstep (`lockstep.py`): each computes its own work per chunk
(`chunks.ChunkWork`), the ranks agree once on the busiest rank's, and a rank with fewer chunks runs
padding chunks of one dummy cycle whose loss weighs 0. A record that does not fit the head fails on every
rank before any model work.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from .chunks import Chunk, ChunkWork
from .lockstep import Lockstep
from .recompute import elementwise_recomputed, worth_recomputing
from .records import RecordError, SequenceRecord
from .reconstruction import DraftPaths, check_batch
from .teacher_forcing import TeacherForcedChains


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
    relies on.
    """

    def __init__(self, head, records: Sequence[SequenceRecord], hiddens: Sequence[torch.Tensor] | None, cfg,
                 lockstep: Lockstep):
        self.head, self.cfg, self.lockstep = head, cfg, lockstep
        _agree_records_fit(head, records, hiddens, lockstep)
        self.paths = self._source(records, hiddens)
        depth, width = (records[0].depth, int(records[0].topk_ids.shape[2])) if records else (0, 0)
        count, self.depth, width = lockstep.most([len(self.paths), depth, width])
        self.work: list[ChunkWork] = []
        if self.depth:
            count = max(count, 1)
            self.padding = self._source(*_padding_cycle(head, self.depth, width, hiddens))
            for chunks in (self.paths, self.padding):
                chunks.one_chunk = count == 1
            mine = [self.paths.work(i) for i in range(len(self.paths))]
            mine += [self.padding.work(0)] * (count - len(self.paths))
            agreed = lockstep.most([n for w in mine for n in w.as_list()])
            self.work = [ChunkWork(*agreed[3 * i:3 * i + 3]) for i in range(count)]

    def _source(self, records, hiddens):
        if self.cfg.teacher_forcing:
            return TeacherForcedChains(self.head, records, hiddens, self.cfg.chunk_cycles)
        return DraftPaths(self.head, records, hiddens, self.cfg.chunk_cycles, self.cfg.vgm)

    @property
    def num_cycles(self) -> int:
        return self.paths.total

    @property
    def num_chunks(self) -> int:
        return len(self.paths)

    def __iter__(self) -> Iterator[PlannedChunk]:
        for i, work in enumerate(self.work):
            if i < len(self.paths):
                yield PlannedChunk(self.paths, i, work, 1.0 / self.paths.total)
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


def _padding_cycle(head, depth: int, width: int, hiddens) -> tuple[list[SequenceRecord], list[torch.Tensor]]:
    """One cycle in the head's shapes, whose loss weighs 0 (rank padding). Where the batch's hidden states
    carry a graph (joint mode), the padding's does too, so that its backward reaches the same modules."""
    config = head.config
    record = SequenceRecord.make_dummy(prompt_len=2, accepted=(0,), depth=depth, topk=min(width, config.vocab_size),
                                       vocab_size=config.vocab_size, hidden_size=config.hidden_size)
    like = hiddens[0] if hiddens else None
    param = next(head.parameters())
    hidden = record.hidden.to(device=param.device, dtype=param.dtype)
    if like is not None and like.requires_grad:
        hidden = hidden + like.sum().to(hidden.dtype) * 0.0
    return [record], [hidden]
