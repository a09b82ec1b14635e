"""Where a sample's GrowMTP data rides through upstream's response dicts and `Experience.info`: under one key, one
`PackedRecord` per sample (its record, packed, with what the controller reads of it without unpacking it).

Upstream splits every `info` list per sample and joins them per batch; its training step then turns each into a
tensor, so the records leave `info` before it (`ppo_actor.take_records`, one key) and each sample keeps, under
`RECORD_INDEX_KEY`, the index of its record among its RL step's records.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.records import SequenceRecord

RECORD_KEY = "growmtp_record"  # response: the sample's PackedRecord; Experience.info: [PackedRecord], one per sample
RECORD_INDEX_KEY = "growmtp_record_index"  # trainer side: the sample's record among its RL step's records
RECORD_SECONDS_KEY = "growmtp_record_s"  # response only: the rollout actor's seconds on its records, per response


@dataclass(frozen=True)
class PackedRecord:
    """A sample's record on its way from the rollout actor to the trainer, and its summary for the controller."""

    blob: bytes  # the SequenceRecord, packed; decoded and checked on the trainer's side (`take_records`)
    accepted: list[int]  # its per-cycle accepted counts (the controller's rollout metrics, the depth controller)
    request: str | None = None  # the id of the request it was captured for (names a record that does not decode)
    dropped: int = 0  # cycles vLLM verified that the record leaves out (not K samples of q)
    checked: bool = False  # its accepted counts were compared with vLLM's own, step by step

    @classmethod
    def of(cls, record: SequenceRecord, **summary) -> PackedRecord:
        """`record` packed, its accepted counts read off it; `summary`: request, dropped, checked."""
        return cls(record.pack(), record.accepted.tolist(), **summary)


def packed_records(experiences) -> list[PackedRecord]:
    """The records riding in these experiences' (or samples') `info`, in order."""
    return [record for experience in experiences for record in experience.info.get(RECORD_KEY, [])]


def accepted_counts(experiences) -> torch.Tensor:
    """[cycles] every record's accepted counts, record after record (empty without records)."""
    rows = [torch.tensor(record.accepted, dtype=torch.long) for record in packed_records(experiences)]
    return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
