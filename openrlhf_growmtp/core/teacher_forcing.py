"""Teacher forcing (the paper's ablation of draft-path reconstruction): chains on the committed sequence.

Every committed position m starts a chain: draft position 1 reads (H_m, x_{m+1}) and position k the
position-(k-1) state, all over the committed tokens, whatever the head drafted. A chain's targets are
the recorded p of the cycles that verified its tokens with an accepted context
(`_teacher_forcing_targets`). A rank's sequences run side by side in chunks of whole sequences
(`TeacherForcedChains`), scored like reconstruction's slots (`head_loss.head_loss_backward`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .chunks import Chunk, ChunkWork, DraftStates
from .head import MTPHead
from .head_cache import HeadKVCache
from .prefix import hidden_of
from .records import SequenceRecord
from .topk_logq import score_groups


@dataclass
class TeacherForcedBatch:
    """Teacher-forced chains of one or more sequences: one chain per committed start m, draft positions 1..K."""

    starts: torch.Tensor  # [M] start position m of each chain (in its own sequence)
    normed: torch.Tensor  # [M, K, H] the head's state at each draft position
    temperature: torch.Tensor  # [M] the temperature of each chain's request
    topk_ids: torch.Tensor  # [M, K, k] recorded target at the token each draft position predicts
    topk_logprobs: torch.Tensor  # [M, K, k]
    lengths: torch.Tensor  # [M] consecutive draft positions (from 1) that have a recorded target

    def draft_states(self) -> DraftStates:
        """The positions that have a target (the rest carry no loss), as reconstruction's slots."""
        chain, position = torch.nonzero(torch.arange(self.normed.shape[1], device=self.lengths.device)[None, :]
                                        < self.lengths[:, None], as_tuple=True)
        return DraftStates(self.normed[chain, position], chain, position, self.temperature)


def _teacher_forcing_targets(rec: SequenceRecord):
    """(starts [M], token_index [M, K], lengths [M], target_ids [T, k], target_lp [T, k]) or None. No model work."""
    length, depth, width = int(rec.token_ids.shape[0]), rec.depth, int(rec.topk_ids.shape[2])
    target_ids = torch.zeros(length, width, dtype=torch.long)
    target_lp = torch.zeros(length, width, dtype=torch.float32)
    has_target = torch.zeros(length, dtype=torch.bool)
    for r in range(rec.num_cycles):
        s, a = int(rec.start[r]), int(rec.accepted[r])
        for kk in range(1, min(a + 1, depth) + 1):
            t = s + 1 + kk
            if t < length:
                target_ids[t], target_lp[t], has_target[t] = rec.topk_ids[r, kk - 1], rec.topk_logprobs[r, kk - 1], True
    starts = torch.arange(rec.prompt_len - 1, max(rec.prompt_len - 1, length - 2))
    offsets = torch.arange(1, depth + 1)
    token_index = starts[:, None] + 1 + offsets[None, :]  # [M, K] token each draft position predicts
    available = (token_index < length) & has_target[token_index.clamp(max=length - 1)]
    lengths = torch.cumprod(available.long(), dim=1).sum(1)  # consecutive draft positions from 1
    keep = lengths > 0
    if not bool(keep.any()):
        return None
    return starts[keep], token_index[keep], lengths[keep], target_ids, target_lp


def teacher_forced_chains(head: MTPHead, rec: SequenceRecord, hidden: torch.Tensor) -> TeacherForcedBatch | None:
    """Teacher forcing on one committed sequence (see `_teacher_forced_group`); None when no chain has a target."""
    targets = _teacher_forcing_targets(rec)
    return None if targets is None else _teacher_forced_group(head, [rec], [hidden], [targets])


