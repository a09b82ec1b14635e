"""benchmarks/envelope.py: its arithmetic against independent counts, and the kept figures are its output."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # the benchmarks' modules, as the script itself sees them

import envelope  # noqa: E402


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
    import bench_memory

    for k, tau in ((5, 1.0), (3, 3.0)):
        measured = bench_memory.record_bytes(None, k=k, topk=64, tau=tau, tokens=1024, prompt=64)
        # the formula counts the tensors only: a record's few hundred header bytes are spread over its tokens
        assert envelope.record_bytes_per_token(k, 64, measured["tau"]) == pytest.approx(
            measured["packed_bytes_per_token"], rel=0.01)


def test_the_kept_figures_are_the_scripts_output():
    kept = json.loads((ROOT / "docs" / "data" / "envelope" / "envelope.json").read_text())
    assert kept == json.loads(json.dumps(envelope.envelope())) and kept["derived"] is True
