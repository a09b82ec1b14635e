"""Verification records: round trip, size, and a precise error for every malformed field."""

import math

import pytest
import torch

from openrlhf_growmtp.core import RecordError, SequenceRecord
from openrlhf_growmtp.core.validation import decode_record, validate_record, validate_records
from helpers.tiny import HIDDEN, VOCAB, synthetic_record


def _valid(**kw):
    return synthetic_record(**{"prompt_len": 5, "accepted": [2, 0, 3, 1], "depth": 3, "topk": 4,
                               "vocab_size": VOCAB, "hidden_size": HIDDEN, **kw})


def test_dummy_record_is_valid_and_its_committed_tokens_follow_the_cycles():
    rec = _valid()
    validate_record(rec, depth=3, vocab_size=VOCAB, hidden_size=HIDDEN, topk=4)
    # each cycle commits accepted + 1 tokens, so starts advance by exactly that
    assert (rec.start[1:] - rec.start[:-1]).tolist() == (rec.accepted[:-1] + 1).tolist()
    assert rec.start[0].item() == rec.prompt_len - 1


def test_record_roundtrip():
    rec = _valid()
    rec.meta = {"request_id": "7", "n": 1}
    rec.temperature = 0.7
    back = SequenceRecord.unpack(rec.pack())
    for name in ("token_ids", "start", "drafts", "topk_ids", "accepted"):
        assert torch.equal(getattr(back, name), getattr(rec, name)), name
    assert torch.equal(back.topk_logprobs, rec.topk_logprobs.to(torch.bfloat16))
    assert torch.equal(back.hidden, rec.hidden.to(torch.bfloat16))
    assert (back.prompt_len, back.temperature, back.meta) == (rec.prompt_len, 0.7, rec.meta)
    validate_record(back, depth=3, vocab_size=VOCAB, hidden_size=HIDDEN)


def test_packed_bytes_per_generated_token_are_dominated_by_the_hidden_states():
    rec = _valid()
    full = len(rec.pack()) / rec.num_generated
    # bf16 hidden: 2 * H bytes per committed token (prompt included), spread over generated tokens
    assert full > 2 * HIDDEN * rec.token_ids.numel() / rec.num_generated
    rec.hidden = None  # transport-free mode
    assert len(rec.pack()) / rec.num_generated < full / 3


def test_unpack_refuses_another_schema_version():
    blob = bytearray(_valid().pack())
    marker = b'"schema_version":"1"'
    at = bytes(blob).index(marker)
    blob[at:at + len(marker)] = b'"schema_version":"9"'
    with pytest.raises(RecordError, match="schema_version"):
        SequenceRecord.unpack(bytes(blob))


def _set(name, fn):
    def apply(rec):
        setattr(rec, name, fn(getattr(rec, name)))
    return apply


def _assign(name, index, value):
    def apply(rec):
        getattr(rec, name)[index] = value
    return apply


def _cut_tokens(length):
    def apply(rec):
        rec.token_ids, rec.hidden = rec.token_ids[:length], rec.hidden[:length]
    return apply


def _repeat_topk_id(rec):
    rec.topk_ids[2, 0, 1] = rec.topk_ids[2, 0, 0]


def _break_accepted_draft(rec):
    assert rec.accepted[2] == 3  # draft 2 of cycle 2 was accepted, so it is committed
    rec.drafts[2, 1] = (rec.drafts[2, 1] + 1) % VOCAB


