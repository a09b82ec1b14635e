"""A model or head named by a local directory or by a Hugging Face hub id, as upstream OpenRLHF accepts both.

GrowMTP's startup checks and its head materialisation read a model's own files (config.json; the
safetensors weights for a native head), so they need a directory. `local_dir` is the one place that turns
a name into one:

- an existing directory is itself;
- a hub id (`org/name`) is its snapshot in the huggingface_hub cache, looked up there first; where the
  cache lacks it (or the files asked for) and the hub is reachable, those files are fetched into the cache.
  huggingface_hub's own settings apply: `HF_HUB_CACHE` / `HF_HOME` (where the cache is), `HF_HUB_OFFLINE=1`
  (never ask the hub), `HF_TOKEN` (gated models).

Only the files GrowMTP reads are fetched here (config.json, and the weights where asked); upstream
loads the model by its id as before, from the same cache.
"""

from __future__ import annotations

import json
from pathlib import Path

MODEL_CONFIG = "config.json"
SINGLE_WEIGHTS, WEIGHTS_INDEX = "model.safetensors", "model.safetensors.index.json"
WEIGHT_PATTERNS = ["model*.safetensors", WEIGHTS_INDEX]  # a single file, or the index and its shards


class ModelLocationError(ValueError):
    """A model or head name that is neither a local directory nor a hub id the cache or the hub can serve."""


def local_dir(name: str | Path, weights: bool = False) -> Path:
    """A local directory holding `name`'s files: `name` itself when it is a directory, else the hub-cache
    snapshot of the hub id `name` with config.json (and, with `weights`, its safetensors weights),
    fetched first when the cache lacks them and the hub is reachable. Raises ModelLocationError naming
    `name` when neither can provide it."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ModelLocationError(f"{name}: not a directory")
    if not is_hub_id(str(name)):
        raise ModelLocationError(f"{name}: no such local directory (and not a hub id of the form org/name)")
    return _hub_snapshot(str(name), weights)


def is_hub_id(name: str) -> bool:
    """Whether `name` is spelled as a hub repository id (`org/name` or `name`; never a path with ./, ~ or /)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def missing_files(directory: Path, weights: bool) -> list[str]:
    """What of config.json (and, with `weights`, the safetensors weights) `directory` lacks."""
    missing = [] if (directory / MODEL_CONFIG).is_file() else [MODEL_CONFIG]
    if not weights:
        return missing
    if (directory / SINGLE_WEIGHTS).is_file():
        return missing
    index = directory / WEIGHTS_INDEX
    if not index.is_file():
        return missing + [f"{SINGLE_WEIGHTS} or {WEIGHTS_INDEX}"]
    shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
    return missing + [shard for shard in shards if not (directory / shard).is_file()]


def _hub_snapshot(repo_id: str, weights: bool) -> Path:
    import httpx
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    wanted = "config.json and weights" if weights else "config.json"
    patterns = [MODEL_CONFIG] + (WEIGHT_PATTERNS if weights else [])
    try:  # the cache first: no network call, whatever HF_HUB_OFFLINE says; complete in the files we read
        cached = Path(snapshot_download(repo_id, local_files_only=True, allow_patterns=patterns))
        lacking = missing_files(cached, weights)
        if not lacking:
            return cached
        in_cache = f"its cached snapshot {cached} lacks {', '.join(lacking)}"
    except LocalEntryNotFoundError:  # IncompleteSnapshotError included
        in_cache = f"the Hugging Face cache ({constants.HF_HUB_CACHE}) has no snapshot of it"
    if constants.HF_HUB_OFFLINE:
        raise ModelLocationError(
            f"{repo_id}: not a local directory, and {in_cache}; the hub is off (HF_HUB_OFFLINE=1). Fetch its "
            f"{wanted} where the hub is reachable (`hf download {repo_id}`, into the same HF_HUB_CACHE), or pass "
            "a local model directory")
    try:
        fetched = Path(snapshot_download(repo_id, allow_patterns=patterns))
    except (OSError, httpx.HTTPError) as err:  # hub errors are OSErrors; an unreachable hub: LocalEntryNotFound
        reason = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ModelLocationError(f"{repo_id}: not a local directory, {in_cache}, and the hub did not provide it "
                                 f"({type(err).__name__}: {reason})") from err
    lacking = missing_files(fetched, weights)
    if lacking:
        raise ModelLocationError(f"{repo_id}: the hub's snapshot {fetched} has no {', '.join(lacking)}")
    return fetched
