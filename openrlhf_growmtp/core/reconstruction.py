"""Draft-path reconstruction: rebuild every recorded cycle's q_1..q_K exactly as drafting computed them.

Chain by chain, cycle r (start s, drafts d) is: a head KV cache with one entry per committed position
p = 0..s from (H_p, x_{p+1}) at RoPE position p; q_1 from the output at s; then step j = 2..K feeds
(h'_{j-1}, d_{j-1}) at position s+j-1. Nothing is sampled: the recorded drafts are inputs.

Batched, the prefix's keys and values come from the layer's input norm and projections alone (no
attention, no MLP), and K steps advance every cycle of a chunk by one position each: depth 1 feeds
(H_s, x_{s+1}) at s, depth j feeds (h'_{j-1}, d_{j-1}). At every depth a cycle's query sees its own
sequence's committed prefix (p < s) and its own chain entries of depths 1..j (at depth 1, the entry of
s itself), and nothing else: `draft_attention.DraftPathAttention` scores exactly those keys. Worked
example, one sequence of 4 prefix slots, 2 cycles starting at s = 1 and 3, at depth 3 (keys: prefix
p0..p3 | the depth-1, depth-2 and depth-3 entries of cycles c0 c1):

    cycle 0 (s=1):  1 0 0 0 | 1 0 | 1 0 | 1 0
    cycle 1 (s=3):  1 1 1 0 | 0 1 | 0 1 | 0 1

Under VGM a chain stops at its first rejection: the positions after it carry no loss and are not built.
Chunks of cycles run their forwards and their own backward (`scoring.chunk_loss_backward`, which never
holds a chunk's full-vocabulary logits); each chunk's loss is weighted by its share of the batch's
cycles, so accumulated gradients equal one backward over the whole batch (chunk graphs are disjoint:
the prefix keys and values they read are leaves, computed once per sequence and backpropagated once
after its last chunk, `prefix.PrefixStore`; a call of one chunk keeps them in its graph instead).
During the update the head keeps only inputs and matrix products' outputs for backward where chunks
are large (`recompute.elementwise_recomputed`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .draft_attention import DraftPathAttention
from .head import MTPHead
from .objectives import chain_lengths
from .prefix import PrefixStore, hidden_of
from .recompute import elementwise_recomputed, worth_recomputing
from .records import RecordError, SequenceRecord
from .scoring import DraftStates, HeadLossStats, chunk_loss_backward
from .teacher_forcing import count_teacher_forcing_chunks, teacher_forced_loss_backward
from .validation import check_fits

DEFAULT_CHUNK_CYCLES = 1024


@dataclass
class Piece:
    """Cycles [lo, hi) of sequence `seq`, reconstructed together in one chunk."""

    seq: int
    lo: int
    hi: int


def plan_chunks(records: Sequence[SequenceRecord], chunk_cycles: int | None) -> list[list[Piece]]:
    """Split the batch's cycles, in order, into chunks of at most chunk_cycles cycles (None: one chunk)."""
    if chunk_cycles is None:
        chunk_cycles = max(1, sum(rec.num_cycles for rec in records))
    if chunk_cycles < 1:
        raise ValueError(f"chunk_cycles must be >= 1, got {chunk_cycles}")
    chunks, current, room = [], [], chunk_cycles
    for seq, rec in enumerate(records):
        lo = 0
        while lo < rec.num_cycles:
            hi = min(rec.num_cycles, lo + room)
            current.append(Piece(seq, lo, hi))
            room -= hi - lo
            lo = hi
            if room == 0:
                chunks.append(current)
                current, room = [], chunk_cycles
    if current:
        chunks.append(current)
    return chunks


