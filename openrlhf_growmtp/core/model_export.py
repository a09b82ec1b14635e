"""A run's checkpoint -> a Hugging Face model directory that vLLM serves with the grown head drafting.

A run's final export (`trainer/strategy.py`) is the policy's HF files plus `growmtp_head/`, the head in
this package's layout with the depth it was trained at (`growmtp_trained_k`). Two served layouts:

- *native* (families whose models ship MTP layers: MiMo, Qwen3.5): the head goes into the model's own
  weights under the family's native names and fc order (the exact inverse of `load_native_head`), and the
  config declares one MTP layer (`num_nextn_predict_layers` / `mtp_num_hidden_layers`). Stock vLLM
  serves it with `{"method": "mtp"}`.
- *growmtp* (Qwen3: no native head): the policy's files and the head directory side by side; vLLM serves
  it with `{"method": "eagle", "model": <dir>/growmtp_head}` through this package's vLLM plugin, which
  registers the head's model class in every vLLM process it starts (the `vllm.general_plugins` entry point).

`growmtp_serve.json` in the export says which, with the speculative config to serve it with. Everything
is checked before anything is written, the run's export read back against its manifest where it has one (the
trainer writes one: `whole_dir`), and the directory appears whole or not at all: it is written beside OUT_DIR
under a temporary name, with its own manifest, and renamed at the end (`whole_dir.written_whole`).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .checkpoint import (HEAD_CONFIG, HEAD_WEIGHTS, HeadCheckpointError, check_head_dir,
                         read_safetensors_header, resolve_backbone, to_native_state_dict)
from .families import HeadFamily
from .whole_dir import MANIFEST, check_whole, written_whole

MODEL_CONFIG, MODEL_WEIGHTS = "config.json", "model.safetensors"  # a model directory's (as a head directory's)
RUN_HEAD_DIR = "growmtp_head"  # where a run's export keeps its head (trainer/strategy.py HEAD_EXPORT_DIR)
TRAINED_K_FIELD = "growmtp_trained_k"
SERVE_FILE = "growmtp_serve.json"
NATIVE_HEAD_WEIGHTS = "model-growmtp-mtp.safetensors"  # the native head's tensors, listed in the index
WEIGHT_INDEX = "model.safetensors.index.json"
LAYOUT_NATIVE, LAYOUT_GROWMTP = "native", "growmtp"
# vLLM architectures whose "mtp" method reads the native layout (config/speculative.py maps them)
NATIVE_ARCHITECTURE = {"mimo": "MiMoForCausalLM"}


class ExportError(HeadCheckpointError):
    """A checkpoint, head or output directory the export refuses (the message says which and why)."""


@dataclass(frozen=True)
class ExportPlan:
    """Everything the export writes, decided (and checked) before anything is written."""

    checkpoint: Path
    head_dir: Path
    out_dir: Path
    family: HeadFamily
    raw_config: dict  # the policy's config.json
    weight_files: list[Path]  # the policy's safetensors files
    k: int  # the depth the export is served at
    trained_k: int | None

    @property
    def layout(self) -> str:
        return LAYOUT_NATIVE if self.family.native_prefix is not None else LAYOUT_GROWMTP


def plan_export(checkpoint: str | Path, out_dir: str | Path, head_dir: str | Path | None = None,
                k: int | None = None, replace: bool = False) -> ExportPlan:
    """Check a run's checkpoint, its head and the output directory; raises ExportError naming the problem.
    `replace`: OUT_DIR may hold an earlier export of this function's (replaced whole)."""
    checkpoint, out = Path(checkpoint), Path(out_dir)
    if not (checkpoint / MODEL_CONFIG).is_file():
        raise ExportError(f"{checkpoint}: no config.json; CHECKPOINT is a run's final export (its --ckpt.output_dir)")
    _check_out_dir(out, checkpoint, replace)
    try:
        check_whole(checkpoint)  # where the trainer wrote its manifest: a file cut short or mixed in is named
    except ValueError as err:
        raise ExportError(str(err)) from None
    head_dir = checkpoint / RUN_HEAD_DIR if head_dir is None else Path(head_dir)
    if not (head_dir / HEAD_CONFIG).is_file():
        raise ExportError(f"{checkpoint}: no head to export ({head_dir} has no config.json); a GrowMTP run's "
                          f"export keeps its head in {RUN_HEAD_DIR}/ (an autoregressive run, --growmtp_k 0, has "
                          "none), or pass --head")
    try:
        family, text, raw = resolve_backbone(checkpoint)
        # family, shapes, every tensor against them, finite; then the depth; the policy's weight files whole
        head_config = check_head_dir(head_dir, (family, text, str(checkpoint)))
        trained_k, k = _served_depth(head_dir, getattr(head_config, TRAINED_K_FIELD, None), k)
        weight_files = _policy_weight_files(checkpoint)
        for path in weight_files:
            read_safetensors_header(path)
    except ValueError as err:  # HeadCheckpointError, or a backbone no head family serves
        raise ExportError(str(err)) from None
    return ExportPlan(checkpoint, head_dir, out, family, raw, weight_files, k, trained_k)


