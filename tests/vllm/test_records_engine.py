"""Records from the real engine against the engine's outputs, its counters, HF and the core's reconstruction."""

import pytest
import torch
from helpers.engines import K, core_head, hf_logprobs_on_path
from vllm import SamplingParams

from openrlhf_growmtp.core.draft_vocab import DRAFT_VOCAB_META, TokenCounts
from openrlhf_growmtp.core.reconstruction import reconstruct_draft_logits
from growmtp_lab.worlds.toy import policy_hidden_states, random_prompts

STOP = 7  # a token the tiny policy emits now and then: stops land inside cycles


@pytest.fixture(scope="module")
def rollout(engine):
    """Prompts of different lengths; mixed temperatures; ignore_eos, a stop token, and odd max_tokens."""
    prompts = random_prompts(10, 128, min_len=3, max_len=60, seed=3)
    params = []
    for i in range(len(prompts)):
        temperature = (1.0, 0.7, 1.3, 0.5, 1.0)[i % 5]
        if i % 3 == 2:
            params.append(SamplingParams(temperature=temperature, max_tokens=61, stop_token_ids=[STOP]))
        else:
            params.append(SamplingParams(temperature=temperature, max_tokens=37 + i, ignore_eos=True))
    return prompts, params, engine.generate(prompts, params)


def assert_records_rebuild_responses(prompts, result, steps_without_drafts: int = 0, depth: int = K) -> None:
    """Each response = first (prefill) token + per cycle: accepted drafts + one recovered/bonus token;
    cycles start right after the previous one, except after up to `steps_without_drafts` engine steps
    that sampled a token without drafting (e.g. the recompute after a preemption); vLLM's own
    spec-decode counters agree with the records."""
    gaps = 0
    for prompt, output, rec in zip(prompts, result.outputs, result.records):
        response = list(output.outputs[0].token_ids)
        assert rec.token_ids.tolist() == prompt + response and rec.prompt_len == len(prompt)
        rebuilt = response[:1]
        for r in range(rec.num_cycles):
            gap = int(rec.start[r]) - (len(prompt) + len(rebuilt) - 2)
            assert gap >= 0, "cycles never overlap"
            gaps += gap
            rebuilt += response[len(rebuilt): len(rebuilt) + gap]
            a = int(rec.accepted[r])
            rebuilt += rec.drafts[r, :a].tolist()
            rebuilt += response[len(rebuilt): len(rebuilt) + 1] or [-1]  # recovered/bonus, unless cut off
        # a response cut by max_tokens or a stop token ends inside its last cycle
        assert rebuilt[: len(response)] == response and len(rebuilt) - len(response) <= depth
    assert gaps <= steps_without_drafts
    counters = result.metrics.vllm_counters
    accepted = torch.cat([r.accepted for r in result.records])
    assert counters["spec_decode_num_drafts"] == accepted.numel() == result.metrics.acceptance.cycles
    assert counters["spec_decode_num_accepted_tokens"] == int(accepted.sum())
    assert counters["spec_decode_num_draft_tokens"] == depth * accepted.numel()
    per_position = [int((accepted >= k).sum()) for k in range(1, K + 1)]  # vLLM counts K positions
    assert counters["spec_decode_num_accepted_tokens_per_pos"] == per_position
    assert result.metrics.acceptance.tau == pytest.approx(1 + accepted.float().mean().item())


def test_records_rebuild_each_response_and_match_vllm_counters(rollout):
    prompts, params, result = rollout
    assert [r.temperature for r in result.records] == [p.temperature for p in params]
    assert_records_rebuild_responses(prompts, result)


def test_some_responses_end_inside_a_cycle(rollout):
    """The cases above include cuts: committed length < what the last cycle produced."""
    _, _, result = rollout
    cut = 0
    for rec in result.records:
        s, a = int(rec.start[-1]), int(rec.accepted[-1])
        cut += (s + a + 2) > len(rec.token_ids) - 1
    assert cut >= 2


def test_recorded_topk_logprobs_equal_hf_forward_on_the_draft_path(world, rollout):
    _, _, result = rollout
    worst = 0.0
    for rec in result.records:
        for r in range(rec.num_cycles):
            hf = hf_logprobs_on_path(world["policy"], rec, r)
            recorded = rec.topk_logprobs[r].float()
            worst = max(worst, (hf.gather(1, rec.topk_ids[r].long()) - recorded).abs().max().item())
            assert torch.equal(rec.topk_ids[r].sort(dim=-1).values, torch.arange(hf.shape[-1]).expand(K, -1))
    assert worst <= 1e-4