def _teacher_forced_group(head: MTPHead, records: Sequence[SequenceRecord], hiddens: Sequence[torch.Tensor],
                          targets: Sequence[tuple]) -> TeacherForcedBatch:
    """Teacher forcing on the committed sequences, as the ablation of the paper's Appendix on it.

    K causal forwards over the committed tokens: draft position 1 reads (H_p, x_{p+1}); position k reads
    the position-(k-1) state of slot p-1 with x_{p+1} (slot 0 keeps H_0). The chain from start m at draft
    position k is the position-k state at slot m+k-1 and predicts token m+1+k. Its target is the recorded p of the
    cycle that verified that token with an accepted (= committed) context: row k' of cycle r covers token
    s_r+1+k' for k' <= accepted+1. The sequences run side by side, right-padded: under the causal mask
    a real slot never sees a pad, and the chains read real slots only. targets: `_teacher_forcing_targets`
    of each record, none of them None.
    """
    param = next(head.parameters())
    device, dtype = param.device, param.dtype
    depth = records[0].depth
    offsets = torch.arange(1, depth + 1)

    # ---- K causal forwards over every sequence's slots p = 0..T-2, (state, x_{p+1}) -----------------
    num_slots = [int(rec.token_ids.shape[0]) - 1 for rec in records]
    width = max(num_slots)
    ids = torch.zeros(len(records), width, dtype=torch.long, device=device)
    features = torch.zeros(len(records), width, head.config.hidden_size, device=device, dtype=dtype)
    for i, (rec, hidden, n) in enumerate(zip(records, hiddens, num_slots)):
        ids[i, :n] = rec.token_ids[1:].to(device)
        features[i, :n] = hidden[:n].to(device=device, dtype=dtype)
    first = features[:, :1]  # H_0 of every sequence
    positions = torch.arange(width, device=device).expand(len(records), width)
    normed = []
    for _ in range(depth):
        out = head(features, ids, positions, cache=HeadKVCache())
        normed.append(out.normed)  # [B, width, H]
        features = torch.cat([first, out.feed_back[:, :-1]], dim=1)
    normed = torch.stack(normed, dim=2)  # [B, width, K, H]

    # ---- each sequence's chains: position k of the chain from m is the position-k state of slot m+k-1 --
    chains = []
    for i, (rec, n, (starts, token_index, lengths, target_ids, target_lp)) in enumerate(
            zip(records, num_slots, targets)):
        slot = (starts[:, None] + offsets[None, :] - 1).clamp(max=n - 1).to(device)  # [M, K]
        tgt = token_index.clamp(max=n)
        chains.append((starts, normed[i, slot, torch.arange(depth, device=device)], target_ids[tgt],
                       target_lp[tgt], lengths, torch.full((starts.shape[0],), float(rec.temperature))))
    starts, states, ids_k, lp_k, lengths, temperature = (torch.cat(parts) for parts in zip(*chains))
    return TeacherForcedBatch(starts=starts, normed=states, temperature=temperature.to(device),
                              topk_ids=ids_k.to(device), topk_logprobs=lp_k.to(device), lengths=lengths.to(device))


def plan_teacher_forcing(targets: Sequence[tuple | None], chunk_cycles: int | None) -> list[list[int]]:
    """Chunks of whole sequences, in order, of at most chunk_cycles teacher-forced chains each (a longer
    sequence alone; None: one chunk), from each record's `_teacher_forcing_targets`. Sequences without a
    target are left out."""
    groups, current, count = [], [], 0
    for i, target in enumerate(targets):
        if target is None:
            continue
        chains = int(target[0].shape[0])
        if current and chunk_cycles is not None and count + chains > chunk_cycles:
            groups.append(current)
            current, count = [], 0
        current.append(i)
        count += chains
    return groups + [current] if current else groups


@dataclass
class TeacherForcingLayout:
    """The teacher-forcing ablation's chunks, decided before any model work: each record's targets
    (`_teacher_forcing_targets`, None where it has none) and the chunks of whole sequences over them."""

    targets: list[tuple | None]
    chunks: list[list[int]]


def teacher_forcing_layout(records: Sequence[SequenceRecord], chunk_cycles: int | None) -> TeacherForcingLayout:
    targets = [_teacher_forcing_targets(rec) for rec in records]
    return TeacherForcingLayout(targets, plan_teacher_forcing(targets, chunk_cycles))


class TeacherForcedChains:
    """The teacher-forcing ablation's chunks (`layout`), as `reconstruction.DraftPaths` offers draft paths to
    the head update: each chain counts as a cycle, its length set by the targets it has (no VGM), and no
    prefix to keep a graph of."""

    def __init__(self, head: MTPHead, records: Sequence[SequenceRecord], hiddens: Sequence[torch.Tensor] | None,
                 layout: TeacherForcingLayout):
        self.head, self.records, self.hiddens = head, records, hiddens
        self.targets, self.chunks = layout.targets, layout.chunks
        self.total = sum(int(t[0].shape[0]) for t in self.targets if t is not None)

    def __len__(self) -> int:
        return len(self.chunks)

    def work(self, i: int) -> ChunkWork:
        slots = sum(int(self.targets[seq][2].sum()) for seq in self.chunks[i])
        return ChunkWork(score_groups=score_groups(slots, self.head.scored_vocab_size,
                                                   next(self.head.parameters()).device.type))

    def chunk(self, i: int, work: ChunkWork, weight: float) -> Chunk:
        group = self.chunks[i]
        batch = _teacher_forced_group(self.head, [self.records[s] for s in group],
                                      [hidden_of(self.records, self.hiddens, s) for s in group],
                                      [self.targets[s] for s in group])
        return Chunk(batch.draft_states(), batch.topk_ids, batch.topk_logprobs, batch.lengths - 1, weight)

    def backward(self, i: int, work: ChunkWork, surrogate: torch.Tensor,
                 backward: Callable[[torch.Tensor], None]) -> None:
        backward(surrogate)
