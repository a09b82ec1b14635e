"""The draft vocabulary: the token ids the head drafts over (`--growmtp_draft_vocab N`).

With a draft vocabulary of N ids, the head's q is its softmax over those ids alone and zero outside them:
q(d) = exp(z_d / T) / sum_{d' in S} exp(z_d' / T) for d in S, else 0. Rejection sampling stays exact with
any such q (a draft is accepted with min(1, p/q), a rejection resamples from max(p - q, 0), which covers
every token outside S); a subset only lowers α by the target's mass outside it. Drafting then needs only the
N rows of the lm_head: at Qwen3-4B's shapes the lm_head is most of a draft step's bytes.

The ids are ranked by how often they occur in the run's own committed tokens (`TokenCounts`): at first the
prompts', then every rollout's prompts and responses added. Ties go to the smaller id, so a ranking depends
on the counts alone. A `DraftVocab`'s `tag` names its ids; every record says which one drafted it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

DRAFT_VOCAB_META = "draft_vocab"  # a record's meta key: the tag of the draft vocabulary that drafted it


@dataclass(eq=False)
class DraftVocab:
    """N token ids (int64, ascending) out of a vocabulary of `vocab_size`, and their tag."""

    ids: torch.Tensor  # [N] int64, ascending
    vocab_size: int

    def __post_init__(self):
        ids = self.ids
        if ids.ndim != 1 or ids.dtype != torch.int64 or ids.numel() == 0:
            raise ValueError(f"a draft vocabulary is a non-empty 1-d int64 tensor of ids, got {tuple(ids.shape)} "
                             f"{ids.dtype}")
        if bool((ids[1:] <= ids[:-1]).any()) or int(ids[0]) < 0 or int(ids[-1]) >= self.vocab_size:
            raise ValueError(f"draft vocabulary ids must be distinct, ascending and in [0, {self.vocab_size})")

    @property
    def size(self) -> int:
        return int(self.ids.numel())

    @property
    def tag(self) -> str:
        """A name for exactly these ids (what a record's meta carries)."""
        digest = hashlib.sha256(self.ids.cpu().numpy().tobytes() + str(self.vocab_size).encode()).hexdigest()
        return f"{self.size}-{digest[:16]}"

    def outside(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[vocab_size] bool, True for the ids q is zero at (made once per device)."""
        device = torch.device(device)
        cache = self.__dict__.setdefault("_outside", {})
        if device not in cache:
            mask = torch.ones(self.vocab_size, dtype=torch.bool, device=device)
            mask[self.ids.to(device)] = False
            cache[device] = mask
        return cache[device]

    def coverage(self, tokens: torch.Tensor) -> float:
        """The share of `tokens` (any shape of ids) inside this vocabulary (0 for no tokens)."""
        tokens = tokens.reshape(-1).long()
        if tokens.numel() == 0:
            return 0.0
        return float((~self.outside(tokens.device))[tokens].float().mean())


class TokenCounts:
    """How often each id occurred in the committed tokens seen so far."""

    def __init__(self, vocab_size: int):
        self.counts = torch.zeros(vocab_size, dtype=torch.int64)

    def add(self, tokens: torch.Tensor) -> None:
        tokens = tokens.reshape(-1).long().cpu()
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.counts.numel()):
            raise ValueError(f"token ids outside [0, {self.counts.numel()}) cannot be counted")
        self.counts += torch.bincount(tokens, minlength=self.counts.numel())

    def top(self, size: int) -> DraftVocab:
        """The `size` most frequent ids (ties: the smaller id first)."""
        vocab_size = self.counts.numel()
        if not 1 <= size <= vocab_size:
            raise ValueError(f"a draft vocabulary of {size} ids does not fit a vocabulary of {vocab_size}")
        # a stable descending sort keeps equal counts in id order
        order = torch.sort(self.counts, descending=True, stable=True).indices[:size]
        return DraftVocab(torch.sort(order).values, vocab_size)


def masked_logits(logits: torch.Tensor, vocab: DraftVocab | None) -> torch.Tensor:
    """[..., V] logits with -inf outside `vocab` (unchanged for None). masked_fill sends no gradient to the
    filled entries: q is exactly zero there."""
    if vocab is None:
        return logits
    return logits.masked_fill(vocab.outside(logits.device), float("-inf"))


def check_drafted_over(records, vocab: DraftVocab | None) -> None:
    """Raise unless every record with cycles was drafted over `vocab` (None: the whole vocabulary): the head
    loss reads q as the drafting head had it."""
    expected = None if vocab is None else vocab.tag
    for record in records:
        tag = record.meta.get(DRAFT_VOCAB_META)
        if record.num_cycles and tag != expected:
            raise ValueError(f"a record was drafted over draft vocabulary {tag or 'all ids'}, the head holds "
                             f"{expected or 'all ids'}: its q is not the head's")
