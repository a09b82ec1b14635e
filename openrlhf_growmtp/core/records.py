"""Verification records: the contract between the drafting engine and the trainer.

The words (cycle, draft position k, draft path, record, top-k, τ, ...) are the README's glossary
(README.md, "Glossary"). What this module adds is their symbols and the record's fields:

- a cycle starts at position s, the last committed position whose target hidden state H_s is known;
  x_{s+1} is the token the previous verification emitted. Its *drafts* d_1..d_K (`drafts`) are proposed for
  positions s+2..s+K+1; d_k was sampled from q_k, the head's distribution at draft position k, whose draft
  path is the committed context and d_1..d_{k-1};
- the verification is one target forward over [x_{s+1}, d_1..d_K]: p_k is the target's distribution for
  the token at s+1+k given d_1..d_{k-1}. Rejection sampling accepts d_k with probability min(1, p_k/q_k);
- `accepted` a: the drafts d_1..d_a that passed before the first rejection, 0..K (the first rejected
  position is j = a + 1, or j = K + 1 when all passed);
- on a rejection at j the *recovered token* is sampled from norm(max(p_j - q_j, 0)) instead of d_j; when
  all K pass, the *bonus token* is sampled from the target at position s+K+2. Either way a cycle commits
  a + 1 tokens, so the next cycle starts at s + a + 1 (or later, if engine steps without drafts happened
  in between);
- per sequence the record holds the committed token ids (and optionally the target hidden states the
  head consumed), and per cycle: start, drafts, the target's top-k log-probs at each draft position
  (normalised over the full vocabulary, temperature applied as in verification) and `accepted`.

τ = 1 + mean(accepted) counts the recovered or bonus token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

SCHEMA_VERSION = 1
DEFAULT_TOPK = 64
REQUEST_ID_META = "request_id"  # meta key: the id of the request the record was captured for (the collector's)
# What a record's bytes may fail to decode with: a safetensors layout, the JSON header, its text, a missing
# field or tensor, a field that is not a number, a header that is not a JSON object.
DECODE_ERRORS = (SafetensorError, json.JSONDecodeError, UnicodeDecodeError, KeyError, ValueError, TypeError,
                 AttributeError)


class RecordError(ValueError):
    """A malformed verification record. The message names the offending field."""


@dataclass
class SequenceRecord:
    """The verification record of one generated sequence (prompt + response).

    T = committed length (prompt included), R = cycles, K = drafting depth, k = recorded top-k width.
    """

    token_ids: torch.Tensor  # [T] int, committed tokens x_0..x_{T-1}, prompt included
    prompt_len: int  # number of prompt tokens at the front of token_ids
    start: torch.Tensor  # [R] int, absolute position s of each cycle (strictly increasing)
    drafts: torch.Tensor  # [R, K] int, the drafts d_1..d_K of each cycle
    topk_ids: torch.Tensor  # [R, K, k] int, token ids of the target's top-k at each draft position
    topk_logprobs: torch.Tensor  # [R, K, k] float (bf16 on the wire), full-vocab log p at those ids
    accepted: torch.Tensor  # [R] int in 0..K, accepted drafts per cycle
    hidden: torch.Tensor | None = None  # [T, H] target final-norm hidden states, or None (trainer recomputes)
    temperature: float = 1.0  # the request's sampling temperature (q and p both use it)
    meta: dict = field(default_factory=dict)  # free-form (request id, ...); travels with the record

    @property
    def num_cycles(self) -> int:
        return int(self.start.shape[0])

    @property
    def depth(self) -> int:
        """K, the drafting depth (drafts per cycle); `k` stays reserved for the top-k width."""
        return int(self.drafts.shape[1])

    @property
    def num_generated(self) -> int:
        return int(self.token_ids.shape[0]) - self.prompt_len

    # ---- transport ----------------------------------------------------------------------------
    def pack(self) -> bytes:
        """Compact bytes (safetensors, no pickle): int32 ids, uint8 accepted, bf16 log-probs and hidden."""
        tensors = {
            "token_ids": self.token_ids.to(torch.int32),
            "start": self.start.to(torch.int32),
            "drafts": self.drafts.to(torch.int32),
            "topk_ids": self.topk_ids.to(torch.int32),
            "topk_logprobs": self.topk_logprobs.to(torch.bfloat16),
            "accepted": self.accepted.to(torch.uint8),
        }
        if self.hidden is not None:
            tensors["hidden"] = self.hidden.to(torch.bfloat16)
        header = {"schema_version": str(SCHEMA_VERSION), "prompt_len": str(self.prompt_len),
                  "temperature": repr(float(self.temperature)), "meta": json.dumps(self.meta)}
        return st_save({name: t.detach().cpu().contiguous() for name, t in tensors.items()}, metadata=header)

    @classmethod
    def unpack(cls, blob: bytes, name: str | None = None) -> "SequenceRecord":
        """The record packed in `blob`. Bytes that do not decode (cut short, empty, garbage, a field missing)
        raise a RecordError naming `name` (the sample's request, where the caller knows it) and the cause."""
        try:
            header = _read_safetensors_metadata(blob)
            version = int(header.get("schema_version", -1))
            if version != SCHEMA_VERSION:
                raise RecordError(f"schema_version: record has {version}, this code reads {SCHEMA_VERSION}")
            t = st_load(blob)
            return cls(token_ids=t["token_ids"].long(), prompt_len=int(header["prompt_len"]),
                       start=t["start"].long(), drafts=t["drafts"].long(), topk_ids=t["topk_ids"].long(),
                       topk_logprobs=t["topk_logprobs"], accepted=t["accepted"].long(), hidden=t.get("hidden"),
                       temperature=float(header["temperature"]), meta=json.loads(header["meta"]))
        except RecordError as err:
            raise RecordError(f"{name}: {err}" if name else str(err)) from None
        except DECODE_ERRORS as err:
            what = f"{name}: its" if name else "a"
            raise RecordError(f"{what} record's {len(blob)} bytes do not decode ({type(err).__name__}: {err}): cut "
                              "short, empty or not a packed record") from None

    def label(self, index: int) -> str:
        """How errors name this record: its request (the collector's id), or `record <index>` without one."""
        request = self.meta.get(REQUEST_ID_META) if isinstance(self.meta, dict) else None
        return f"request {request!r}" if request is not None else f"record {index}"

    @property
    def nbytes(self) -> int:
        """Bytes of the record's tensors (the packed record adds a small header)."""
        tensors = (self.token_ids, self.start, self.drafts, self.topk_ids, self.topk_logprobs, self.accepted,
                   self.hidden)
        return sum(t.nbytes for t in tensors if t is not None)


def _read_safetensors_metadata(blob: bytes) -> dict:
    header_len = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8:8 + header_len]).get("__metadata__", {})

