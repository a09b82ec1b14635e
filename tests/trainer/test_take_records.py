"""The trainer's side of the records (`ppo_actor.take_records`): each sample's packed record out of its Experience
info, decoded and checked before any loss, every rank stopping at once for a bad one, which its request names."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers.ranks import TwoRanks
from helpers.tiny import make_records
from helpers.trainer import cpu_support  # noqa: F401  (the CPU layer before openrlhf is imported)

from openrlhf_growmtp.core.lockstep import ONE_RANK
from openrlhf_growmtp.core.records import RecordError
from openrlhf_growmtp.trainer.keys import RECORD_INDEX_KEY, RECORD_KEY, PackedRecord
from openrlhf_growmtp.trainer.ppo_actor import take_records


def samples(records, requests, spoil=None):
    """Experiences as the samples generator fills their info (`spoil(i, blob)`: what reaches the trainer)."""
    out = []
    for i, (rec, request) in enumerate(zip(records, requests)):
        blob = rec.pack()
        out.append(SimpleNamespace(info={RECORD_KEY: PackedRecord(spoil(i, blob) if spoil else blob,
                                                                  rec.accepted.tolist(), request=request)}))
    return out


def test_records_leave_the_info_decoded_and_indexed():
    records = make_records(k=3, topk=8, hidden_size=None)
    items = samples(records, ["a", "b", "c"])
    taken = take_records(items, ONE_RANK)
    for i, (item, rec, back) in enumerate(zip(items, records, taken)):
        assert item.info == {RECORD_INDEX_KEY: i}
        assert torch.equal(back.drafts, rec.drafts) and back.temperature == rec.temperature


def _negative_temperature(i, blob):
    if i != 1:
        return blob
    rec = make_records(k=3, topk=8, hidden_size=None)[1]
    rec.temperature = -1.0
    return rec.pack()


@pytest.mark.parametrize("spoil, says", [
    (lambda i, blob: blob[:len(blob) // 2] if i == 1 else blob, "request 'r1': its record's"),
    (_negative_temperature, "request 'r1': temperature: must be a finite number >= 0.01"),
])
def test_a_bad_record_on_one_rank_stops_both_naming_its_request(spoil, says):
    """Rank 1's second record is cut short (or says temperature -1): rank 1 names it, rank 0 stops with it at the
    same agreement (before, only the rank holding it raised, and the other waited at its next collective)."""
    records = make_records(k=3, topk=8, hidden_size=None)

    def rank(lockstep, items):
        try:
            return take_records(items, lockstep)
        except RecordError as err:
            return str(err)

    first, second = TwoRanks.run(rank, samples(records, ["r0", "r1", "r2"]),
                                 samples(records, ["r0", "r1", "r2"], spoil))
    assert isinstance(first, str) and "refused on another data-parallel rank" in first
    assert isinstance(second, str) and says in second and "before any loss" in second
