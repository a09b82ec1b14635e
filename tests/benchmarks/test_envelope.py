"""benchmarks/envelope.py: its arithmetic against independent counts, and the kept figures are its output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import envelope

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("layers", [1, 3])  # the count is linear in the layers: two depths fix both terms
def test_parameter_counts_equal_transformers_models_built_from_the_same_fields(layers):
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    qwen3 = Qwen3Config(hidden_size=2560, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                        intermediate_size=9728, num_hidden_layers=layers, vocab_size=151936, tie_word_embeddings=True)
    mimo = Qwen2Config(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=11008,
                       num_hidden_layers=layers, vocab_size=151680, tie_word_embeddings=False)
    for config, model_cls, qwen2 in ((qwen3, Qwen3ForCausalLM, False), (mimo, Qwen2ForCausalLM, True)):
        with torch.device("meta"):
            model = model_cls(config)
        counted = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())  # tied: counted once
        derived = envelope.dense_params(layers, config.hidden_size, 32, 8, 128, config.intermediate_size,
                                        config.vocab_size, tied=config.tie_word_embeddings, qwen2=qwen2)
        assert derived == counted


def test_record_bytes_per_token_equal_a_packed_records():
    from benchmarks import bench_memory

    for k, tau in ((5, 1.0), (3, 3.0)):
        measured = bench_memory.record_bytes(None, k=k, topk=64, tau=tau, tokens=1024, prompt=64)
        # the formula counts the tensors only: a record's few hundred header bytes are spread over its tokens
        assert envelope.record_bytes_per_token(k, 64, measured["tau"]) == pytest.approx(
            measured["packed_bytes_per_token"], rel=0.01)


def test_the_kept_figures_are_the_scripts_output():
    kept = json.loads((ROOT / "docs" / "data" / "envelope" / "envelope.json").read_text())
    assert kept == json.loads(json.dumps(envelope.envelope())) and kept["derived"] is True


# ----------------------------------------------------------------------------- the presets' micro-batches

from openrlhf_growmtp import memory_estimate  # noqa: E402

GIB = 2**30


def test_the_head_update_peak_is_the_kept_h100_measurement():
    kept = json.loads((ROOT / envelope.HEAD_PEAK_JSON).read_text())["head_update_cost"]["peak_mb"]["head"]
    assert memory_estimate.HEAD_UPDATE_PEAK_MIB == kept


def test_the_terms_equal_a_count_by_hand():
    """Qwen3-4B at the scripts' layout (4 ranks, ZeRO-3, micro-batches 4 and 4, 1,024 + 8,192 tokens), counted here
    from the docstring's rules, then ZeRO-2 and Adam offload."""
    qwen3 = envelope.RECIPES[0]
    terms = envelope.recipe_training_gpu(qwen3)
    tokens = 1024 + 8192
    assert terms["policy_gib"] == pytest.approx(qwen3.params * 16 / 4 / GIB)
    assert terms["reference_gib"] == pytest.approx(qwen3.params * 2 / 4 / GIB)
    assert terms["micro_batch_logits_gib"] == pytest.approx(4 * tokens * 151936 * 8 / GIB)  # 41.7
    assert terms["rollout_micro_batch_logits_gib"] == pytest.approx(4 * tokens * 151936 * 6 / GIB)  # 31.3
    assert terms["checkpointed_inputs_gib"] == pytest.approx(36 * 4 * tokens * 2560 * 2 / GIB)  # 6.3
    assert terms["head_update_peak_gib"] == pytest.approx(4443.728515625 / 1024)
    assert terms["estimate_gib"] == terms["training_gib"] == pytest.approx(sum(
        terms[k] for k in ("policy_gib", "reference_gib", "head_gib", "head_update_peak_gib",
                           "micro_batch_logits_gib", "checkpointed_inputs_gib")))
    shape = memory_estimate.ModelShape(params=1e9, vocab=1000, hidden=100, layers=None, head_params=0, family="qwen3")
    layout = memory_estimate.TrainingLayout(ranks=4, zero_stage=2, adam_offload=True, reference=False,
                                            trains_head=False, chunk_cycles=4096, tokens=10, micro_batch=1,
                                            rollout_micro_batch=1, checkpointing=True)
    zero2 = memory_estimate.training_gpu(shape, layout)
    assert zero2["policy_gib"] == pytest.approx((2 + (4 - 2) / 4) * 1e9 / GIB)  # bf16 weights whole, grads split
    assert zero2["reference_gib"] == zero2["head_gib"] == zero2["checkpointed_inputs_gib"] == 0


@pytest.mark.parametrize("recipe", envelope.RECIPES, ids=lambda r: r.family)
def test_each_preset_takes_the_largest_micro_batches_that_fit_an_80_gib_card(recipe):
    usable = memory_estimate.usable_gib(80.0)
    assert envelope.recipe_training_gpu(recipe)["estimate_gib"] <= usable
    doubled_rollout = envelope.recipe_training_gpu(recipe, rollout_micro_batch=2 * recipe.rollout_micro_batch)
    assert doubled_rollout["experience_gib"] > usable
    doubled = envelope.recipe_training_gpu(recipe, micro_batch=2 * recipe.micro_batch)
    assert doubled["training_gib"] > usable  # Qwen3.5's even without its layers' inputs (its layer count is not kept)


def test_model_shape_counts_a_real_config_as_the_envelope_does(tmp_path):
    """Qwen3-4B's released config fields on the meta device: the envelope's count from the same fields, and the
    head bench_memory.py counted (114.0 M)."""
    from transformers import Qwen3Config

    config = Qwen3Config(hidden_size=2560, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         intermediate_size=9728, num_hidden_layers=36, vocab_size=151936, tie_word_embeddings=True)
    config.save_pretrained(tmp_path)
    shape = memory_estimate.model_shape(tmp_path)
    assert shape.params == envelope.QWEN3_4B and shape.layers == 36 and shape.hidden == 2560
    assert shape.family == "qwen3" and round(shape.head_params / 1e6, 1) == 114.0


def test_the_card_comes_from_the_environment_or_is_80_gib(monkeypatch):
    monkeypatch.delenv(memory_estimate.CARD_ENV, raising=False)
    assert memory_estimate.card_gib() == 80.0
    monkeypatch.setenv(memory_estimate.CARD_ENV, "141")
    assert memory_estimate.card_gib() == 141.0
    for bad in ("lots", "0", "nan"):
        monkeypatch.setenv(memory_estimate.CARD_ENV, bad)
        with pytest.raises(ValueError, match=memory_estimate.CARD_ENV):
            memory_estimate.card_gib()