def _check_out_dir(out: Path, checkpoint: Path, replace: bool) -> None:
    if out.is_symlink():  # the export renames a directory into place: a link there would fail only at the end
        raise ExportError(f"{out} is a symbolic link; give the directory it points to, or a new path")
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (replace and (out / SERVE_FILE).is_file()):
        raise ExportError(f"{out} exists and is not empty; the export writes a new directory (remove it, or "
                          "choose another OUT_DIR)")
    if out.resolve() == checkpoint.resolve():
        raise ExportError(f"OUT_DIR is the checkpoint itself ({checkpoint}); choose another directory")
    if checkpoint.resolve() in out.resolve().parents:  # files its manifest does not list: it would no longer read whole
        raise ExportError(f"OUT_DIR {out} is inside the checkpoint {checkpoint}; choose a directory outside it")


def _served_depth(head_dir: Path, trained_k, k: int | None) -> tuple[int | None, int]:
    """(trained K, served K): K defaults to the trained depth and may not exceed it."""
    if trained_k is not None and (isinstance(trained_k, bool) or not isinstance(trained_k, int) or trained_k < 1):
        raise ExportError(f"{head_dir}/config.json: {TRAINED_K_FIELD} = {trained_k!r} is not a depth >= 1")
    if k is None:
        if trained_k is None:
            raise ExportError(f"{head_dir}/config.json has no {TRAINED_K_FIELD} (not a run's export): pass --k, the "
                              "number of tokens to draft per cycle")
        return trained_k, trained_k
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ExportError(f"--k {k!r}: the number of draft tokens per cycle must be an int >= 1")
    if trained_k is not None and k > trained_k:
        raise ExportError(f"--k {k}: the head was trained to draft {trained_k} tokens per cycle; drafts past "
                          f"position {trained_k} were never trained. Serve it at K <= {trained_k}")
    return trained_k, k


