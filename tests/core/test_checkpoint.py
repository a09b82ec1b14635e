"""Head checkpoints: deterministic random init with the right statistics, native heads, export round trips."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from openrlhf_growmtp.cli.make_head import main as make_head_main
from openrlhf_growmtp.core import export_head, load_head, load_native_head, materialize_random_head
from openrlhf_growmtp.core.checkpoint import HeadCheckpointError, init_random_head_
from openrlhf_growmtp.core.head_cache import HeadKVCache
from helpers.tiny import FAMILY_NAMES, HIDDEN, VOCAB, backbone_modules, make_head, tiny_backbone_config


def _backbone_dir(tmp_path, family, native_head=None, sharded=False, **overrides):
    """A tiny full-model checkpoint: config.json + backbone tensors (+ native MTP tensors)."""
    config = tiny_backbone_config(family, **overrides)
    raw = config.to_dict()
    if family == "mimo":
        raw["model_type"] = "mimo"  # MiMo's own model_type; transformers has no class for it
    out = tmp_path / f"{family}_model"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(raw))
    embed, lm_head = backbone_modules()
    tensors = {"model.embed_tokens.weight": embed.weight.detach().clone(),
               "lm_head.weight": lm_head.weight.detach().clone()}
    if native_head is not None:
        tensors.update(native_head)
    if sharded:
        names = sorted(tensors)
        shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
        for file, keys in shards.items():
            save_file({k: tensors[k] for k in keys}, str(out / file))
        weight_map = {k: file for file, keys in shards.items() for k in keys}
        (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    else:
        save_file(tensors, str(out / "model.safetensors"))
    return out


def _native_tensors(family, seed=3):
    """Native-layout tensors of a trained-looking head (random, with the family's native names)."""
    head = make_head(family, seed=seed)
    state = {k: v.detach().clone() for k, v in head.state_dict().items()}
    prefix = head.family.native_prefix
    return {prefix + k: v for k, v in state.items()}


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_random_head_materialisation_is_deterministic_under_seed_0(tmp_path, family):
    config = tiny_backbone_config(family)
    a = load_file(str(materialize_random_head(config, tmp_path / "a") / "model.safetensors"))
    b = load_file(str(materialize_random_head(config, tmp_path / "b") / "model.safetensors"))
    c = load_file(str(materialize_random_head(config, tmp_path / "c", seed=1) / "model.safetensors"))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if k.endswith("proj.weight"))


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_random_head_matches_the_init_statistics(family):
    head = init_random_head_(make_head(family), seed=0)
    std = head.config.initializer_range
    linear = [m for m in head.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linear) == 8  # fc + q/k/v/o + gate/up/down
    weights = torch.cat([m.weight.flatten() for m in linear])
    assert weights.numel() > 30_000  # sample std within 2% is ~5 sigma
    assert abs(weights.mean().item()) < 3 * std / weights.numel() ** 0.5 + 1e-6
    assert abs(weights.std().item() - std) < 0.02 * std
    for m in linear:  # every Linear on its own, not just the pool
        assert abs(m.weight.std().item() - std) < 0.1 * std
        assert m.bias is None or torch.count_nonzero(m.bias) == 0
    norms = [m for m in head.modules() if type(m).__name__.endswith("RMSNorm")]
    assert len(norms) >= 5
    for norm in norms:  # every RMSNorm (q/k norms of head_dim included) is a plain RMS normalisation (scale 1)
        x = torch.randn(3, norm.weight.shape[0])
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        assert torch.allclose(norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps), atol=1e-6)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_exported_head_loads_back_and_computes_the_same(tmp_path, family):
    head = make_head(family)
    out = export_head(head, tmp_path / "head")
    embed, lm_head = backbone_modules()
    loaded = load_head(out, embed, lm_head)
    hidden, ids = torch.randn(1, 6, HIDDEN), torch.randint(0, VOCAB, (1, 6))
    with torch.no_grad():
        a = head.prefill(hidden, ids, 0, HeadKVCache()).normed
        b = loaded.prefill(hidden, ids, 0, HeadKVCache()).normed
    assert torch.equal(a, b)


def test_mimo_native_head_swaps_fc_halves_on_load_and_round_trips(tmp_path):
    native = _native_tensors("mimo")
    model_dir = _backbone_dir(tmp_path, "mimo", native_head=native, sharded=True)
    head = load_native_head(model_dir, *backbone_modules())
    fc = native["model.mtp_layers.0.input_proj.weight"]
    # native MiMo computes input_proj(cat[h, e]); ours computes fc(cat[e, h])
    assert torch.equal(head.input_proj.weight, torch.cat([fc[:, HIDDEN:], fc[:, :HIDDEN]], dim=1))
    exported = load_file(str(export_head(head, tmp_path / "native", native=True) / "model.safetensors"))
    assert exported.keys() == native.keys()
    assert all(torch.equal(exported[k], native[k]) for k in native)


