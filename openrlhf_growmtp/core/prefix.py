"""The committed prefixes of a batch's sequences for draft-path reconstruction: keys and values computed
once per sequence, and backpropagated once.

Every chunk of cycles reads its sequences' prefix keys and values ([kv, L, d], the head's entries
(H_p, x_{p+1}) at p < L, L the sequence's last start). `open` computes them without a graph, as fp32
leaves; every chunk's backward accumulates into their .grad; after a sequence's last chunk, `close`
recomputes them with a graph and backpropagates the surrogate sum(K * dK) + sum(V * dV), whose
gradients are the ones the chunks' graphs would have given. So no chunk holds a graph of the prefix:
what a chunk keeps for backward does not grow with the response (the prefix's keys and values
themselves are resident, like the hidden states they are made of, 2 x kv x d values per token).

In joint mode the hidden states carry the backbone's graph: chunks then read a detached leaf, and
`close` adds sum(H * dH), so the backbone is reached by the closing backward. Its sequences share one
backbone graph, so joint mode runs them in one chunk and one piece (`piece_tokens=None`).

`backward` (the trainer's) may scale what it backpropagates (DeepSpeed divides by the gradient
accumulation steps): the leaves' gradients carry that factor, and the closing backward would apply it
twice. `chunk_backward` adds a zero-valued probe to each chunk's surrogate; its gradient is the factor,
and `close` divides by it.

When every sequence lies in one chunk (`graph=True`: the caller knows it holds on every rank) none of
this is needed: `open` computes the keys and values with their graph, the chunk's own backward reaches
the prefix (and, in joint mode, the backbone), and `close` does nothing. That saves a prefix pass and a
backward per call, which is most of the cost for small heads.

Head calls: `open` and `close` run their positions in pieces, one call each; the caller says how many
(`count_pieces` is this rank's need; the ranks' lockstep pads it to the busiest rank's), and a piece
without positions is one token of padding, so that data-parallel ranks stay in step under ZeRO-3.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch

from .head import MTPHead
from .records import RecordError, SequenceRecord


def hidden_of(records: Sequence[SequenceRecord], hiddens: Sequence[torch.Tensor] | None, seq: int) -> torch.Tensor:
    """H_p [T, H] of record `seq`: the trainer's (transport-free mode) or the record's own (exact mode)."""
    if hiddens is not None:
        return hiddens[seq]
    if records[seq].hidden is None:
        raise RecordError(f"hidden: record {seq} carries no hidden states (transport-free mode) and the "
                          "trainer passed none; recompute them with the policy forward")
    return records[seq].hidden


Span = tuple[int, int, int]  # (sequence, lo, hi): prefix positions [lo, hi) of a sequence


class PrefixStore:
    """Prefix keys and values of the sequences a reconstruction has open (module docstring): leaves whose
    gradients the chunks accumulate, or with `graph` the keys and values with their graph.

    `open` and `close` run their positions in pieces of at most `piece_tokens` (None: one piece), one
    head call each, so that neither holds more than a piece's activations; `pieces` (at least
    `count_pieces`) is how many calls to make, the rest one token of padding each.
    """

    def __init__(self, head: MTPHead, records: Sequence[SequenceRecord],
                 hiddens: Sequence[torch.Tensor] | None = None, piece_tokens: int | None = None,
                 graph: bool = False):
        param = next(head.parameters())
        self.head, self.records, self.hiddens = head, records, hiddens
        self.device, self.dtype = param.device, param.dtype
        self.piece_tokens, self.graph = piece_tokens, graph
        self.keys: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # seq -> fp32 (K, V) [kv, L, d]
        self.hidden: dict[int, torch.Tensor] = {}  # seq -> H_p [T, H] as the chunks read it
        self._source: dict[int, torch.Tensor] = {}  # seq -> H_p with its graph (joint mode)
        self.factor: torch.Tensor | None = None  # the last chunk's backward factor (None: no graph)

    def count_pieces(self, seqs: Sequence[int], closing: bool = False) -> int:
        """Head calls that `open` (or, `closing`, `close`) needs for these sequences (no model work)."""
        return 0 if closing and self.graph else len(self._pieces(seqs, 0))

    def _pieces(self, seqs: Sequence[int], count: int) -> list[list[Span]]:
        """The sequences' prefixes (positions p < their last start) cut into pieces, then empty pieces
        (padding) up to `count`."""
        pieces: list[list[Span]] = [[]]
        room = self.piece_tokens
        for i in seqs:
            lo, length = 0, max(1, int(self.records[i].start[-1]))  # keys p < s for every start s
            while lo < length:
                if room == 0:
                    pieces.append([])
                    room = self.piece_tokens
                hi = length if room is None else min(length, lo + room)
                pieces[-1].append((i, lo, hi))
                room = None if room is None else room - (hi - lo)
                lo = hi
        return pieces + [[] for _ in range(count - len(pieces))]

    def _keys_values(self, piece: Sequence[Span]) -> tuple[torch.Tensor, torch.Tensor]:
        """One head call over a piece's positions side by side: (K, V) [kv, T, d] (padding if empty)."""
        hidden = [self._source[i][lo:hi] for i, lo, hi in piece]
        ids = [self.records[i].token_ids[lo + 1:hi + 1].to(self.device) for i, lo, hi in piece]
        positions = [torch.arange(lo, hi, device=self.device) for _, lo, hi in piece]
        if not piece:  # padding
            hidden = [torch.zeros(1, self.head.config.hidden_size, device=self.device, dtype=self.dtype)]
            ids = positions = [torch.zeros(1, dtype=torch.long, device=self.device)]
        key, value = self.head.keys_values(torch.cat(hidden)[None], torch.cat(ids)[None], torch.cat(positions)[None])
        return key[0], value[0]

    def open(self, seqs: Sequence[int], pieces: int = 0) -> None:
        """Compute these sequences' prefix keys and values (without a graph unless `graph`) in `pieces` head
        calls (at least `count_pieces(seqs)`)."""
        for i in seqs:
            source = hidden_of(self.records, self.hiddens, i).to(device=self.device, dtype=self.dtype)
            self._source[i] = source
            leaf = source.requires_grad and not self.graph
            self.hidden[i] = source.detach().requires_grad_() if leaf else source
        parts: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {i: [] for i in seqs}
        with contextlib.nullcontext() if self.graph else torch.no_grad():
            for piece in self._pieces(seqs, pieces):
                key, value = self._keys_values(piece)
                offset = 0
                for i, lo, hi in piece:
                    parts[i].append((key[:, offset:offset + hi - lo], value[:, offset:offset + hi - lo]))
                    offset += hi - lo
        leaves = torch.is_grad_enabled() and not self.graph
        for i, pairs in parts.items():
            pair = tuple(torch.cat(ts, dim=1).float() for ts in zip(*pairs))
            self.keys[i] = tuple(t.requires_grad_() for t in pair) if leaves else pair

    def chunk_backward(self, backward: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
        """`backward` for a chunk's surrogate, recording the factor it applies (module docstring)."""

        if self.graph:
            return backward

        def run(loss: torch.Tensor) -> None:
            probe = torch.zeros((), device=loss.device, requires_grad=loss.requires_grad)
            backward(loss + probe)
            self.factor = probe.grad

        return run

    def close(self, seqs: Sequence[int], backward: Callable[[torch.Tensor], None], pieces: int = 0) -> None:
        """After these sequences' last chunk: backpropagate their prefixes once in `pieces` head calls (at
        least `count_pieces(seqs, closing=True)`; none if `graph`: their chunk's backward did), then forget
        them."""
        factor = self.factor
        for piece in [] if self.graph else self._pieces(seqs, pieces):
            key, value = self._keys_values(piece)
            surrogate = (key.float().sum() + value.float().sum()) * 0.0  # padding's, and the others' base
            offset = 0
            for i, lo, hi in piece:
                for full, leaf in zip((key, value), self.keys[i]):
                    if leaf.grad is not None:
                        surrogate = surrogate + (full[:, offset:offset + hi - lo].float() * leaf.grad[:, lo:hi]).sum()
                offset += hi - lo
                hidden, source = self.hidden[i], self._source[i]
                if lo == 0 and hidden is not source and hidden.grad is not None:
                    surrogate = surrogate + (source.float() * hidden.grad.float()).sum()
            if factor is not None and float(factor) != 0.0:
                surrogate = surrogate / factor
            backward(surrogate)
        for i in seqs:
            del self.keys[i], self.hidden[i], self._source[i]
