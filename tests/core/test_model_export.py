"""growmtp-export: a run's checkpoint -> a served model directory; native layouts read back exactly, bad input
refused before anything is written, never a half-written directory."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from openrlhf_growmtp.cli.export import main as export_main
from openrlhf_growmtp.core import model_export
from openrlhf_growmtp.core.checkpoint import export_head, load_native_head, materialize_random_head
from openrlhf_growmtp.core.families import get_family
from openrlhf_growmtp.core.model_export import (NATIVE_HEAD_WEIGHTS, RUN_HEAD_DIR, SERVE_FILE, ExportError,
                                                export_model, read_serve_config)
from openrlhf_growmtp.core.whole_dir import MANIFEST, check_whole, write_manifest
from helpers.disk import FullDisk
from helpers.tiny import HIDDEN, backbone_modules, make_head, tiny_backbone_config

ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "mimo": "Qwen2ForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM"}
NATIVE_ROOT = {"mimo": "model.mtp_layers.", "qwen3_5": "mtp."}


def run_checkpoint(root, family, *, stale_native_head=False, sharded=False, wrapper=False, trained_k=3):
    """A run's final export as trainer/strategy.py writes it: the policy's HF files + growmtp_head/.

    stale_native_head: the policy's weights still hold the family's shipped MTP layers (a model class that
    carries them), which the grown head must replace. wrapper: a multimodal-style config (text_config)."""
    config = tiny_backbone_config(family)
    raw = config.to_dict()
    raw["architectures"] = [ARCHITECTURES[family]]
    if wrapper:
        raw = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": raw}
    final = root / "final"
    final.mkdir(parents=True)
    (final / "config.json").write_text(json.dumps(raw, indent=2))
    (final / "tokenizer.json").write_text('{"a tokenizer": true}')
    embed, lm_head = backbone_modules()
    tensors = {"model.embed_tokens.weight": embed.weight.detach().clone(), "lm_head.weight": lm_head.weight.detach(),
               "model.norm.weight": torch.ones(HIDDEN)}
    if stale_native_head:
        shipped = make_head(family, seed=7)
        prefix = get_family(family).native_prefix
        tensors.update({prefix + n: t.detach().clone() for n, t in shipped.state_dict().items()})
        extra = "1.extra.weight" if family == "mimo" else "layers.1.extra.weight"
        tensors[NATIVE_ROOT[family] + extra] = torch.ones(3)
    if sharded:
        names = sorted(tensors)
        shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
        for file, keys in shards.items():
            save_file({k: tensors[k].contiguous() for k in keys}, str(final / file), metadata={"format": "pt"})
        weight_map = {k: file for file, keys in shards.items() for k in keys}
        (final / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    else:
        save_file({k: t.contiguous() for k, t in tensors.items()}, str(final / "model.safetensors"),
                  metadata={"format": "pt"})
    head = make_head(family, seed=11)
    head = head.to(torch.bfloat16)  # a run exports its head in the policy's training dtype
    if trained_k is not None:
        head.config.growmtp_trained_k = trained_k
    export_head(head, final / RUN_HEAD_DIR)
    write_manifest(final)  # as the trainer's export ends (whole_dir.written_whole)
    return final, tensors


def all_tensors(model_dir):
    """Every tensor of a model directory, through its index when it has one (file name kept per tensor)."""
    index = model_dir / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
             else ["model.safetensors"])
    out = {}
    for file in files:
        with safe_open(str(model_dir / file), framework="pt") as f:
            for name in f.keys():
                assert name not in out, f"{name} is stored twice"
                out[name] = (file, f.get_tensor(name))
    return out


def test_qwen3_export_keeps_the_policy_and_puts_the_head_beside_it(tmp_path):
    final, _ = run_checkpoint(tmp_path, "qwen3")
    out = export_model(final, tmp_path / "served")
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (out / name).read_bytes() == (final / name).read_bytes(), name
    for name in ("config.json", "model.safetensors"):
        assert (out / RUN_HEAD_DIR / name).read_bytes() == (final / RUN_HEAD_DIR / name).read_bytes(), name
    serve = read_serve_config(out)
    assert serve["layout"] == "growmtp" and serve["k"] == serve["trained_k"] == 3
    assert serve["speculative_config"] == {"method": "eagle", "model": str((out / RUN_HEAD_DIR).resolve()),
                                           "num_speculative_tokens": 3, "draft_sample_method": "probabilistic"}
    assert json.loads((out / SERVE_FILE).read_text())["speculative_config"]["model"] == RUN_HEAD_DIR  # relocatable


@pytest.mark.parametrize("family,sharded,stale,wrapper", [
    ("mimo", False, False, False), ("mimo", True, True, False),
    ("qwen3_5", False, False, False), ("qwen3_5", True, True, True)],
    ids=["mimo", "mimo-sharded-stale-head", "qwen3_5", "qwen3_5-wrapper-sharded-stale-head"])
def test_native_export_reads_back_exactly_the_grown_head(tmp_path, family, sharded, stale, wrapper):
    final, policy = run_checkpoint(tmp_path, family, stale_native_head=stale, sharded=sharded, wrapper=wrapper)
    out = export_model(final, tmp_path / "served")
    grown = load_file(str(final / RUN_HEAD_DIR / "model.safetensors"))
    read_back = load_native_head(out).state_dict()
    assert read_back.keys() == grown.keys()
    assert all(torch.equal(read_back[n].to(grown[n].dtype), grown[n]) for n in grown)
    stored = all_tensors(out)
    root = NATIVE_ROOT[family]
    # every native tensor is the grown head's, in the head's own file, in its dtype; no shipped one is left
    native = {n: t for n, (file, t) in stored.items() if n.startswith(root)}
    assert {stored[n][0] for n in native} == {NATIVE_HEAD_WEIGHTS}
    assert all(t.dtype == torch.bfloat16 for t in native.values())
    assert len(native) == len(grown)
    # the policy's own tensors are untouched
    for name, tensor in policy.items():
        if not name.startswith(root):
            assert torch.equal(stored[name][1], tensor), name
    # the layout, written out by hand: MiMo's fc input is [hidden, embedding] (ours is [embedding, hidden])
    fc = grown["input_proj.weight" if family == "mimo" else "fc.weight"]
    if family == "mimo":
        assert torch.equal(native["model.mtp_layers.0.input_proj.weight"],
                           torch.cat([fc[:, HIDDEN:], fc[:, :HIDDEN]], 1))
        assert torch.equal(native["model.mtp_layers.0.self_attn.q_proj.weight"], grown["self_attn.q_proj.weight"])
    else:
        assert torch.equal(native["mtp.fc.weight"], fc)
        assert torch.equal(native["mtp.layers.0.self_attn.q_proj.weight"], grown["layers.0.self_attn.q_proj.weight"])
    config = json.loads((out / "config.json").read_text())
    text = config["text_config"] if wrapper else config
    assert text[get_family(family).native_layers_field] == 1
    if wrapper:
        assert get_family(family).native_layers_field not in config
    if family == "mimo":
        assert config["architectures"] == ["MiMoForCausalLM"]  # what vLLM's "mtp" method maps to MiMo's MTP model
    serve = read_serve_config(out)
    assert serve["layout"] == "native" and serve["speculative_config"] == {
        "method": "mtp", "num_speculative_tokens": 3, "draft_sample_method": "probabilistic"}
    assert (out / "tokenizer.json").read_bytes() == (final / "tokenizer.json").read_bytes()
    assert not (out / RUN_HEAD_DIR).exists()


def test_k_defaults_to_the_trained_depth_and_may_be_lowered(tmp_path):
    final, _ = run_checkpoint(tmp_path, "mimo")
    assert read_serve_config(export_model(final, tmp_path / "a"))["k"] == 3
    lowered = read_serve_config(export_model(final, tmp_path / "b", k=2))
    assert lowered["k"] == lowered["speculative_config"]["num_speculative_tokens"] == 2
    assert lowered["trained_k"] == 3


def _no_head(final, tmp_path):
    shutil.rmtree(final / RUN_HEAD_DIR)
    (final / MANIFEST).unlink()  # what is checked here is the head, not the manifest


def _other_family_head(final, tmp_path):
    shutil.rmtree(final / RUN_HEAD_DIR)
    head = make_head("mimo")
    head.config.growmtp_trained_k = 3
    export_head(head, final / RUN_HEAD_DIR)
    write_manifest(final)


def _narrower_head(final, tmp_path, field="hidden_size", value=96):
    shutil.rmtree(final / RUN_HEAD_DIR)
    materialize_random_head(tiny_backbone_config("qwen3", **{field: value}), final / RUN_HEAD_DIR)
    config = final / RUN_HEAD_DIR / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "growmtp_trained_k": 3}))
    write_manifest(final)


def _untrained_head(final, tmp_path):  # growmtp-make-head's: no growmtp_trained_k
    config = final / RUN_HEAD_DIR / "config.json"
    raw = json.loads(config.read_text())
    raw.pop("growmtp_trained_k")
    config.write_text(json.dumps(raw))
    write_manifest(final)


def _bad_head_tensor(final, tmp_path):
    weights = final / RUN_HEAD_DIR / "model.safetensors"
    state = load_file(str(weights))
    state["fc.weight"] = state["fc.weight"][:, :HIDDEN].contiguous()
    save_file(state, str(weights))
    write_manifest(final)


BAD_INPUTS = {
    "no_head": (_no_head, {}, r"no head to export .*growmtp_head"),
    "head_of_another_family": (_other_family_head, {}, r"is a mimo head, but the policy .* is a qwen3 model"),
    "head_of_another_width": (_narrower_head, {}, r"hidden_size = 96, but the policy .* needs 64"),
    "head_of_another_vocabulary": (lambda f, t: _narrower_head(f, t, "vocab_size", 101), {},
                                   r"vocab_size = 101, but the policy .* needs 97"),
    "k_deeper_than_trained": (None, {"k": 4}, r"--k 4: the head was trained to draft 3 tokens per cycle"),
    "k_below_one": (None, {"k": 0}, r"--k 0: .* must be an int >= 1"),
    "head_without_trained_k": (_untrained_head, {}, r"has no growmtp_trained_k .*pass --k"),
    "head_tensor_of_another_shape": (_bad_head_tensor, {}, r"fc.weight has shape \(64, 64\), the head expects"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_refused_before_anything_is_written(tmp_path, case):
    damage, kwargs, message = BAD_INPUTS[case]
    final, _ = run_checkpoint(tmp_path / "run", "qwen3")
    if damage is not None:
        damage(final, tmp_path)
    parent = tmp_path / "exports"
    parent.mkdir()
    with pytest.raises(ExportError, match=message):
        export_model(final, parent / "served", **kwargs)
    assert list(parent.iterdir()) == []


def test_an_existing_non_empty_output_directory_is_refused_and_left_alone(tmp_path):
    final, _ = run_checkpoint(tmp_path / "run", "qwen3")
    out = tmp_path / "served"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match=r"exists and is not empty"):
        export_model(final, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "served"]
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (export_model(final, empty) / SERVE_FILE).is_file()  # an empty directory is filled
    # inside the checkpoint: files its manifest does not list, so the checkpoint would no longer read back whole
    with pytest.raises(ExportError, match=r"is inside the checkpoint"):
        export_model(final, final / "served")
    assert not (final / "served").exists()
    # a link: the export renames a directory into place, which a link there would refuse only at the end
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ExportError, match=r"is a symbolic link"):
        export_model(final, tmp_path / "link")
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_a_failure_while_writing_leaves_no_directory(tmp_path, monkeypatch):
    final, _ = run_checkpoint(tmp_path / "run", "mimo", sharded=True)
    calls = []

    def failing_save(*args, **kwargs):  # the native head's file: after the policy's files were written
        calls.append(args[1])
        raise OSError("disk full")

    monkeypatch.setattr(model_export, "save_file", failing_save)
    parent = tmp_path / "exports"
    with pytest.raises(OSError, match="disk full"):
        export_model(final, parent / "served")
    assert calls and calls[0].endswith(NATIVE_HEAD_WEIGHTS)
    assert list(parent.iterdir()) == []


@pytest.mark.parametrize("family", ["qwen3", "mimo"])
def test_a_disk_full_at_every_write_of_an_export_leaves_the_earlier_export_whole(tmp_path, family):
    """growmtp-export (and `make serve`, which replaces its served export each time) over an earlier export, the
    disk filling at the start and in the middle of every file it writes (copies, the native head's safetensors,
    the index, growmtp_serve.json, the manifest): the earlier export stays whole, no staging directory is left."""
    final, _ = run_checkpoint(tmp_path / "run", family, sharded=family == "mimo")
    served = export_model(final, tmp_path / "out" / "served", k=2)
    before = {p.relative_to(served): p.read_bytes() for p in served.rglob("*") if p.is_file()}
    with FullDisk(tmp_path / "out", budget=None) as disk:
        export_model(final, tmp_path / "out" / "probe")
    assert len(disk.writes) >= 5 and disk.writes[-1][0].endswith(MANIFEST)
    for budget in disk.fill_points():
        with FullDisk(tmp_path / "out", budget), pytest.raises(OSError, match="No space left on device"):
            export_model(final, served, replace=True)
        assert {p.relative_to(served): p.read_bytes() for p in served.rglob("*") if p.is_file()} == before, budget
        assert check_whole(served) and read_serve_config(served)["k"] == 2
        assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["probe", "served"], budget
    with FullDisk(tmp_path / "out", budget=disk.total):
        export_model(final, served, replace=True)
    assert read_serve_config(served)["k"] == 3 and check_whole(served)


def _cut_policy(final):
    data = (final / "model.safetensors").read_bytes()
    (final / "model.safetensors").write_bytes(data[:len(data) // 2])


def _head_of_another_run(final):
    """The head of another run of the same policy: the same files, the same sizes, other weights."""
    head = make_head("qwen3", seed=12).to(torch.bfloat16)  # run_checkpoint's head is seed 11's
    head.config.growmtp_trained_k = 3
    export_head(head, final / RUN_HEAD_DIR)


@pytest.mark.parametrize("damage, says", [
    (_cut_policy, "model.safetensors has"),
    (_head_of_another_run, "growmtp_head/model.safetensors holds other bytes than were written with the rest"),
    (lambda final: (final / "model-00002-of-00002.safetensors").write_bytes(b"x"),
     "model-00002-of-00002.safetensors was not written with the rest"),
])
def test_a_run_export_cut_short_or_mixed_is_refused_by_growmtp_export_and_make_serve(tmp_path, capsys, damage, says):
    from openrlhf_growmtp.cli import serve

    run = tmp_path / "demo"
    final, _ = run_checkpoint(run / serve.ARM, "qwen3")
    assert final == run / serve.ARM / serve.FINAL
    damage(final)
    with pytest.raises(ExportError, match="not the directory that was written whole") as err:
        export_model(final, tmp_path / "served")
    assert says in str(err.value) and str(final) in str(err.value)
    assert export_main([str(final), str(tmp_path / "served")]) == 2
    assert serve.main(["--run", str(run)]) == 2  # `make serve` refuses before starting any server
    printed = capsys.readouterr().err
    assert printed.count(says) == 2 and "growmtp-serve:" in printed
    assert not (tmp_path / "served").exists() and not (run / serve.ARM / serve.SERVED).exists()


def test_an_export_without_a_manifest_is_still_checked_file_by_file(tmp_path):
    """An export written before manifests (or by hand) is read as it is, but a weight file cut short (the issue's
    329,748 of 659,496 bytes, written in place by a save the disk filled) is refused by name."""
    final, _ = run_checkpoint(tmp_path / "run", "qwen3")
    (final / MANIFEST).unlink()
    assert (export_model(final, tmp_path / "a") / SERVE_FILE).is_file()
    _cut_policy(final)
    with pytest.raises(ExportError, match=r"model.safetensors: cut short: its header places its tensors up to byte"):
        export_model(final, tmp_path / "b")
    data = (final / RUN_HEAD_DIR / "model.safetensors").read_bytes()
    (final / RUN_HEAD_DIR / "model.safetensors").write_bytes(data[:100])
    with pytest.raises(ExportError, match=r"growmtp_head/model.safetensors: not a whole safetensors file"):
        export_model(final, tmp_path / "c")


def test_make_serve_refuses_a_served_directory_changed_after_it_was_written(tmp_path, capsys):
    from openrlhf_growmtp.cli import serve

    final, _ = run_checkpoint(tmp_path / "run", "qwen3")
    served = export_model(final, tmp_path / "served")
    assert check_whole(served)
    (served / RUN_HEAD_DIR / "config.json").write_text("{}")
    assert serve.main(["--export", str(served)]) == 2
    assert f"{RUN_HEAD_DIR}/config.json has" in capsys.readouterr().err


def test_the_cli_prints_the_serve_command_and_refuses_with_a_message(tmp_path, capsys):
    final, _ = run_checkpoint(tmp_path / "run", "qwen3")
    assert export_main([str(final), str(tmp_path / "served")]) == 0
    printed = capsys.readouterr().out
    assert "VLLM_USE_V2_MODEL_RUNNER=0 vllm serve" in printed and '"method":"eagle"' in printed
    assert str(tmp_path / "served") in printed
    # as a module (the console script's target), on a checkpoint without a head (nor a manifest saying it had one)
    (final / RUN_HEAD_DIR / "config.json").unlink()
    (final / MANIFEST).unlink()
    done = subprocess.run([sys.executable, "-m", "openrlhf_growmtp.cli.export", str(final), str(tmp_path / "again")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "growmtp-export:" in done.stderr and "no head to export" in done.stderr
    assert not (tmp_path / "again").exists()


def test_read_serve_config_names_a_directory_that_is_not_an_export(tmp_path):
    with pytest.raises(ExportError, match="not written by growmtp-export"):
        read_serve_config(tmp_path)



def test_the_package_declares_the_console_script_and_the_vllm_plugin():
    """growmtp-export is a console script; the vLLM plugin that serves a Qwen3 head is an entry point of the
    installed package (vLLM loads `vllm.general_plugins` in every process it starts, a server's too)."""
    import importlib
    from importlib.metadata import entry_points
    from pathlib import Path

    setup = (Path(__file__).resolve().parents[2] / "setup.py").read_text()
    for line in ("growmtp-export = openrlhf_growmtp.cli.export:main", "growmtp = vllm_patches.plugin:register"):
        assert f'"{line}"' in setup, line
    assert importlib.import_module("openrlhf_growmtp.cli.export").main is export_main
    plugins = {ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert "vllm_patches.plugin:register" in plugins, plugins


@pytest.mark.skipif(shutil.which("jq") is None, reason="the README's line reads the export's config with jq")
def test_the_readmes_serve_line_names_the_head_by_an_absolute_path(tmp_path):
    """README's `vllm serve` line for a Qwen3 export, run from another directory with `vllm` replaced by a stand-in
    that prints its arguments: the speculative config it passes names the export's head wherever vLLM starts."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    line = next(line for line in readme.splitlines() if "vllm serve" in line and "growmtp_serve.json" in line)
    documented = line.split("=", 1)[1].split(";", 1)[0]  # the export directory the line names
    final, _ = run_checkpoint(tmp_path / "run", "qwen3")
    out = export_model(final, tmp_path / "served")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    script = 'vllm() { printf "%s\\n" "$@" "V2=$VLLM_USE_V2_MODEL_RUNNER"; }\n' + line.replace(documented, str(out))
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=elsewhere, timeout=60)
    assert done.returncode == 0, done.stderr
    args = done.stdout.splitlines()
    assert args[:2] == ["serve", str(out)] and args[2] == "--speculative-config"
    assert args[-1] == "V2=0"  # vLLM's V1 model runner, the one the head's model class is tested on
    config = json.loads(args[3])
    assert config == {**json.loads((out / SERVE_FILE).read_text())["speculative_config"],
                      "model": f"{out}/{RUN_HEAD_DIR}"}
    assert Path(config["model"]).is_absolute() and (Path(config["model"]) / "config.json").is_file()