def _rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def test_mimo_native_head_computes_what_the_native_layout_computes(tmp_path):
    """Single slot (one key: attention returns v): the native MiMo MTP forward written out by hand."""
    native = {k.removeprefix("model.mtp_layers.0."): v for k, v in _native_tensors("mimo").items()}
    model_dir = _backbone_dir(tmp_path, "mimo", native_head={"model.mtp_layers.0." + k: v for k, v in native.items()})
    embed, lm_head = backbone_modules()
    head = load_native_head(model_dir, embed, lm_head)
    hidden, token = torch.randn(1, 1, HIDDEN), torch.tensor([[11]])
    for position in (0, 4):
        e = embed.weight[token] * (0.0 if position == 0 else 1.0)  # MiMo zeroes the embedding at position 0
        x = F.linear(torch.cat([_rms(hidden, native["hidden_layernorm.weight"]),
                                _rms(e, native["token_layernorm.weight"])], -1), native["input_proj.weight"])
        a = _rms(x, native["input_layernorm.weight"])
        v = F.linear(a, native["self_attn.v_proj.weight"], native["self_attn.v_proj.bias"])
        x = x + F.linear(v.repeat(1, 1, 2), native["self_attn.o_proj.weight"])  # 2 heads share 1 kv head
        m = _rms(x, native["post_attention_layernorm.weight"])
        gated = F.silu(F.linear(m, native["mlp.gate_proj.weight"])) * F.linear(m, native["mlp.up_proj.weight"])
        x = x + F.linear(gated, native["mlp.down_proj.weight"])
        expected = _rms(x, native["final_layernorm.weight"])
        with torch.no_grad():
            out = head(hidden, token, torch.tensor([[position]]), cache=HeadKVCache())
        assert torch.allclose(out.normed, expected, atol=1e-5)
        assert torch.equal(out.feed_back, out.normed)  # MiMo feeds back the post-norm state


def test_qwen3_5_native_head_loads_from_mtp_prefix(tmp_path):
    native = _native_tensors("qwen3_5")
    assert all(k.startswith("mtp.") for k in native)
    model_dir = _backbone_dir(tmp_path, "qwen3_5", native_head=native)
    head = load_native_head(model_dir)
    state = head.state_dict()
    assert all(torch.equal(state[k.removeprefix("mtp.")], v) for k, v in native.items())


@pytest.mark.parametrize("family, overrides", [("qwen3", {}), ("qwen3_5", {"mtp_num_hidden_layers": 0}),
                                               ("mimo", {"num_nextn_predict_layers": 0})])
def test_native_head_on_a_model_without_one_fails_clearly(tmp_path, family, overrides):
    model_dir = _backbone_dir(tmp_path, family, **overrides)
    with pytest.raises(HeadCheckpointError, match="ships an MTP head"):
        load_native_head(model_dir)


def test_load_head_rejects_parameters_of_another_family(tmp_path):
    out = export_head(make_head("qwen3"), tmp_path / "head")
    config = json.loads((out / "config.json").read_text())
    config["growmtp_family"] = "mimo"
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadCheckpointError, match="missing"):
        load_head(out)


def test_make_head_cli_writes_a_loadable_head_and_reports_bad_input(tmp_path, capsys):
    model_dir = _backbone_dir(tmp_path, "qwen3")
    assert make_head_main(["--backbone", str(model_dir), "--out", str(tmp_path / "h")]) == 0
    head = load_head(tmp_path / "h")
    reference = init_random_head_(make_head("qwen3"), seed=0)
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), reference.state_dict().values()))
    assert make_head_main(["--backbone", str(model_dir), "--out", str(tmp_path / "n"), "--native"]) == 2
    assert "ships an MTP head" in capsys.readouterr().err
    assert make_head_main(["--backbone", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")]) == 2


def test_make_head_cli_never_writes_over_a_directory_with_files(tmp_path, capsys):
    """A head's files have a model's names: `--out` pointing at the backbone (or any directory with files) would
    replace its config.json and model.safetensors. Refused before anything is read, every byte left as it was."""
    model_dir = _backbone_dir(tmp_path, "qwen3")
    before = {p.name: p.read_bytes() for p in model_dir.iterdir()}
    assert make_head_main(["--backbone", str(model_dir), "--out", str(model_dir)]) == 2
    assert f"--out {model_dir} exists and is not an empty directory" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in model_dir.iterdir()} == before
    (tmp_path / "a_file").write_text("kept")
    assert make_head_main(["--backbone", str(model_dir), "--out", str(tmp_path / "a_file")]) == 2
    assert (tmp_path / "a_file").read_text() == "kept"
    (tmp_path / "empty").mkdir()
    assert make_head_main(["--backbone", str(model_dir), "--out", str(tmp_path / "empty")]) == 0
    assert load_head(tmp_path / "empty") is not None


def test_an_export_cut_short_leaves_every_file_whole_and_a_nonfinite_head_is_named(tmp_path, monkeypatch):
    """The in-run export rewrites a head directory an engine or a reader may load from: each file is written
    beside its name and renamed onto it, so a write that fails half-way leaves the previous file, and no
    partial one. `nonfinite_tensors` names a head's NaN or infinite tensors (the launcher refuses such a head)."""
    from openrlhf_growmtp.core import checkpoint

    out = export_head(make_head("qwen3", seed=1), tmp_path / "head")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert checkpoint.nonfinite_tensors(out) == []

    def cut_short(state, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half a file")
        raise OSError("no space left on device")

    monkeypatch.setattr(checkpoint, "save_file", cut_short)
    with pytest.raises(OSError, match="no space left"):
        export_head(make_head("qwen3", seed=2), out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    monkeypatch.undo()
    poisoned = make_head("qwen3", seed=2)
    with torch.no_grad():
        poisoned.fc.weight[0, 0] = float("nan")
        poisoned.norm.weight[1] = float("inf")
    assert sorted(checkpoint.nonfinite_tensors(export_head(poisoned, out))) == ["fc.weight", "norm.weight"]
