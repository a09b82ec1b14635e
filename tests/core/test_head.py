"""The head's own API: native names, recurrent drafting with its KV cache, family differences, detachment."""

import math

import pytest
import torch

from openrlhf_growmtp.core import HeadLRSchedule, acceptance_summary, head_loss_backward
from openrlhf_growmtp.core.head_cache import HeadKVCache
from helpers.tiny import FAMILY_NAMES, HIDDEN, VOCAB, make_head, make_records

NATIVE_NAMES = {
    "qwen3_5": {"fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight",
                "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight"},
    "mimo": {"input_proj.weight", "token_layernorm.weight", "hidden_layernorm.weight", "final_layernorm.weight",
             "self_attn.q_proj.bias", "mlp.down_proj.weight", "input_layernorm.weight"},
}


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_state_dict_holds_only_the_head_under_native_names(family):
    head = make_head(family)
    names = set(head.state_dict())
    assert not any("embed_tokens" in n or "lm_head" in n for n in names)  # the backbone's, never copied
    assert NATIVE_NAMES.get(family, NATIVE_NAMES["qwen3_5"]) <= names  # qwen3 reuses Qwen3.5's names
    assert sum(p.numel() for p in head.parameters()) == sum(t.numel() for t in head.state_dict().values())


def test_incremental_drafting_with_a_cropped_cache_equals_a_fresh_cache_per_cycle():
    """How a drafter runs: keep the prefix entries, drop each cycle's chain entries, append new commits."""
    head = make_head("qwen3")
    rec = make_records(k=3)[2]
    cache, written, incremental = HeadKVCache(), 0, []
    with torch.no_grad():
        for r in range(rec.num_cycles):
            s = int(rec.start[r])
            out = head.prefill(rec.hidden[None, written:s + 1], rec.token_ids[None, written + 1:s + 2], written, cache)
            written = s + 1
            _, logits = head.draft_chain(out.last(), s, rec.drafts[r:r + 1], rec.depth, cache)
            cache.crop(written)
            incremental.append(logits[0])
        fresh = []
        for r in range(rec.num_cycles):
            s, cache = int(rec.start[r]), HeadKVCache()
            out = head.prefill(rec.hidden[None, :s + 1], rec.token_ids[None, 1:s + 2], 0, cache)
            fresh.append(head.draft_chain(out.last(), s, rec.drafts[r:r + 1], rec.depth, cache)[1][0])
    assert (torch.stack(incremental) - torch.stack(fresh)).abs().max() <= 1e-5


def test_prefill_over_a_filled_cache_needs_and_gets_a_mask():
    head = make_head("qwen3")
    hidden, ids = torch.randn(1, 7, HIDDEN), torch.randint(0, VOCAB, (1, 7))
    with torch.no_grad():
        whole = head.prefill(hidden, ids, 0, HeadKVCache()).normed
        cache = HeadKVCache()
        head.prefill(hidden[:, :3], ids[:, :3], 0, cache)
        tail = head.prefill(hidden[:, 3:], ids[:, 3:], 3, cache).normed
        with pytest.raises(ValueError, match="attention_mask"):
            head(hidden[:, 3:], ids[:, 3:], torch.arange(3, 7)[None], cache=cache)
    assert (tail - whole[:, 3:]).abs().max() <= 1e-5


@pytest.mark.parametrize("family, zeroed", [("qwen3", False), ("qwen3_5", False), ("mimo", True)])
def test_embedding_at_position_0_is_zeroed_only_where_the_native_head_does(family, zeroed):
    head = make_head(family)
    hidden = torch.randn(1, 1, HIDDEN)
    with torch.no_grad():
        outs = [head(hidden, torch.tensor([[t]]), torch.tensor([[0]]), cache=HeadKVCache()).normed for t in (3, 4)]
        later = [head(hidden, torch.tensor([[t]]), torch.tensor([[5]]), cache=HeadKVCache()).normed for t in (3, 4)]
    assert torch.equal(outs[0], outs[1]) == zeroed
    assert not torch.equal(later[0], later[1])


@pytest.mark.parametrize("family, pre_norm", [("qwen3", True), ("qwen3_5", False), ("mimo", False)])
def test_fed_back_state_is_pre_or_post_norm_per_family(family, pre_norm):
    head = make_head(family)
    with torch.no_grad():
        out = head(torch.randn(1, 4, HIDDEN), torch.randint(0, VOCAB, (1, 4)), torch.arange(4)[None],
                   cache=HeadKVCache())
    assert torch.equal(out.feed_back, out.hidden if pre_norm else out.normed)
    assert not torch.equal(out.hidden, out.normed)


def test_head_loss_reaches_only_the_head_not_the_backbone_embedding_or_lm_head():
    head = make_head("qwen3")
    embed, lm_head = head.__dict__["embed_tokens"], head.__dict__["lm_head"]
    head_loss_backward(head, make_records(k=3))
    assert embed.weight.grad is None and lm_head.weight.grad is None
    assert lm_head.weight.requires_grad  # frozen only while the head ran
    assert all(p.grad is not None for p in head.parameters())


