"""Draft-path reconstruction: rebuild every recorded cycle's q_1..q_K exactly as drafting computed them.

Chain by chain, cycle r (start s, drafts d) is: a head KV cache with one entry per committed position
p = 0..s from (H_p, x_{p+1}) at RoPE position p; q_1 from the output at s; then draft position j = 2..K
feeds (h'_{j-1}, d_{j-1}) at position s+j-1. Nothing is sampled: the recorded drafts are inputs.

Batched, the prefix's keys and values come from the layer's input norm and projections alone (no
attention, no MLP; `prefix.PrefixStore`), and K forwards advance every cycle of a chunk by one draft
position each: position 1 feeds (H_s, x_{s+1}) at s, position j feeds (h'_{j-1}, d_{j-1}). At every
position a cycle's query sees its own sequence's committed prefix (p < s) and its own chain entries of
positions 1..j (at position 1, the entry of s itself), and nothing else: `draft_attention` scores
exactly those keys. Worked example, one sequence of 4 prefix slots, 2 cycles starting at s = 1 and 3,
at draft position 3 (keys: prefix p0..p3 | the position-1, -2 and -3 entries of cycles c0 c1):

    cycle 0 (s=1):  1 0 0 0 | 1 0 | 1 0 | 1 0
    cycle 1 (s=3):  1 1 1 0 | 0 1 | 0 1 | 0 1

Under VGM a chain stops at its first rejection: the positions after it carry no loss and are not built.
`DraftPaths` is this work for the head update, chunk by chunk (`head_loss.head_loss_backward`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .chunks import Chunk, ChunkWork, DraftStates, slots_per_chunk
from .draft_attention import DraftPathAttention
from .head import MTPHead
from .objectives import chain_lengths
from .prefix import PrefixStore
from .records import RecordError, SequenceRecord
from .topk_logq import score_groups
from .validation import check_fits

# Cycles per chunk by the device the head runs on: a GPU's update is launch-bound at small chunks, so its chunk
# is larger, for more peak memory (what each chunk measured: docs/measurements.md#behind-the-codes-defaults).
CHUNK_CYCLES = {"cuda": 4096, "cpu": 1024}
DEFAULT_CHUNK_CYCLES = CHUNK_CYCLES["cpu"]  # where no device is named


def chunk_cycles_for(device: torch.device | str) -> int:
    """The default chunk on `device` (`CHUNK_CYCLES`; an accelerator it does not name counts as a GPU)."""
    return CHUNK_CYCLES.get(torch.device(device).type, CHUNK_CYCLES["cuda"])


@dataclass
class Piece:
    """Cycles [lo, hi) of sequence `seq`, reconstructed together in one chunk."""

    seq: int
    lo: int
    hi: int


@dataclass
class ChunkLayout:
    """Which cycles each chunk of a head update holds (`plan_chunks`), decided before any model work."""

    chunks: list[list[Piece]]
    chunk_cycles: int | None  # the most cycles a chunk holds (None: one chunk)


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
    their positions are never built. Rows are ordered by position, then cycle. Every position runs, and
    once no chain reaches a position, one padding slot (a cycle already past its length) runs it alone:
    under ZeRO-3 each head call gathers parameters, so data-parallel ranks must make the same calls. The
    padding slot lies past its cycle's length, where the loss reads nothing.
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

    # Position 1 feeds (H_s, x_{s+1}) at s, over the prefix p < s; position j feeds (h'_{j-1}, d_{j-1}).
    feed = torch.cat([prefix.hidden[pc.seq][records[pc.seq].start[pc.lo:pc.hi].to(device)] for pc in pieces])
    token = torch.cat([records[pc.seq].token_ids[records[pc.seq].start[pc.lo:pc.hi] + 1] for pc in pieces])
    token = token.to(device)
    path = DraftPathAttention([prefix.keys[pc.seq] for pc in pieces], seq_local, start,
                              head.config.num_attention_heads)
    cycles = torch.arange(num_cycles, device=device)  # the cycles still drafting at this position
    normed, slot_cycle = [], []
    for j in range(1, depth + 1):
        if j > 1:
            alive = lengths[cycles] >= j
            if not bool(alive.any()):
                alive[0] = True  # the padding slot
            cycles, feed = cycles[alive], feed[alive]
            token = drafts[cycles, j - 2]
        path.next_position(cycles)
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

    Full-vocabulary logits: for the invariant tests and small batches (training: `DraftPaths`)."""
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