def reconstruct_states(head: MTPHead, records: Sequence[SequenceRecord], pieces: Sequence[Piece],
                       prefix: PrefixStore, lengths: torch.Tensor | None = None) -> DraftStates:
    """The states behind draft positions 1..lengths[c] of every cycle c of `pieces` (None: all K), over
    the prefixes `prefix` holds (opened for every sequence of `pieces`).

    A chain stops at its length: under VGM the positions after the first rejection carry no loss, so
    their chain steps are never run. Rows are ordered by position, then cycle. Every depth runs, and
    once no chain reaches a depth, one passenger (a cycle already past its length) runs it alone: under
    ZeRO-3 each head call gathers parameters, so data-parallel ranks must make the same calls. The
    passenger's rows lie past its length, where the loss reads nothing (`chunk_loss_backward`).
    """
    device = prefix.device
    depth = records[pieces[0].seq].depth
    seq_local = torch.cat([torch.full((pc.hi - pc.lo,), i, dtype=torch.long) for i, pc in enumerate(pieces)])
    seq_local = seq_local.to(device)
    start = _cat_cycles(records, pieces, "start").to(device)
    drafts = _cat_cycles(records, pieces, "drafts").to(device)
    temperature = torch.cat([torch.full((pc.hi - pc.lo,), float(records[pc.seq].temperature)) for pc in pieces])
    num_cycles = int(start.shape[0])
    lengths = torch.full((num_cycles,), depth, device=device) if lengths is None else lengths.to(device)

    # Depth 1 feeds (H_s, x_{s+1}) at s, over the prefix p < s; depth j feeds (h'_{j-1}, d_{j-1}).
    feed = torch.cat([prefix.hidden[pc.seq][records[pc.seq].start[pc.lo:pc.hi].to(device)] for pc in pieces])
    token = torch.cat([records[pc.seq].token_ids[records[pc.seq].start[pc.lo:pc.hi] + 1] for pc in pieces])
    token = token.to(device)
    path = DraftPathAttention([prefix.keys[pc.seq] for pc in pieces], seq_local, start,
                              head.config.num_attention_heads)
    cycles = torch.arange(num_cycles, device=device)  # the cycles still drafting at this depth
    normed, slot_cycle = [], []
    for j in range(1, depth + 1):
        if j > 1:
            alive = lengths[cycles] >= j
            if not bool(alive.any()):
                alive[0] = True  # the passenger
            cycles, feed = cycles[alive], feed[alive]
            token = drafts[cycles, j - 2]
        path.next_depth(cycles)
        out = head(feed.unsqueeze(0), token.unsqueeze(0), (start[cycles] + j - 1).unsqueeze(0), cache=path,
                   draft_path=path)
        normed.append(out.normed[0])
        slot_cycle.append(cycles)
        feed = out.feed_back[0]
    position = torch.cat([torch.full_like(c, j) for j, c in enumerate(slot_cycle)])
    return DraftStates(torch.cat(normed), torch.cat(slot_cycle), position, temperature.to(device))