def test_exact_mode_hidden_states_equal_the_policy_forward(world, rollout):
    _, _, result = rollout
    for rec in result.records:
        needed = int(rec.start.max()) + 1
        reference = policy_hidden_states(world["policy"], rec.token_ids)
        assert (rec.hidden[:needed].float() - reference[:needed]).abs().max().item() <= 1e-4


def engine_q_vs_reconstruction(head, policy, result, exact: bool) -> torch.Tensor:
    """max |q_engine - q_reconstructed| per depth, over every cycle of the rollout."""
    hiddens = None if exact else [policy_hidden_states(policy, rec.token_ids) for rec in result.records]
    with torch.no_grad():
        q = torch.softmax(reconstruct_draft_logits(head, result.records, hiddens).float(), dim=-1)
    q_engine = torch.cat([p for p in result.draft_probs if p is not None])
    assert q.shape == q_engine.shape
    return (q - q_engine).abs().amax(dim=(0, 2))


@pytest.mark.parametrize("exact", [True, False], ids=["engine_hidden", "recomputed_hidden"])
def test_engine_q_equals_batched_reconstruction_random_head(world, rollout, exact):
    """The central invariant: the q each draft was sampled from is what the trainer reconstructs."""
    _, _, result = rollout
    per_depth = engine_q_vs_reconstruction(core_head(world), world["policy"], result, exact)
    assert per_depth.shape == (K,) and per_depth.max().item() <= 1e-4, per_depth


def test_first_position_acceptance_matches_expected_min_p_q(rollout):
    """Observed acceptance of d_1 vs E[min(1, p/q)] = sum_x min(p, q) per cycle (full-vocabulary records)."""
    _, _, result = rollout
    expected, observed = [], []
    for rec, q in zip(result.records, result.draft_probs):
        p = torch.zeros(rec.num_cycles, q.shape[-1]).scatter_(1, rec.topk_ids[:, 0].long(),
                                                               rec.topk_logprobs[:, 0].float().exp())
        expected.append(torch.minimum(p, q[:, 0]).sum(-1))
        observed.append((rec.accepted >= 1).float())
    expected, observed = torch.cat(expected), torch.cat(observed)
    standard_error = (expected * (1 - expected)).sum().sqrt() / expected.numel()
    assert expected.numel() >= 150
    assert abs(observed.mean() - expected.mean()) <= 4 * standard_error, (observed.mean(), expected.mean())


@pytest.fixture(scope="module")
def subset_rollout(engine):
    """The rollout's prompts again, drafted over a quarter of the vocabulary ranked from the prompts' tokens."""
    prompts = random_prompts(10, 128, min_len=3, max_len=60, seed=3)
    counts = TokenCounts(128)
    counts.add(torch.tensor([t for p in prompts for t in p]))
    vocab = counts.top(32)
    engine.set_draft_vocab(vocab)
    try:
        result = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True))
    finally:
        engine.set_draft_vocab(None)
    return prompts, vocab, result


def test_records_over_a_draft_vocabulary_rebuild_responses_match_vllm_counters_and_name_it(subset_rollout):
    prompts, vocab, result = subset_rollout
    assert_records_rebuild_responses(prompts, result)
    assert {r.meta[DRAFT_VOCAB_META] for r in result.records} == {vocab.tag}
    inside = ~vocab.outside()
    assert all(bool(inside[r.drafts.long()].all()) for r in result.records)  # q is zero outside: never drafted
    committed = torch.cat([r.token_ids[r.prompt_len:] for r in result.records])
    assert not bool(inside[committed].all())  # the responses still reach every token (recovered ones)


def test_engine_q_over_a_draft_vocabulary_equals_reconstruction_and_is_zero_outside(world, subset_rollout):
    _, vocab, result = subset_rollout
    q_engine = torch.cat([p for p in result.draft_probs if p is not None])
    assert torch.equal(q_engine[..., vocab.outside()], torch.zeros_like(q_engine[..., vocab.outside()]))
    head = core_head(world)
    head.draft_vocab = vocab
    assert engine_q_vs_reconstruction(head, world["policy"], result, exact=True).max().item() <= 1e-4
    head.draft_vocab = None  # not vacuous: the whole vocabulary's q is far from the engine's
    assert engine_q_vs_reconstruction(head, world["policy"], result, exact=True).max().item() > 0.05