class DraftPaths:
    """The head update's chunks of recorded cycles (`layout`), reconstructed as drafted.

    A sequence's prefix opens in its first chunk and closes after its last one (`prefix.PrefixStore`);
    where every rank runs one chunk (`one_chunk`, which the caller decides before building) the prefixes
    keep their graph into that chunk's backward instead. `work` is a chunk's module calls without model
    work; `chunk` builds its states; `backward` backpropagates its loss (and closes the prefixes whose last
    chunk it was).
    """

    def __init__(self, head: MTPHead, records: Sequence[SequenceRecord], hiddens: Sequence[torch.Tensor] | None,
                 layout: ChunkLayout, vgm: bool, one_chunk: bool = False):
        self.head, self.records, self.vgm = head, records, vgm
        self.chunks = layout.chunks
        depth = records[0].depth if records else 0
        # a prefix piece holds at most as many positions as a chunk has slots (one piece in a single chunk)
        piece_tokens = None if layout.chunk_cycles is None else layout.chunk_cycles * depth
        self.prefix = PrefixStore(head, records, hiddens, piece_tokens, graph=one_chunk)
        self.total = sum(rec.num_cycles for rec in records)
        self._first, self._last = {}, {}
        for i, pieces in enumerate(self.chunks):
            for pc in pieces:
                self._first.setdefault(pc.seq, i)
                self._last[pc.seq] = i

    def __len__(self) -> int:
        return len(self.chunks)

    def _opens(self, i: int) -> list[int]:
        return [pc.seq for pc in self.chunks[i] if self._first[pc.seq] == i]

    def _closes(self, i: int) -> list[int]:
        return [pc.seq for pc in self.chunks[i] if self._last[pc.seq] == i]

    def _lengths(self, i: int) -> torch.Tensor:
        pieces = self.chunks[i]
        accepted = _cat_cycles(self.records, pieces, "accepted") if self.vgm else None
        return chain_lengths(accepted, sum(pc.hi - pc.lo for pc in pieces), self.records[0].depth)

    def work(self, i: int) -> ChunkWork:
        slots = slots_per_chunk(self._lengths(i), self.records[0].depth)
        return ChunkWork(prefix_open=self.prefix.count_pieces(self._opens(i)),
                         prefix_close=self.prefix.count_pieces(self._closes(i), closing=True),
                         score_groups=score_groups(slots, self.head.scored_vocab_size,
                                                   next(self.head.parameters()).device.type))

    def chunk(self, i: int, work: ChunkWork, weight: float) -> Chunk:
        """Chunk i's states (opening the prefixes it is the first to read in `work.prefix_open` calls)."""
        pieces, device = self.chunks[i], self.prefix.device
        self.prefix.open(self._opens(i), work.prefix_open)
        states = reconstruct_states(self.head, self.records, pieces, self.prefix, self._lengths(i))
        return Chunk(states, _cat_cycles(self.records, pieces, "topk_ids").to(device),
                     _cat_cycles(self.records, pieces, "topk_logprobs").to(device),
                     _cat_cycles(self.records, pieces, "accepted").to(device), weight, self.vgm)

    def backward(self, i: int, work: ChunkWork, surrogate: torch.Tensor,
                 backward: Callable[[torch.Tensor], None]) -> None:
        self.prefix.chunk_backward(backward)(surrogate)
        self.prefix.close(self._closes(i), backward, work.prefix_close)


def check_batch(head: MTPHead, records: Sequence[SequenceRecord],
                hiddens: Sequence[torch.Tensor] | None = None) -> None:
    """Check that every record fits the head (`validation.check_fits`: one K, the head's vocabulary and
    width) before any model work; errors name the record and field. Records are validated in full once,
    where they are made (the engine boundary): this is not that validation again. The records stay on the
    host (a chunk's cycles go to the device when it is reconstructed): these checks launch no kernel."""
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
            raise RecordError(f"{rec.label(i)}: {err}") from None
