"""The draft vocabulary: the token ids the head drafts over (`--growmtp_draft_vocab N`).

With a draft vocabulary of N ids, the head's q is its softmax over those ids alone and zero outside them:
q(d) = exp(z_d / T) / sum_{d' in S} exp(z_d' / T) for d in S, else 0. Rejection sampling stays exact with
any such q (a draft is accepted with min(1, p/q), a rejection resamples from max(p - q, 0), which covers
every token outside S); a subset only lowers α by the target's mass outside it. Drafting then needs only the
N rows of the lm_head: at Qwen3-4B's shapes the lm_head is most of a draft step's bytes.

The ids are ranked by how often they occur in the run's own committed tokens (`TokenCounts`): at first the
prompts', then every rollout's prompts and responses added. Ties go to the smaller id, so a ranking depends
on the counts alone. A `DraftVocab`'s `tag` names its ids; every record says which one drafted it.

Training reads the same q without the other ids: `DraftRows` holds the lm_head's N rows, sliced once per head
update (the policy steps the lm_head between updates, and under ZeRO-3 it is gathered to be sliced), and the
head's logits over the vocabulary are those rows' [..., N] alone (`topk_logq.py`). A recorded top-k id outside
the vocabulary has no position among them: log q = -inf there, as in the masked [..., V] logits.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Sequence

import torch
from torch import nn

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

    def positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[vocab_size] int64: each id's position among `ids`, -1 outside (made once per device)."""
        device = torch.device(device)
        cache = self.__dict__.setdefault("_positions", {})
        if device not in cache:
            ids = self.ids.to(device)
            cache[device] = torch.full((self.vocab_size,), -1, dtype=torch.int64, device=device).index_put_(
                (ids,), torch.arange(ids.numel(), device=device))
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


def no_gather(params: Sequence[nn.Parameter]) -> ContextManager:
    """Parameters that are whole already (a module alone, not partitioned): nothing to do."""
    return contextlib.nullcontext()


@dataclass(eq=False)
class DraftRows:
    """The lm_head's rows of a draft vocabulary: logits over its N ids alone, q's support."""

    vocab: DraftVocab
    weight: torch.Tensor  # [N, H], a copy: no gradient reaches the lm_head
    bias: torch.Tensor | None  # [N]

    @classmethod
    def slice(cls, lm_head: nn.Module, vocab: DraftVocab,
              gathered: Callable[[Sequence[nn.Parameter]], ContextManager] = no_gather) -> "DraftRows":
        """Copy `vocab`'s rows of the lm_head (a Linear over the vocabulary) as it is now. `gathered`: what
        makes partitioned parameters whole inside a `with` (ZeRO-3's gather, a collective every rank enters)."""
        weight, bias = getattr(lm_head, "weight", None), getattr(lm_head, "bias", None)
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"a draft vocabulary reads the lm_head's rows: {type(lm_head).__name__} has no weight")
        with gathered([p for p in (weight, bias) if p is not None]), torch.no_grad():
            if weight.shape[0] != vocab.vocab_size:
                raise ValueError(f"the lm_head has {weight.shape[0]} rows, the draft vocabulary's vocabulary "
                                 f"{vocab.vocab_size}")
            ids = vocab.ids.to(weight.device)
            return cls(vocab, weight.index_select(0, ids), None if bias is None else bias.index_select(0, ids))

    @property
    def size(self) -> int:
        return int(self.weight.shape[0])

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """lm_head(normed) at the vocabulary's ids: [..., N] from normed [..., H], in the rows' dtype."""
        return nn.functional.linear(normed, self.weight, self.bias)


class MaskedLMHead(nn.Module):
    """An lm_head over every id with -inf outside `vocab`: the logits the head scored before `DraftRows`, kept as
    the reference the tests and `benchmarks/bench_head_vocab.py` check the rows against (bind it to a head
    without a draft vocabulary)."""

    def __init__(self, lm_head: nn.Module, vocab: DraftVocab):
        super().__init__()
        self.lm_head, self.vocab = lm_head, vocab

    def forward(self, normed: torch.Tensor) -> torch.Tensor:
        return masked_logits(self.lm_head(normed), self.vocab)


def check_drafted_over(records, vocab: DraftVocab | None) -> None:
    """Raise unless every record with cycles was drafted over `vocab` (None: the whole vocabulary): the head
    loss reads q as the drafting head had it."""
    expected = None if vocab is None else vocab.tag
    for record in records:
        tag = record.meta.get(DRAFT_VOCAB_META)
        if record.num_cycles and tag != expected:
            raise ValueError(f"a record was drafted over draft vocabulary {tag or 'all ids'}, the head holds "
                             f"{expected or 'all ids'}: its q is not the head's")