MALFORMED = [
    ("wrong K", _set("drafts", lambda d: d[:, :2]), "drafts", dict(depth=3)),
    ("K expected differs", lambda rec: None, "drafts", dict(depth=5)),
    ("start count", _set("start", lambda s: s[:-1]), "start", {}),
    ("accepted count", _set("accepted", lambda a: a[:-1]), "accepted", {}),
    ("topk shape", _set("topk_logprobs", lambda t: t[..., :3]), "topk_logprobs", {}),
    ("topk width", lambda rec: None, "topk_ids", dict(topk=64)),
    ("float token ids", _set("token_ids", lambda t: t.float()), "token_ids", {}),
    ("int log-probs", _set("topk_logprobs", lambda t: t.long()), "topk_logprobs", {}),
    ("2-d token ids", _set("token_ids", lambda t: t[None]), "token_ids", {}),
    ("draft id out of vocab", _assign("drafts", (1, 2), VOCAB), "drafts", dict(vocab_size=VOCAB)),
    ("negative token id", _assign("token_ids", 0, -1), "token_ids", dict(vocab_size=VOCAB)),
    ("top-k id out of vocab", _assign("topk_ids", (0, 0, 0), VOCAB + 3), "topk_ids", dict(vocab_size=VOCAB)),
    ("accepted > K", _assign("accepted", 3, 4), "accepted", {}),
    ("accepted < 0", _assign("accepted", 3, -1), "accepted", {}),
    ("non-monotone starts", _assign("start", 2, 5), "start", {}),
    ("start before the prompt end", _assign("start", 0, 1), "start", {}),
    ("start past the sequence", _cut_tokens(8), "start", {}),
    ("non-finite log-prob", _assign("topk_logprobs", (1, 1, 1), float("nan")), "topk_logprobs", {}),
    ("infinite log-prob", _assign("topk_logprobs", (1, 1, 1), float("-inf")), "topk_logprobs", {}),
    ("positive log-prob", _assign("topk_logprobs", (0, 2, 0), 0.5), "topk_logprobs", {}),
    ("top-k mass above one", _set("topk_logprobs", lambda t: t * 0 - 0.1), "topk_logprobs", {}),
    ("repeated top-k id", _repeat_topk_id, "topk_ids", {}),
    ("committed token disagrees with an accepted draft", _break_accepted_draft, "drafts", {}),
    ("hidden rows", _set("hidden", lambda h: h[:-1]), "hidden", {}),
    ("hidden width", lambda rec: None, "hidden", dict(hidden_size=HIDDEN + 1)),
    ("non-finite hidden", _assign("hidden", (3, 3), float("inf")), "hidden", {}),
    ("integer hidden", _set("hidden", lambda h: h.long()), "hidden", {}),
    ("prompt_len zero", _set("prompt_len", lambda p: 0), "prompt_len", {}),
    ("greedy temperature", _set("temperature", lambda t: 0.0), "temperature", {}),
    # an infinite temperature makes q uniform and 1e-30 its logits infinite: the head's gradient 0 either way
    ("infinite temperature", _set("temperature", lambda t: float("inf")), "temperature", {}),
    ("temperature below vLLM's lowest", _set("temperature", lambda t: 1e-30), "temperature", {}),
    ("NaN temperature", _set("temperature", lambda t: float("nan")), "temperature", {}),
    ("negative temperature", _set("temperature", lambda t: -1.0), "temperature", {}),
]


