"""Weights into the engines with every rank told the outcome (`trainer/engine_sync.py`), on one gloo rank with
stand-in engine handles (Ray's `put`/`get` replaced by the identity and a call): an engine that fails, one
that loads other names than were sent, and a head that is not finite, each an `EngineSyncError` naming it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from openrlhf_growmtp.trainer import engine_sync
from openrlhf_growmtp.trainer.engine_sync import EngineSyncError, loaded_all, nonfinite_head, send_to_engines


class Engine:
    """An engine handle whose `growmtp_load_head.remote(blob)` answers `answer` (or raises it), and counts calls."""

    def __init__(self, answer):
        self.answer, self.calls = answer, 0
        self.growmtp_load_head = SimpleNamespace(remote=self._remote)

    def _remote(self, blob):
        self.calls += 1
        return self.answer


def resolve(ref):
    if isinstance(ref, BaseException):
        raise ref
    return ref


@pytest.fixture
def one_rank(single_rank, monkeypatch):
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    monkeypatch.setattr(engine_sync, "ray", SimpleNamespace(put=lambda blob: blob, get=resolve))


STATE = {"fc.weight": torch.ones(2, 2), "norm.weight": torch.ones(2)}
BOTH_RANKS = [sorted(STATE), sorted(STATE)]  # an engine of two tensor-parallel ranks, each loaded every name


def sync(engines, state=STATE):
    send_to_engines(engines, "growmtp_load_head", state, loaded_all(state), refuse=nonfinite_head)


def test_every_engine_that_took_the_head_lets_the_ranks_go_on(one_rank):
    engines = [Engine(BOTH_RANKS), Engine([sorted(STATE)])]
    sync(engines)
    assert [e.calls for e in engines] == [1, 1]


def test_an_engine_that_fails_is_named_and_every_other_engine_is_still_waited_for(one_rank):
    engines = [Engine(RuntimeError("out of memory\nwhile loading")), Engine(BOTH_RANKS)]
    with pytest.raises(EngineSyncError, match=r"failed on 1 of 2 engine\(s\).*engine 0: RuntimeError: out of memory$"):
        sync(engines)
    assert [e.calls for e in engines] == [1, 1]


def test_an_engine_rank_that_loaded_other_names_is_named(one_rank):
    engines = [Engine(BOTH_RANKS), Engine([sorted(STATE), ["fc.weight"]])]
    with pytest.raises(EngineSyncError, match=r"engine 1: rank\(s\) \[1\] did not load exactly the 2 head tensors"):
        sync(engines)


def test_a_head_with_a_nonfinite_value_is_never_sent(one_rank):
    engines = [Engine(BOTH_RANKS)]
    with pytest.raises(EngineSyncError, match=r"non-finite values in \['norm.weight'\]; not sent"):
        sync(engines, {**STATE, "norm.weight": torch.tensor([1.0, float("inf")])})
    assert engines[0].calls == 0


def test_a_rank_without_the_state_learns_the_outcome_from_rank_0(one_rank, monkeypatch):
    """The other ranks pass no state and raise what rank 0 broadcast (here rank 0's answer is stood in for)."""
    handed = []

    def broadcast(box, src):
        handed.append((list(box), src))
        box[0] = "GrowMTP: growmtp_load_head failed on 1 of 2 engine(s)"

    monkeypatch.setattr(engine_sync.dist, "broadcast_object_list", broadcast)
    engine = Engine(BOTH_RANKS)
    with pytest.raises(EngineSyncError, match="failed on 1 of 2"):
        send_to_engines([engine], "growmtp_load_head", None, loaded_all({}))
    assert engine.calls == 0 and handed == [([None], 0)]  # it sent nothing and only listened to rank 0