def reconstruct_chunk(head: MTPHead, records: Sequence[SequenceRecord], pieces: Sequence[Piece],
                      hiddens: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """Draft logits [N, K, V] (divided by each request's temperature) for the cycles of `pieces`, in order.

    Full-vocabulary logits: for the invariant tests and small batches (training: `chunk_loss_backward`)."""
    prefix = PrefixStore(head, records, hiddens)
    prefix.open(sorted({pc.seq for pc in pieces}))
    states = reconstruct_states(head, records, pieces, prefix)
    logits = head.logits(states.normed).float() / states.temperature[states.cycle, None]
    num_cycles, depth = int(states.temperature.shape[0]), records[pieces[0].seq].depth
    return logits.new_zeros(num_cycles, depth, logits.shape[-1]).index_put((states.cycle, states.position), logits)


def reconstruct_draft_logits(head: MTPHead, records: Sequence[SequenceRecord],
                             hiddens: Sequence[torch.Tensor] | None = None,
                             chunk_cycles: int = DEFAULT_CHUNK_CYCLES) -> torch.Tensor:
    """Draft logits [N, K, V] for every cycle of the batch (in record order), chunk by chunk."""
    return torch.cat([reconstruct_chunk(head, records, pieces, hiddens)
                      for pieces in plan_chunks(records, chunk_cycles)])


def _cat_cycles(records: Sequence[SequenceRecord], pieces: Sequence[Piece], name: str) -> torch.Tensor:
    return torch.cat([getattr(records[pc.seq], name)[pc.lo:pc.hi] for pc in pieces])


# ---- the head update -----------------------------------------------------------------------------------
def head_loss_backward(head: MTPHead, records: Sequence[SequenceRecord],
                       hiddens: Sequence[torch.Tensor] | None = None, *, kind: str = "dca", vgm: bool = True,
                       chunk_cycles: int | None = DEFAULT_CHUNK_CYCLES, teacher_forcing: bool = False,
                       backward: Callable[[torch.Tensor], None] | None = None,
                       agree: Callable[[bool], bool] | None = None, check: bool = True,
                       agree_max: Callable[[int], int] | None = None,
                       one_chunk_everywhere: bool | None = None) -> HeadLossStats:
    """Reconstruct, score and backpropagate the head loss over a batch of records, chunk by chunk.

    Gradients accumulate into the head's .grad (via `backward`, default loss.backward()). If a chunk's
    loss is not finite, it is not backpropagated and the returned stats say finite=False: the caller must
    then drop the head's gradients for this step (earlier chunks may have accumulated some).
    `agree(local_finite) -> global_finite` is asked before every chunk's backward; data-parallel callers
    pass an all-reduce so that every rank stops at the same chunk, and `agree_max(local count) -> max
    over ranks` (an all-reduce MAX) so that every rank runs as many prefix pieces (`prefix.PrefixStore`)
    and scores as many groups per chunk (`scoring.chunk_loss_backward`).
    `one_chunk_everywhere`: every rank runs this call in one chunk, so each prefix keeps its graph into
    the chunk's backward (`PrefixStore(graph=True)`); data-parallel callers must agree on it (the
    trainer: its busiest rank has one chunk); None: decided from this call alone.
    `check=False` skips `check_batch` for a caller that ran it already (the trainer agrees on it across
    ranks first).
    """
    backward = backward or (lambda loss: loss.backward())
    agree = agree or (lambda finite: finite)
    agree_max = agree_max or (lambda count: count)
    if check:
        check_batch(head, records, hiddens)
    if teacher_forcing:
        return teacher_forced_loss_backward(head, records, lambda i: hidden_of(records, hiddens, i), kind,
                                            chunk_cycles, backward, agree, agree_max)
    total = sum(rec.num_cycles for rec in records)
    if total == 0:
        return HeadLossStats(loss=0.0, num_cycles=0, num_chunks=0)
    depth = records[0].depth
    # a prefix piece holds at most as many positions as a chunk has slots (one piece in a single chunk)
    chunks = plan_chunks(records, chunk_cycles)
    graph = len(chunks) == 1 if one_chunk_everywhere is None else one_chunk_everywhere
    prefix = PrefixStore(head, records, hiddens, None if chunk_cycles is None else chunk_cycles * depth, agree_max,
                         graph=graph)
    recompute = worth_recomputing(head, None if chunk_cycles is None else chunk_cycles * depth)
    with elementwise_recomputed(head) if recompute else contextlib.nullcontext():
        return _chunks_loss_backward(head, records, chunks, prefix, kind, vgm, backward, agree, agree_max)


def _chunks_loss_backward(head: MTPHead, records: Sequence[SequenceRecord], chunks: list[list[Piece]],
                          prefix: PrefixStore, kind: str, vgm: bool, backward, agree, agree_max
                          ) -> HeadLossStats:
    device, depth, total = prefix.device, records[0].depth, sum(rec.num_cycles for rec in records)
    # each sequence's prefix opens in its first chunk and closes after its last one (prefix.py)
    first, last = {}, {}
    for i, pieces in enumerate(chunks):
        for pc in pieces:
            first.setdefault(pc.seq, i)
            last[pc.seq] = i
    loss_sum, alpha_sum, alpha_count = 0.0, 0.0, 0.0
    for i, pieces in enumerate(chunks):
        prefix.open([pc.seq for pc in pieces if first[pc.seq] == i])
        accepted = _cat_cycles(records, pieces, "accepted").to(device) if vgm else None
        lengths = chain_lengths(accepted, sum(pc.hi - pc.lo for pc in pieces), depth, device=device)
        states = reconstruct_states(head, records, pieces, prefix, lengths)
        # weight 1/total: the chunk's mean x its share of the batch's cycles
        chunk_loss, alpha, read = chunk_loss_backward(
            head, states, _cat_cycles(records, pieces, "topk_ids").to(device),
            _cat_cycles(records, pieces, "topk_logprobs").to(device), accepted, kind, 1.0 / total,
            prefix.chunk_backward(backward), agree, agree_max)
        if chunk_loss is None:
            return HeadLossStats(loss=float("nan"), num_cycles=total, num_chunks=len(chunks), finite=False)
        prefix.close([pc.seq for pc in pieces if last[pc.seq] == i], backward)
        loss_sum += chunk_loss
        alpha_sum = alpha_sum + (alpha * read).sum(0)
        alpha_count = alpha_count + read.sum(0)
    return HeadLossStats(loss=loss_sum, num_cycles=total, num_chunks=len(chunks), alpha_sum=alpha_sum.tolist(),
                         alpha_count=alpha_count.float().tolist())


def count_chunks(records: Sequence[SequenceRecord], chunk_cycles: int | None = DEFAULT_CHUNK_CYCLES,
                 teacher_forcing: bool = False) -> int:
    """How many forward/backward chunks `head_loss_backward` runs for this batch (no model work)."""
    if teacher_forcing:
        return count_teacher_forcing_chunks(records, chunk_cycles)
    return len(plan_chunks(records, chunk_cycles))


def check_batch(head: MTPHead, records: Sequence[SequenceRecord],
                hiddens: Sequence[torch.Tensor] | None = None) -> None:
    """Check that every record fits the head (`validation.check_fits`: one depth, the head's vocabulary and
    width) before any model work; errors name the record and field. Records are validated in full once,
    where they are made (the engine boundary): this is not that validation again."""
    if hiddens is not None and len(hiddens) != len(records):
        raise RecordError(f"hidden: {len(hiddens)} hidden tensors for {len(records)} records")
    depth = records[0].depth if records else None
    for i, rec in enumerate(records):
        try:
            check_fits(rec, depth=depth, vocab_size=head.config.vocab_size, hidden_size=head.config.hidden_size)
            if hiddens is not None and tuple(hiddens[i].shape) != (rec.token_ids.shape[0], head.config.hidden_size):
                raise RecordError(f"hidden: trainer hidden has shape {tuple(hiddens[i].shape)}, expected "
                                  f"[{rec.token_ids.shape[0]}, {head.config.hidden_size}]")
        except RecordError as err:
            raise RecordError(f"record {i}: {err}") from None