@pytest.mark.parametrize("case, mutate, field_name, kwargs", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_record_raises_naming_the_field_alone_and_among_others(case, mutate, field_name, kwargs):
    bad = _valid()
    mutate(bad)
    with pytest.raises(RecordError) as alone:
        validate_record(bad, **kwargs)
    assert str(alone.value).startswith(f"{field_name}:"), str(alone.value)
    # validated side by side with valid records, the error names it and is the one it raises alone
    shape = {name: value for name, value in kwargs.items() if name in ("depth", "topk", "hidden_size")}
    others = [_valid(seed=s, accepted=[3, 1, 0], **shape) for s in (1, 2)]  # fine under the case's kwargs
    for fine in others:
        validate_record(fine, **kwargs)
    with pytest.raises(RecordError) as batched:
        validate_records([others[0], bad, others[1]], names=["a", "b", "c"], **kwargs)
    assert str(batched.value) == f"b: {alone.value}"


def _cut_short(seed: int, prompt_len: int = 4) -> SequenceRecord:
    """A record whose last cycle EOS cut short: it accepted 3 drafts, only the first was committed."""
    rec = synthetic_record(prompt_len=prompt_len, accepted=[1, 3], depth=3, topk=4, vocab_size=VOCAB,
                           hidden_size=None, trailing_tokens=0, seed=seed)
    rec.token_ids = rec.token_ids[:int(rec.start[-1]) + 3]
    return rec


def _without_cycles(rec: SequenceRecord) -> SequenceRecord:
    for name in ("start", "accepted", "drafts", "topk_ids", "topk_logprobs"):
        setattr(rec, name, getattr(rec, name)[:0])
    return rec


def test_records_side_by_side_read_no_token_of_the_next_record():
    # The side-by-side checks themselves (record_values.check_values over Cycles.of) must pass valid records:
    # a false alarm would only send validate_records to the one-at-a-time path, so test them directly.
    from openrlhf_growmtp.core.record_values import Cycles, check_values

    first, second = _cut_short(0), _cut_short(1, prompt_len=1)
    # side by side, the first record's uncommitted drafts sit on the second record's first tokens
    first.drafts[-1, 1:] = (second.token_ids[:2] + 1) % VOCAB
    # a record without cycles between them (finished at prefill), with a long prompt
    empty = _without_cycles(_valid(prompt_len=9, hidden_size=None))
    for rec in (first, empty, second):
        validate_record(rec, vocab_size=VOCAB)
    # the second record's first cycle starts (at 0) before the first's cut-short cycle would end, and
    # before the empty record's prompt ends
    assert int(second.start[0]) == 0
    check_values(Cycles.of([first, second]), VOCAB)
    check_values(Cycles.of([first, empty, second]), VOCAB)
    validate_records([first, empty, second], vocab_size=VOCAB)


def test_records_of_different_layouts_are_validated_one_at_a_time():
    fp32, bf16 = _valid(seed=1), _valid(seed=2)
    bf16.topk_logprobs = bf16.topk_logprobs.bfloat16()
    validate_records([fp32, bf16, _valid(seed=3, depth=4)])
    validate_records([_without_cycles(_valid(seed=4)), _without_cycles(_valid(seed=5, depth=4))])
    validate_records([])
    bf16.topk_logprobs[0, 0, 0] = float("nan")
    with pytest.raises(RecordError, match="^record 1: topk_logprobs: non-finite"):
        validate_records([fp32, bf16])


def test_cycle_cut_short_by_the_end_of_the_sequence_is_valid():
    # EOS inside a cycle: accepted drafts past the last committed token were never committed
    rec = synthetic_record(prompt_len=4, accepted=[1, 3], depth=3, topk=4, vocab_size=VOCAB, hidden_size=None,
                           trailing_tokens=0)
    s = int(rec.start[-1])
    rec.token_ids = rec.token_ids[:s + 3]  # keeps x_{s+1} and the first accepted draft only
    validate_record(rec, vocab_size=VOCAB)
    rec.drafts[-1, 0] = (rec.drafts[-1, 0] + 1) % VOCAB  # but the committed part is still checked
    with pytest.raises(RecordError, match="^drafts:"):
        validate_record(rec)


def _row_of(log_probs: list[float], width: int) -> torch.Tensor:
    """A [width] fp64 row: the given log-probs, then entries at -60 (p ~ 1e-26) up to the width."""
    return torch.tensor(log_probs + [-60.0] * (width - len(log_probs)), dtype=torch.float64)


def test_bf16_rounding_of_a_normalised_row_is_accepted_and_real_excess_mass_is_not():
    # 59 entries of p = 1/59: log p = -4.07754 sits just below the midpoint of the bf16 grid at [4, 8)
    # (step 1/32), so bf16 stores -4.0625 and the stored mass is 1.0152: log mass 0.0150, over the old
    # fixed 1e-2 but within bf16's bound for 64 entries, 2^-8 ln 64 = 0.0163.
    rec = _valid(topk=64)
    normalised = _row_of([-math.log(59) - 1e-9] * 59, 64)
    assert torch.logsumexp(normalised, 0) <= 0  # the true row is normalised
    rec.topk_logprobs = normalised.expand_as(rec.topk_logprobs).to(torch.bfloat16)
    stored = float(torch.logsumexp(rec.topk_logprobs[0, 0].double(), 0))
    assert 1e-2 < stored < 2.0**-8 * math.log(64)
    validate_record(rec, topk=64)
    # the same entries 0.05 above a normalised row: mass 1.05, more than any rounding explains
    rec.topk_logprobs = (normalised + 0.05).expand_as(rec.topk_logprobs).to(torch.bfloat16)
    with pytest.raises(RecordError, match="^topk_logprobs: .*rounding"):
        validate_record(rec, topk=64)
    # fp32 storage leaves no such room: 0.001 above normalised is refused
    rec.topk_logprobs = (normalised + 1e-3).expand_as(rec.topk_logprobs).float()
    with pytest.raises(RecordError, match="^topk_logprobs:"):
        validate_record(rec, topk=64)


def test_log_probs_stored_in_another_dtype_are_refused():
    rec = _valid()
    rec.topk_logprobs = rec.topk_logprobs.double()
    with pytest.raises(RecordError, match="^topk_logprobs: expected a"):
        validate_record(rec)


def _garbage(blob):
    return bytes((b * 7 + 3) % 256 for b in blob[:200])


def _missing_header_field(blob):
    return blob.replace(b'"prompt_len"', b'"prompt_lex"')  # as long: the header still reads


def _not_utf8(blob):
    header = b'{"\xc3(":1}'
    return len(header).to_bytes(8, "little") + header


@pytest.mark.parametrize("case, spoil", [
    ("cut short", lambda blob: blob[:len(blob) // 2]),
    ("cut inside its header", lambda blob: blob[:40]),
    ("empty", lambda blob: b""),
    ("garbage", _garbage),
    ("a header field missing", _missing_header_field),
    ("a header that is not UTF-8", _not_utf8),
])
def test_a_blob_that_does_not_decode_raises_a_record_error_naming_its_request(case, spoil):
    """Before, these raised safetensors' SafetensorError, JSONDecodeError, UnicodeDecodeError or KeyError, naming
    no sample."""
    with pytest.raises(RecordError) as err:
        SequenceRecord.unpack(spoil(_valid().pack()), "request 'r-17'")
    assert str(err.value).startswith("request 'r-17': ") and "do not decode" in str(err.value)


@pytest.mark.parametrize("case, mutate, field_name", [
    ("temperature -1", _set("temperature", lambda t: -1.0), "temperature"),
    ("infinite temperature", _set("temperature", lambda t: float("inf")), "temperature"),
    ("temperature 1e-30", _set("temperature", lambda t: 1e-30), "temperature"),
    ("a positive top-k log-prob", _assign("topk_logprobs", (0, 2, 0), 0.5), "topk_logprobs"),
    ("a non-finite log-prob", _assign("topk_logprobs", (1, 0, 0), float("-inf")), "topk_logprobs"),
    ("a cycle count the starts disagree with", _set("start", lambda s: s[:-1]), "start"),
    ("a cycle count accepted disagrees with", _set("accepted", lambda a: a[:-1]), "accepted"),
    ("top-k ids of another shape", _set("topk_ids", lambda t: t[:, :2]), "topk_ids"),
])
def test_the_trainer_refuses_a_decoded_record_naming_its_request_and_field(case, mutate, field_name):
    """What the trainer decodes is checked before any loss (`decode_record`): before, a header with temperature
    -1 or log-probs above 0 trained on garbage, inf or 1e-30 gave a zero gradient silently, and a cycle count
    that disagreed with the arrays stopped in an AssertionError of read_topk_mass."""
    rec = _valid()
    assert decode_record(rec.pack(), "request 'r-3'").num_cycles == rec.num_cycles
    mutate(rec)
    with pytest.raises(RecordError) as err:
        decode_record(rec.pack(), "request 'r-3'")
    assert str(err.value).startswith(f"request 'r-3': {field_name}:"), str(err.value)