def _policy_weight_files(checkpoint: Path) -> list[Path]:
    index = checkpoint / WEIGHT_INDEX
    if index.is_file():
        files = [checkpoint / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    elif (checkpoint / MODEL_WEIGHTS).is_file():
        files = [checkpoint / MODEL_WEIGHTS]
    else:
        raise ExportError(f"{checkpoint}: no {MODEL_WEIGHTS} or {WEIGHT_INDEX} (the export reads safetensors only)")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ExportError(f"{checkpoint}: {WEIGHT_INDEX} lists missing files {missing}")
    return files


# ---- writing -------------------------------------------------------------------------------------------
def export_model(checkpoint: str | Path, out_dir: str | Path, head_dir: str | Path | None = None,
                 k: int | None = None, replace: bool = False) -> Path:
    """Check, then write the served directory whole (`whole_dir.written_whole`: a temporary sibling with a
    manifest, renamed over OUT_DIR at the end; `replace`: an earlier export there is replaced). Returns it."""
    plan = plan_export(checkpoint, out_dir, head_dir, k, replace)
    with written_whole(plan.out_dir) as staging:
        _write(plan, staging)
    return plan.out_dir


def _write(plan: ExportPlan, out: Path) -> None:
    weight_names = {f.name for f in plan.weight_files} | {WEIGHT_INDEX, MODEL_CONFIG}
    for item in sorted(plan.checkpoint.iterdir()):  # tokenizer, generation config, ...
        if item.is_file() and item.name not in weight_names and item.name != MANIFEST:
            shutil.copy2(item, out / item.name)
    if plan.layout == LAYOUT_NATIVE:
        _write_native_weights(plan, out)
        config = _declare_native_layer(plan.raw_config, plan.family)
        (out / MODEL_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        speculative = {"method": "mtp"}
    else:  # the policy as it is, and the head beside it
        for name in sorted(weight_names):
            if (plan.checkpoint / name).is_file():
                shutil.copy2(plan.checkpoint / name, out / name)
        (out / RUN_HEAD_DIR).mkdir()
        for name in (HEAD_CONFIG, HEAD_WEIGHTS):
            shutil.copy2(plan.head_dir / name, out / RUN_HEAD_DIR / name)
        speculative = {"method": "eagle", "model": RUN_HEAD_DIR}
    # Sampled drafts (verified by standard rejection sampling, vLLM's default) as in the run's rollouts, so
    # that acceptance is the run's; greedy requests still draft and verify by argmax.
    speculative.update(num_speculative_tokens=plan.k, draft_sample_method="probabilistic")
    serve = {"family": plan.family.name, "layout": plan.layout, "k": plan.k, "trained_k": plan.trained_k,
             "speculative_config": speculative,
             "source": {"checkpoint": str(plan.checkpoint.resolve()), "head": str(plan.head_dir.resolve())}}
    (out / SERVE_FILE).write_text(json.dumps(serve, indent=2) + "\n")


def _write_native_weights(plan: ExportPlan, out: Path) -> None:
    """The policy's files (any native head tensors they already hold dropped: the grown head replaces them),
    the head's tensors in one more file under the native names, and an index over all of them."""
    # every native MTP layer the policy may hold (MiMo's "model.mtp_layers.<i>.", Qwen3.5's "mtp.")
    root = plan.family.native_prefix.removesuffix("0.")
    weight_map, total = {}, 0
    for path in plan.weight_files:
        sizes = tensor_bytes(path)
        kept = [name for name in sizes if not name.startswith(root)]
        if len(kept) == len(sizes):
            shutil.copy2(path, out / path.name)
        else:
            with safe_open(str(path), framework="pt") as f:
                save_file({name: f.get_tensor(name) for name in kept}, str(out / path.name), metadata=f.metadata())
        weight_map.update({name: path.name for name in kept})
        total += sum(sizes[name] for name in kept)
    # the head's tensors as stored (their dtype too), renamed; fc halves swapped where the family's order is [h, e]
    native = to_native_state_dict(load_file(str(plan.head_dir / HEAD_WEIGHTS)), plan.family)
    save_file(native, str(out / NATIVE_HEAD_WEIGHTS), metadata={"format": "pt"})
    weight_map.update({name: NATIVE_HEAD_WEIGHTS for name in native})
    total += sum(t.numel() * t.element_size() for t in native.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / WEIGHT_INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _declare_native_layer(raw_config: dict, family: HeadFamily) -> dict:
    """The policy's config declaring one native MTP layer (where the config keeps its text fields), with the
    architecture vLLM's "mtp" method maps to the family's MTP model."""
    config, field = dict(raw_config), family.native_layers_field
    text = config.get("text_config")
    if isinstance(text, dict) and (field in text or field not in config):
        config["text_config"] = {**text, field: 1}
    else:
        config[field] = 1
    if family.name in NATIVE_ARCHITECTURE:
        config["architectures"] = [NATIVE_ARCHITECTURE[family.name]]
    return config


def tensor_bytes(path: Path) -> dict[str, int]:
    """Tensor name -> bytes, from a safetensors header, without reading the data."""
    return {name: end - start for name, meta in read_safetensors_header(path).items() if name != "__metadata__"
            for start, end in [meta["data_offsets"]]}


def check_served(export_dir: str | Path) -> dict:
    """A served directory read back whole against its manifest (growmtp-export writes one), then its
    growmtp_serve.json (`read_serve_config`); ExportError naming what is cut short or mixed in."""
    try:
        check_whole(export_dir)
    except ValueError as err:
        raise ExportError(str(err)) from None
    return read_serve_config(export_dir)


def read_serve_config(export_dir: str | Path) -> dict:
    """An export's growmtp_serve.json, with the speculative config's head path made absolute."""
    export_dir = Path(export_dir)
    path = export_dir / SERVE_FILE
    if not path.is_file():
        raise ExportError(f"{export_dir}: no {SERVE_FILE}; not written by growmtp-export")
    serve = json.loads(path.read_text())
    speculative = dict(serve["speculative_config"])
    if "model" in speculative:
        speculative["model"] = str((export_dir / speculative["model"]).resolve())
    return {**serve, "speculative_config": speculative}
