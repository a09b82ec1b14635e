"""bench_memory's arithmetic against counts made by hand from shapes and configs (fast: no real-shape update)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import bench_memory
from helpers.tiny import tiny_backbone_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("k,topk,tau", [(3, 8, 1.0), (5, 64, 3.0), (7, 16, 2.2)])
def test_record_bytes_are_the_record_tensors_bytes_counted_from_their_shapes(k, topk, tau):
    hidden = 64
    r = bench_memory.record_bytes(hidden, k, topk, tau, tokens=300, prompt=20)
    t, cycles = r["tokens"], r["cycles"]
    # packed: int32 token ids, starts, drafts and top-k ids; bf16 log-probs; uint8 accepted counts
    packed = 4 * t + 4 * cycles + 4 * cycles * k + 4 * cycles * k * topk + 2 * cycles * k * topk + 1 * cycles
    assert r["packed_bytes"] == packed
    assert r["exact_bytes"] == packed + 2 * t * hidden  # + bf16 hidden [T, H]
    # unpacked: every integer tensor back to int64, the log-probs stay bf16
    assert r["unpacked_bytes"] == (8 * t + 8 * cycles + 8 * cycles * k + 8 * cycles * k * topk
                                   + 2 * cycles * k * topk + 8 * cycles)
    assert r["generated"] == t - 20
    assert r["packed_bytes_per_token"] == pytest.approx(packed / (t - 20))
    # the draw's mean accepted count: an accepted count lies in 0..K, so its standard deviation is at most K / 2;
    # 4 standard errors of the mean over the record's cycles
    assert abs(r["tau"] - tau) <= 4 * (k / 2) / cycles**0.5
    lean = bench_memory.record_bytes(None, k, topk, tau, tokens=300, prompt=20)  # transport-free only
    assert "exact_bytes" not in lean and lean["packed_bytes"] == packed  # the same draw (seed 0)


def test_record_tensor_bytes_and_header_add_up_to_the_packed_record():
    rec = bench_memory.records_at_tau(90, 10, 2.0, 3, 8, 97, hidden_size=None, seed=3)
    blob = rec.pack()
    tensors, header = bench_memory.record_tensor_bytes(blob)
    assert tensors + header == len(blob)
    assert tensors == rec.nbytes - 4 * rec.token_ids.numel() - 4 * rec.start.numel() - 4 * rec.drafts.numel() \
        - 4 * rec.topk_ids.numel() - 2 * rec.topk_logprobs.numel() - 7 * rec.accepted.numel()  # int64/fp32 -> packed


def hand_count(hidden, heads, kv_heads, head_dim, mlp, *, gate=False, qk_norm=True, qkv_bias=False) -> int:
    """The head's parameters from its config: fc [H, 2H], three RMSNorms (embedding, hidden, final), one decoder
    layer (attention, MLP, its two norms)."""
    q_out = heads * head_dim * (2 if gate else 1)  # a gated attention's q_proj also yields the gate
    attention = hidden * q_out + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
    attention += 2 * head_dim if qk_norm else 0
    attention += (heads + 2 * kv_heads) * head_dim if qkv_bias else 0
    return 2 * hidden * hidden + 3 * hidden + attention + 3 * hidden * mlp + 2 * hidden


def test_head_parameters_at_the_real_shapes_match_a_count_from_the_released_configs():
    shapes = bench_memory.SHAPES
    assert bench_memory.head_parameters(shapes["qwen3_4b"]) == hand_count(2560, 32, 8, 128, 9728)
    assert bench_memory.head_parameters(shapes["qwen3_5_4b"]) == hand_count(2560, 16, 4, 256, 9216, gate=True)
    assert bench_memory.head_parameters(shapes["mimo_7b"]) == hand_count(4096, 32, 8, 128, 11008, qk_norm=False,
                                                                         qkv_bias=True)
    vocab = {name: shape.config.vocab_size for name, shape in shapes.items()}
    assert vocab == {"qwen3_4b": 151936, "qwen3_5_4b": 248320, "mimo_7b": 151680}


def test_training_bytes_split_by_zero_stage():
    params, ranks = 1_000_000, 4
    z3 = bench_memory.head_training_bytes(params, ranks, 3)
    z2 = bench_memory.head_training_bytes(params, ranks, 2)
    assert sum(z3.values()) * ranks == 16 * params  # 2 + 2 + 12 bytes a parameter, all partitioned
    assert z2 == {"weights": 2 * params, "grads": 2 * params / ranks, "adam": 12 * params / ranks}
    with pytest.raises(ValueError, match="zero_stage"):
        bench_memory.head_training_bytes(params, ranks, 1)


def test_chunk_peaks_run_one_chunk_per_size_on_a_tiny_head():
    shape = bench_memory.Shape("tiny", "qwen3", tiny_backbone_config("qwen3"))
    peaks = bench_memory.chunk_peaks(shape, [8, 32], k=3, topk=8, tau=2.0, prompt=6)
    assert [p["chunk"] for p in peaks] == [8, 32]
    assert all(p["finite"] and p["chunks_run"] == 1 and p["peak_mib"] > 0 for p in peaks)


def test_the_parts_asked_for_are_kept_with_their_provenance(tmp_path, monkeypatch):
    out = tmp_path / "kept" / "memory.json"
    monkeypatch.setattr("sys.argv", ["bench_memory", "--parts", "head", "--families", "qwen3_4b", "--out", str(out)])
    bench_memory.main()
    kept = json.loads(out.read_text())
    assert {"commit", "command", "date", "machine"} <= set(kept) and "--parts head" in kept["command"]
    assert "records" not in kept and set(kept["families"]) == {"qwen3_4b"}
    head = kept["families"]["qwen3_4b"]["head"]
    assert head["parameters"] == bench_memory.head_parameters(bench_memory.SHAPES["qwen3_4b"])
    assert "chunk_peaks" not in kept["families"]["qwen3_4b"]  # the update's peaks were not asked for
    monkeypatch.setattr("sys.argv", ["bench_memory", "--parts", "head,peak"])
    with pytest.raises(SystemExit):
        bench_memory.main()