def test_sampled_drafts_follow_q():
    head = make_head("qwen3")
    batch, s = 4000, 5
    g = torch.Generator().manual_seed(0)  # not the global RNG: q must not depend on which tests ran before
    hidden = torch.randn(1, s + 1, HIDDEN, generator=g).expand(batch, -1, -1)
    ids = torch.randint(0, VOCAB, (1, s + 1), generator=g).expand(batch, -1)
    with torch.no_grad():
        out = head.prefill(hidden, ids, 0, HeadKVCache())
        drafts, logits = head.draft_chain(out.last(), s, None, 1, HeadKVCache(), temperature=1.3,
                                          generator=torch.Generator().manual_seed(0))
    q = logits[0, 0].softmax(-1)
    empirical = torch.bincount(drafts[:, 0], minlength=VOCAB).float() / batch
    # TV between the empirical and q: E|count/n - q_i| <= sqrt(q_i (1 - q_i) / n) per token (Jensen), so the
    # expected TV is at most half their sum; a sum over 97 tokens concentrates well inside twice that.
    bound = 0.5 * (q * (1 - q) / batch).sqrt().sum()
    assert 0.5 * (empirical - q).abs().sum() < 2 * bound
    assert (logits[0, 0] - logits[1, 0]).abs().max() == 0  # every row is the same q
    with torch.no_grad():  # q is the head's logits at the chain's first position over the temperature
        assert torch.allclose(logits[0, 0], head.logits(out.last().normed[0, -1]).float() / 1.3, atol=1e-6)


def test_head_lr_schedule_warms_up_then_decays_to_the_floor():
    sched = HeadLRSchedule(total_steps=50, warmup_steps=10, min_lr_ratio=0.1)
    values = [sched(step) for step in range(50)]
    assert values[0] == pytest.approx(0.1) and values[4] == pytest.approx(0.5) and values[9] == pytest.approx(1.0)
    assert values[10] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(values[10:], values[11:]))  # monotone decay after warm-up
    assert values[-1] == pytest.approx(0.1) and sched(500) == pytest.approx(0.1)
    # a quarter of the decay (step 10 of 40 decay steps): cosine gives floor + (1 - floor)(1 + cos(pi/4))/2 =
    # 0.1 + 0.9 (2 + sqrt 2)/4; a linear decay would give 0.775
    quarter = HeadLRSchedule(total_steps=41, warmup_steps=0, min_lr_ratio=0.1)(10)
    assert quarter == pytest.approx(0.1 + 0.9 * (2 + math.sqrt(2)) / 4, rel=1e-12)
    with pytest.raises(ValueError):
        HeadLRSchedule(total_steps=0)


def test_acceptance_summary_counts_tau_with_the_bonus_token_and_unconditional_alpha():
    summary = acceptance_summary(torch.tensor([0, 3, 1, 3]), k=3)
    assert summary.tau == pytest.approx(1 + 7 / 4)
    assert summary.alpha == pytest.approx([3 / 4, 2 / 4, 2 / 4])
    assert acceptance_summary(torch.tensor([], dtype=torch.long), k=2).tau == 1.0


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_keys_values_are_what_a_forward_writes_to_the_cache(family):
    head = make_head(family)
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, 9, HIDDEN, generator=g)
    ids = torch.randint(0, VOCAB, (2, 9), generator=g)
    positions = torch.arange(9).expand(2, 9)
    cache = HeadKVCache()
    with torch.no_grad():
        head(hidden, ids, positions, cache=cache)
        key, value = head.keys_values(hidden, ids, positions)
    assert key.shape == cache.key.shape and value.shape == cache.value.shape
    assert torch.equal(key, cache.key) and torch.equal(value, cache.value)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_rope_angles_stay_fp32_in_a_bf16_head(family):
    # RoPE's angle is position x inv_freq; vLLM computes it in fp32 from the base. A head cast to bf16 (as the
    # trainer's is, by load_head and by DeepSpeed) must not round inv_freq to bf16: at position 8,000 an inv_freq
    # near 1 rounded by 2^-9 would turn the angle by radians. Reference: the angles in float64 from the config.
    import copy

    head = copy.deepcopy(make_head(family)).to(torch.bfloat16)
    config = head.config
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    base = config.rope_parameters["rope_theta"]
    positions = torch.tensor([[0, 1, 100, 8000, 16000]])
    angles = positions[0, :, None].double() / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    cos, sin = head.rotary_emb(torch.zeros(1, 5, config.hidden_size, dtype=torch.bfloat16), positions)
    if cos.shape[-1] != dim:  # a family that rotates part of each head (partial RoPE): its own width
        dim = cos.shape[-1]
        angles = positions[0, :, None].double() / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    want = torch.cat([angles, angles], -1)
    # fp32 angles (position x fp32 inv_freq: relative 2^-24, i.e. 1e-3 rad at 16,000), then cos and sin rounded
    # to bf16 (2^-8 of values <= 1): within 2^-8 + 1e-3 of float64's
    assert (cos[0].double() - want.cos()).abs().max() <= 2 ** -8 + 1e-3
    assert (sin[0].double() - want.sin()).abs().max() <= 2 ** -8 + 1e-3
