"""A model or head named by a hub id resolves, like a local directory, to a directory of its files: its
snapshot in a huggingface_hub cache made here by hand (the hub offline), or an error naming the id."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import constants
from safetensors.torch import save_file
import torch

from helpers.hub_cache import add_to_hub_cache, commit_of
from helpers.tiny import tiny_backbone_config
from openrlhf_growmtp.hub import ModelLocationError, is_hub_id, local_dir

REPO = "TinyOrg/Tiny-Qwen3"
CONFIG = tiny_backbone_config("qwen3").to_dict()


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty cache this process's huggingface_hub reads, with the hub off."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def weights_bytes(tmp_path: Path) -> bytes:
    save_file({"w": torch.zeros(2)}, str(tmp_path / "w.safetensors"))
    return (tmp_path / "w.safetensors").read_bytes()


def test_a_hub_id_resolves_to_its_cached_snapshot(hub_cache):
    snapshot = add_to_hub_cache(hub_cache, REPO, {"config.json": CONFIG})
    resolved = local_dir(REPO)
    assert resolved.resolve() == snapshot.resolve()
    assert resolved.name == commit_of(REPO)  # the commit refs/main names
    assert json.loads((resolved / "config.json").read_text())["hidden_size"] == CONFIG["hidden_size"]


def test_an_id_the_cache_lacks_is_named_in_the_error(hub_cache):
    add_to_hub_cache(hub_cache, REPO, {"config.json": CONFIG})
    with pytest.raises(ModelLocationError) as err:
        local_dir("TinyOrg/Not-Cached")
    message = str(err.value)
    assert message.startswith("TinyOrg/Not-Cached: not a local directory") and "HF_HUB_OFFLINE=1" in message
    assert str(hub_cache) in message  # where it looked


def test_weights_are_asked_for_only_where_they_are_read(hub_cache, tmp_path):
    add_to_hub_cache(hub_cache, REPO, {"config.json": CONFIG})
    assert local_dir(REPO).is_dir()  # the startup checks read config.json only
    with pytest.raises(ModelLocationError, match=f"{REPO}: .*lacks model.safetensors or model.safetensors.index"):
        local_dir(REPO, weights=True)  # a native head's extraction reads the weights

    blob = weights_bytes(tmp_path)
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    sharded = "TinyOrg/Sharded"
    add_to_hub_cache(hub_cache, sharded, {"config.json": CONFIG, "model.safetensors.index.json": index,
                                          "model-00001-of-00002.safetensors": blob})
    with pytest.raises(ModelLocationError, match="lacks model-00002-of-00002.safetensors"):
        local_dir(sharded, weights=True)
    add_to_hub_cache(hub_cache, sharded, {"model-00002-of-00002.safetensors": blob})
    assert (local_dir(sharded, weights=True) / "model-00002-of-00002.safetensors").is_file()


def test_a_local_directory_is_itself_and_a_missing_path_is_not_looked_up(hub_cache, tmp_path):
    assert local_dir(tmp_path) == tmp_path
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelLocationError, match="not a directory"):
        local_dir(tmp_path / "file")
    for path in ("/no/such/model", "./relative", "runs/a/b"):
        assert not is_hub_id(path)
        with pytest.raises(ModelLocationError, match=f"{path}: no such local directory"):
            local_dir(path)
    assert is_hub_id("Qwen/Qwen3-4B") and is_hub_id("XiaomiMiMo/MiMo-7B-SFT")


def resolve_in_subprocess(name: str, env: dict) -> subprocess.CompletedProcess:
    """`local_dir(name)` in a fresh process whose huggingface_hub settings are `env` alone."""
    hub_settings = ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "HF_ENDPOINT")
    base = {key: value for key, value in os.environ.items() if key not in hub_settings}
    code = "import sys; from openrlhf_growmtp.hub import local_dir; print(local_dir(sys.argv[1]))"
    return subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True, timeout=120,
                          env={**base, **env})


def test_huggingface_hubs_own_environment_points_at_the_cache(tmp_path):
    # HF_HOME (the cache is its hub/) and HF_HUB_CACHE, read by huggingface_hub itself in a fresh process
    home = tmp_path / "hf_home"
    snapshot = add_to_hub_cache(home / "hub", REPO, {"config.json": CONFIG})
    result = resolve_in_subprocess(REPO, {"HF_HUB_OFFLINE": "1", "HF_HOME": str(home)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert Path(result.stdout.strip()).resolve() == snapshot.resolve()

    other = tmp_path / "other_cache"
    moved = add_to_hub_cache(other, REPO, {"config.json": CONFIG})
    result = resolve_in_subprocess(REPO, {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(other)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert Path(result.stdout.strip()).resolve() == moved.resolve()


def test_an_unreachable_hub_gives_an_error_naming_the_id(tmp_path):
    # the hub not off, but nothing listening where it is said to be: refused at once, no wait
    result = resolve_in_subprocess("TinyOrg/Nowhere", {"HF_HUB_OFFLINE": "0", "HF_HUB_CACHE": str(tmp_path),
                                                       "HF_ENDPOINT": "http://127.0.0.1:9"})
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert "ModelLocationError: TinyOrg/Nowhere: not a local directory" in last
    assert "the hub did not provide it" in last
