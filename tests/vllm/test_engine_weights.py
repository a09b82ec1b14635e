"""Live weight updates: a better head raises tau on the next generate and survives sleep/wake; target reloads."""

import pytest
import torch
from helpers.engines import K, close_engine, core_head, head_sync_diff, hf_logprobs_on_path, make_engine
from test_records_engine import engine_q_vs_reconstruction
from vllm import SamplingParams

from growmtp_lab.worlds.toy import random_prompts, train_head_on_records
from vllm_patches.transport import dump_blob

PARAMS = SamplingParams(temperature=1.0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def grown(world):
    """GrowMTP in miniature: records from the random head train the head, which is loaded into the engine."""
    engine = make_engine(world, capture_q=True)
    prompts = random_prompts(24, 128, seed=5)
    before = engine.generate(prompts, PARAMS)
    head = core_head(world)
    losses = train_head_on_records(head, world["policy"], before.records, steps=30)
    engine.load_head(head.state_dict())
    after = engine.generate(prompts, PARAMS)
    yield {"engine": engine, "head": head, "before": before, "after": after, "losses": losses, "prompts": prompts}
    close_engine(engine)


def test_loading_a_better_head_raises_tau_on_the_next_generate(grown):
    assert grown["losses"][-1] < grown["losses"][0]
    tau_before, tau_after = grown["before"].metrics.acceptance.tau, grown["after"].metrics.acceptance.tau
    assert tau_after > tau_before + 0.5, (tau_before, tau_after)
    assert grown["after"].metrics.acceptance.alpha[0] > grown["before"].metrics.acceptance.alpha[0]


def test_engine_q_equals_reconstruction_for_the_trained_head(world, grown):
    per_depth = engine_q_vs_reconstruction(grown["head"], world["policy"], grown["after"], exact=False)
    assert per_depth.max().item() <= 1e-4, per_depth


def test_level2_sleep_keeps_the_loaded_head(grown):
    """On GPU, level-2 sleep discards the drafter's weights; wake_up re-sends the last head.

    CPU vLLM has no sleep mode (sleep is a no-op there), so the loss is simulated: the engine's head is
    zeroed behind SpecEngine's back between sleep and wake, as a discarded drafter would be.
    """
    engine = grown["engine"]
    engine.sleep(level=2)
    zeroed = {name: torch.zeros_like(t) for name, t in grown["head"].state_dict().items()}
    engine.llm.collective_rpc("growmtp_load_head_weights", args=(dump_blob(zeroed),))
    lost = engine.generate(grown["prompts"], PARAMS)
    assert lost.metrics.acceptance.tau < grown["after"].metrics.acceptance.tau - 0.5  # the loss is real
    engine.wake_up()
    again = engine.generate(grown["prompts"], PARAMS)
    assert again.metrics.acceptance.tau > grown["before"].metrics.acceptance.tau + 0.5


def test_head_weights_that_would_not_fill_the_head_exactly_are_refused_and_the_live_head_kept(grown):
    """A state missing a tensor (or one part of a fused q/k/v) would leave that part drafting with its old value;
    a name the head has no parameter for would have failed half-way through the load. Both are refused by
    name before any weight is written."""
    engine, state = grown["engine"], grown["head"].state_dict()
    zeroed = {name: torch.zeros_like(t) for name, t in state.items()}
    extra = "layers.0.self_attn.extra.weight"
    for bad, says in (({n: t for n, t in zeroed.items() if "k_proj" not in n}, r"qkv_proj.weight \(part k\)"),
                      ({n: t for n, t in zeroed.items() if "norm" not in n}, "no weight for model.norm.weight"),
                      ({**zeroed, extra: torch.zeros(1)}, f"'{extra}' has no parameter in the head")):
        with pytest.raises(Exception, match=says):
            engine.load_head(bad)
    assert max(rank["max_diff"] for rank in head_sync_diff(engine, state)) == 0.0  # none of the zeros reached it
    assert engine.load_head(state) == sorted(state)  # every name, back to the trainer


def test_target_weights_reload_into_the_live_engine(world):
    """New policy weights reach verification (p) and the drafter's shared embedding/lm_head (q)."""
    engine = make_engine(world, capture_q=True, logprob_dtype="float32")
    try:
        policy = world["policy"]
        original = {n: t.clone() for n, t in policy.state_dict().items()}
        g = torch.Generator().manual_seed(11)
        updated = {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in original.items()}
        engine.load_target(updated)
        policy.load_state_dict(updated)
        result = engine.generate(random_prompts(4, 128, seed=9), PARAMS)
        worst = max((hf_logprobs_on_path(policy, rec, r).gather(1, rec.topk_ids[r].long())
                     - rec.topk_logprobs[r].float()).abs().max().item()
                    for rec in result.records for r in range(rec.num_cycles))
        assert worst <= 1e-4
        assert engine_q_vs_reconstruction(core_head(world), policy, result, exact=False).max() <= 1e-4
    finally:
        world["policy"].load_state_dict(original)
        close_engine(engine)


def test_a_tied_embedding_reload_reaches_the_logits(tmp_path):
    """Qwen3-4B ties lm_head to the input embedding (vLLM skips `lm_head.weight` when loading it). After the
    policy's new embedding is reloaded, and the head after it as the trainer does, the engine must score with
    the new embedding at the real vocabulary. On CPU the lm_head kept a packed copy of the old one (log-probs off
    by 3.2 here) until the reload re-tied and re-processed it."""
    from transformers import AutoModelForCausalLM

    from openrlhf_growmtp.core.checkpoint import load_head, materialize_random_head
    from growmtp_lab.rehearsal import world as rehearsal_world
    from vllm_patches.engine import SpecEngine

    model_dir = rehearsal_world.build(tmp_path, "qwen3_4b") / "qwen3_4b"
    head_dir = materialize_random_head(model_dir, tmp_path / "head", seed=0)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert policy.config.tie_word_embeddings and policy.lm_head.weight is policy.model.embed_tokens.weight
    engine = SpecEngine(model_dir, head_dir, K, capture_q=True, logprob_dtype="float32", dtype="float32",
                        enforce_eager=True, max_model_len=512, seed=0)
    try:
        g = torch.Generator().manual_seed(11)
        with torch.no_grad():
            embedding = policy.model.embed_tokens.weight
            embedding.add_(0.05 * torch.randn(embedding.shape, generator=g))
        engine.load_target({"model.embed_tokens.weight": embedding})
        head = load_head(head_dir, policy.model.embed_tokens, policy.lm_head)
        engine.load_head(head.state_dict())
        prompts = [[151644, 84, 82, 257, 198, 300 + i, 301] for i in range(3)]
        result = engine.generate(prompts, PARAMS)
        worst = max((hf_logprobs_on_path(policy, rec, r).gather(1, rec.topk_ids[r].long())
                     - rec.topk_logprobs[r].float()).abs().max().item()
                    for rec in result.records for r in range(rec.num_cycles))
        assert worst <= 1e-4, worst
        assert engine_q_vs_reconstruction(head, policy, result, exact=False).max() <= 1e-4
    finally:
        close_engine(engine)
