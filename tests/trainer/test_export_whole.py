"""The run's final export written whole (`GrowMTPStrategy.save_model`, one gloo rank, ZeRO-3): upstream's HF files
and the head into a temporary sibling, a manifest of both written last, renamed over the older export. Before, the
policy's files were written in place: a disk that filled left a half-written model.safetensors under its name
beside the older run's head."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import deepspeed
import pytest
import torch
from helpers.disk import FullDisk
from helpers.trainer import K, TOPK, prepared_actor, train_args
from safetensors.torch import load, load_file

from openrlhf_growmtp.core.model_export import export_model, read_serve_config
from openrlhf_growmtp.core.whole_dir import MANIFEST, check_whole
from openrlhf_growmtp.trainer.strategy import HEAD_EXPORT_DIR, head_of

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def tokenizer_of(policy_dir):
    """The policy's tokenizer files, saved through Python's writes (transformers' fast tokenizer writes
    tokenizer.json from Rust, which the simulated full disk would not reach)."""
    def save_pretrained(out):
        for name in TOKENIZER_FILES:
            if (policy_dir / name).is_file():
                (Path(out) / name).write_bytes((policy_dir / name).read_bytes())
    return SimpleNamespace(save_pretrained=save_pretrained)


def contents(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def prepared(single_rank, policy_dir, head_dir, tmp_path_factory):
    args = train_args(policy_dir, tmp_path_factory.mktemp("args"), "--growmtp_k", str(K), "--growmtp_topk", str(TOPK))
    args.growmtp.head_dir = str(head_dir)
    strategy, actor, _, _ = prepared_actor(args, policy_dir)
    return strategy, actor


def test_a_disk_full_at_every_write_of_the_final_export_leaves_the_older_export_whole(prepared, policy_dir, tmp_path):
    strategy, actor = prepared
    tokenizer = tokenizer_of(policy_dir)
    out = tmp_path / "final"
    strategy.save_model(actor, tokenizer, str(out))  # the older export
    assert check_whole(out) and (out / HEAD_EXPORT_DIR / "model.safetensors").is_file()
    before = contents(out)
    head = head_of(actor.model.module)
    with deepspeed.zero.GatheredParameters(list(head.parameters()), modifier_rank=0), torch.no_grad():
        for p in head.parameters():  # the head moved since: the new export differs from the older one
            p.add_(0.25)
    with FullDisk(tmp_path, budget=None) as disk:
        strategy.save_model(actor, tokenizer, str(tmp_path / "probe"))
    names = [Path(path).relative_to(tmp_path).parts[1:] for path, _ in disk.writes]
    # the policy's weights and config, the head's weights and config, the tokenizer's files, the manifest last
    assert ("model.safetensors",) in names and (HEAD_EXPORT_DIR, "model.safetensors.partial") in names
    assert (HEAD_EXPORT_DIR, "config.json.partial") in names and names[-1] == (MANIFEST,)
    for budget in disk.fill_points():
        with FullDisk(tmp_path, budget), pytest.raises(OSError, match="No space left on device"):
            strategy.save_model(actor, tokenizer, str(out))
        assert contents(out) == before, (budget, names)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["final", "probe"], budget  # its staging removed
    with FullDisk(tmp_path, budget=disk.total):
        strategy.save_model(actor, tokenizer, str(out))
    assert check_whole(out)
    # the new pair exports (growmtp-export checks it against its manifest), its head the moved one (tensors
    # compared: safetensors orders a header's metadata differently from one write to the next)
    served = export_model(out, tmp_path / "served")
    assert read_serve_config(served)["k"] == K
    exported = load_file(str(out / HEAD_EXPORT_DIR / "model.safetensors"))
    older = load(before[f"{HEAD_EXPORT_DIR}/model.safetensors"])
    with deepspeed.zero.GatheredParameters(list(head.parameters())):
        for name, p in head.named_parameters():
            assert torch.equal(exported[name], p.detach().cpu()) and not torch.equal(older[name], exported[name]), name
