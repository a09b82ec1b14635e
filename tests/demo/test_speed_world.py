"""The speed world's policy: the demo world's policy grown wider and deeper computes the same function."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from growmtp_lab.worlds.speed_world import grow, grown_config

# the demo world's policy shape (demo_world.WorldSpec), with random weights: the growth must not depend on them
SMALL = dict(vocab_size=32, hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6,
             tie_word_embeddings=False)


@pytest.fixture(scope="module")
def small():
    torch.manual_seed(1)
    model = Qwen3ForCausalLM(Qwen3Config(**SMALL)).eval()
    with torch.no_grad():  # norms and projections away from their initial values, as a trained policy's are
        for name, p in model.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if "norm" in name else torch.randn_like(p) * 0.1)
    return model


def test_grown_policy_computes_the_small_policys_logits(small):
    ids = torch.randint(0, SMALL["vocab_size"], (3, 40), generator=torch.Generator().manual_seed(0))
    big = grow(small, num_layers=6, hidden_size=512, seed=0)
    with torch.no_grad():
        want = small(input_ids=ids).logits
        out = big(input_ids=ids, output_hidden_states=True)
    # the same sums in fp32 with exact zeros added, blocked otherwise by the GEMM: a dot product of n <= 1,536
    # terms rounds by about sqrt(n) x 6e-8 = 2.4e-6 of its size, a few of them in turn move logits of size ~10 by
    # ~1e-5 (n x 6e-8 = 9e-5 of their size at worst): 1e-4 absolute
    torch.testing.assert_close(out.logits, want, rtol=1e-5, atol=1e-4)
    for hidden in out.hidden_states:  # the stream's new dimensions hold nothing
        assert torch.count_nonzero(hidden[..., SMALL["hidden_size"]:]) == 0


def test_new_layers_start_as_the_identity_and_nothing_else_is_held_at_zero(small):
    big = grow(small, num_layers=4, hidden_size=256, seed=0)
    for layer in big.model.layers[2:]:
        assert torch.count_nonzero(layer.self_attn.o_proj.weight) == 0
        assert torch.count_nonzero(layer.mlp.down_proj.weight) == 0
        assert torch.count_nonzero(layer.self_attn.q_proj.weight) == layer.self_attn.q_proj.weight.numel()
    # what reads the new dimensions is drawn, so RL's gradients reach the writes into them
    old_layer = big.model.layers[0]
    for reader in (old_layer.mlp.gate_proj.weight[:, 128:], big.lm_head.weight[:, 128:]):
        assert torch.count_nonzero(reader) == reader.numel()


def test_grown_config_keeps_head_dim_grouping_and_mlp_ratio():
    config = grown_config(Qwen3Config(**SMALL), num_layers=12, hidden_size=512)
    assert (config.num_hidden_layers, config.hidden_size, config.head_dim) == (12, 512, 32)
    assert (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size) == (16, 8, 1536)
    assert config.rms_norm_eps == pytest.approx(1e-6 / 4)
    with pytest.raises(ValueError, match="multiple of the width"):
        grown_config(Qwen3Config(**SMALL), num_layers=12, hidden_size=500)
    with pytest.raises(ValueError, match="at least as many layers"):
        grown_config(Qwen3Config(**SMALL), num_layers=1, hidden_size=512)
