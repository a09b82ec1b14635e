"""Head checkpoints: random materialisation, native heads inside full model checkpoints, export.

A head directory holds `config.json` (the config of the head's single decoder layer, with
`growmtp_family`) and `model.safetensors` (the head's own parameters under the native names, fc in our
[e, h] input order). Trainer, engine and export all read this one format. A native export writes the
names and fc order of the family's full-model checkpoint instead. `check_head_dir` checks one whole (its
config against a policy's, every tensor against its config, every value finite) before anything loads it.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import PretrainedConfig

from .head_files import (HEAD_CONFIG, HEAD_WEIGHTS, HeadCheckpointError, check_shapes,  # noqa: F401 (names
                         naming_errors, nonfinite_tensors, read_safetensors_header)  # checkpoint's callers read)
from .families import HeadFamily, family_for_backbone, family_for_model_type, get_family
from .head import MTPHead
from .head_config import HEAD_CONFIG_FIELD, make_head_config, native_fc_to_ours, ours_fc_to_native

# what must agree between a head's config and the one its policy implies (the named shapes of the head)
HEAD_SHAPE_FIELDS = ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "intermediate_size")


# ---- backbone configs --------------------------------------------------------------------------------
def resolve_backbone(backbone: str | Path | PretrainedConfig) -> tuple[HeadFamily, PretrainedConfig, dict]:
    """(family, text config, raw config dict) of a backbone given as a config or a model directory.

    Reads only config.json, so it works for families transformers has no class for (MiMo) and never
    touches the hub.
    """
    if isinstance(backbone, PretrainedConfig):
        raw = backbone.to_dict()
        family = family_for_backbone(backbone)
        text = backbone.get_text_config() if hasattr(backbone, "get_text_config") else backbone
        return family, text, raw
    path = Path(backbone) / HEAD_CONFIG
    if not path.is_file():
        raise HeadCheckpointError(f"{path}: no config.json; pass a local model directory")
    raw = json.loads(path.read_text())
    fields = dict(raw.get("text_config") or raw)
    family = family_for_model_type(raw.get("model_type"), fields.get("model_type"))
    for key in ("model_type", "architectures", "transformers_version", "auto_map"):
        fields.pop(key, None)
    return family, family.config_class(**fields), raw


def head_config_for(backbone: str | Path | PretrainedConfig) -> PretrainedConfig:
    family, text, _ = resolve_backbone(backbone)
    return make_head_config(text, family)


def check_text_only(model_dir: str | Path) -> None:
    """Refuse a checkpoint with a vision tower: GrowMTP trains and serves text-only models (for Qwen3.5 the
    `Qwen3_5ForCausalLM` checkpoint, model_type `qwen3_5_text`), and a multimodal wrapper would be served
    as a different model (with its image path) than the head was built for."""
    path = Path(model_dir) / HEAD_CONFIG
    raw = json.loads(path.read_text()) if path.is_file() else {}
    if raw.get("vision_config") is not None:
        raise HeadCheckpointError(
            f"{model_dir}: a checkpoint with a vision tower (vision_config; architectures "
            f"{raw.get('architectures')}); GrowMTP needs the text-only model: save its language model as its own "
            "checkpoint (for Qwen3.5: Qwen3_5ForCausalLM, model_type qwen3_5_text, with the mtp.* weights)")


def native_head_layers(family: HeadFamily, raw_config: dict) -> int:
    """How many native MTP layers a backbone's raw config declares (0 when it ships none)."""
    if family.native_layers_field is None:
        return 0
    field_name = family.native_layers_field
    return int(raw_config.get(field_name, (raw_config.get("text_config") or {}).get(field_name)) or 0)


# ---- random heads ------------------------------------------------------------------------------------
@torch.no_grad()
def init_random_head_(head: MTPHead, seed: int = 0) -> MTPHead:
    """From-scratch init, in place: every Linear ~ N(0, initializer_range), biases 0, RMSNorms scale 1.

    Deterministic: one generator seeded with `seed`, modules visited in sorted name order.
    """
    std = float(head.config.initializer_range)
    unit = head.family.norm_unit_weight
    generator = torch.Generator().manual_seed(seed)
    for name, module in sorted(head.named_modules(), key=lambda item: item[0]):
        if isinstance(module, nn.Linear):
            weight = torch.empty(module.weight.shape, dtype=torch.float32)
            weight.normal_(0.0, std, generator=generator)
            module.weight.copy_(weight)
            if module.bias is not None:
                module.bias.zero_()
        elif type(module).__name__.endswith("RMSNorm"):
            module.weight.fill_(unit)
    return head


def materialize_random_head(backbone: str | Path | PretrainedConfig, out_dir: str | Path, seed: int = 0,
                            dtype: torch.dtype = torch.float32) -> Path:
    """Write a from-scratch head for `backbone` to out_dir once; trainer and engine both load it."""
    config = head_config_for(backbone)
    head = init_random_head_(MTPHead(config), seed=seed).to(dtype)
    return export_head(head, out_dir)


# ---- head directories ----------------------------------------------------------------------------------
def export_head(head: MTPHead, out_dir: str | Path, native: bool = False) -> Path:
    """Write the head as a standalone directory (config.json + model.safetensors).

    native=True writes the family's full-checkpoint names (with its prefix) and fc order instead. Each file
    is written beside its name and then renamed onto it: an export cut short leaves every file whole, the
    previous one or the new one (an engine or a reader of the directory never sees half a file).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().cpu().contiguous() for name, t in head.state_dict().items()}
    if native:
        state = to_native_state_dict(state, head.family)
    with _replacing(out / HEAD_WEIGHTS) as partial:
        save_file(state, str(partial), metadata={"format": "pt", HEAD_CONFIG_FIELD: head.family.name,
                                                 "layout": "native" if native else "growmtp"})
    config = head.config.to_dict()
    config.pop("_attn_implementation", None)
    config["torch_dtype"] = str(next(head.parameters()).dtype).removeprefix("torch.")
    with _replacing(out / HEAD_CONFIG) as partial:
        partial.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


@contextlib.contextmanager
def _replacing(path: Path):
    """A path to write instead of `path`, renamed onto it once written (removed if the writing fails)."""
    partial = path.with_name(path.name + ".partial")
    try:
        yield partial
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)



def check_head_dir(head_dir: str | Path, policy: tuple[HeadFamily, PretrainedConfig, str] | None = None,
                   ) -> PretrainedConfig:
    """A head directory checked whole before anything loads it; returns its config. With `policy` (family, text
    config, where it is), the head's family and every shape of its config must be the ones that policy implies
    (`check_head_fits`); every tensor the config implies must be in its weight file, of that shape, and finite.
    Reads each tensor once; HeadCheckpointError naming the file and what is wrong."""
    config = read_head_config(head_dir)
    if policy is not None:
        check_head_fits(config, Path(head_dir), *policy)
    weights = Path(head_dir) / HEAD_WEIGHTS
    header = read_safetensors_header(weights)
    check_shapes(_shapes_of(config, Path(head_dir) / HEAD_CONFIG), {
        name: tuple(meta["shape"]) for name, meta in header.items() if name != "__metadata__"}, weights, config)
    if bad := nonfinite_tensors(head_dir):
        raise HeadCheckpointError(f"{weights} holds non-finite values in {bad}: a diverged head would draft in every "
                                  "engine")
    return config


def check_head_fits(config: PretrainedConfig, head_dir: Path, family: HeadFamily, text: PretrainedConfig,
                    where: str) -> None:
    """The head of `config` (at head_dir) drafts for the policy of `family` and text config `text` (at `where`):
    the same family, every named shape field (HEAD_SHAPE_FIELDS) and every tensor shape the two configs imply."""
    head_family = getattr(config, HEAD_CONFIG_FIELD)
    if head_family != family.name:
        raise HeadCheckpointError(f"{head_dir} is a {head_family} head, but the policy at {where} is a {family.name} "
                                  "model: a head drafts only for its own family")
    expected = make_head_config(text, family)
    for name in HEAD_SHAPE_FIELDS:
        have, want = getattr(config, name, None), getattr(expected, name, None)
        if have != want:
            raise HeadCheckpointError(f"{head_dir / HEAD_CONFIG}: {name} = {have}, but the policy at {where} needs "
                                      f"{want}: this head was not grown for this policy")
    source = head_dir / HEAD_CONFIG
    check_shapes(_shapes_of(expected, source), _shapes_of(config, source), source, expected)


def _shapes_of(config: PretrainedConfig, source: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in the head a config builds (on the meta device: nothing allocated)."""
    try:
        with torch.device("meta"):
            return {name: tuple(t.shape) for name, t in MTPHead(config).state_dict().items()}
    except Exception as err:  # any config the layer classes refuse, in their words
        raise HeadCheckpointError(f"{source}: builds no head ({type(err).__name__}: {err})") from None


def read_head_config(head_dir: str | Path) -> PretrainedConfig:
    path = Path(head_dir) / HEAD_CONFIG
    if not path.is_file():
        raise HeadCheckpointError(f"{path}: not a head directory (no config.json)")
    try:
        raw = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise HeadCheckpointError(f"{path}: not JSON ({err}): cut short, or not a head's config") from None
    if not isinstance(raw, dict) or HEAD_CONFIG_FIELD not in raw:
        raise HeadCheckpointError(f"{path}: no {HEAD_CONFIG_FIELD!r} field; not written by growmtp-make-head "
                                  "or export_head")
    try:
        family = get_family(raw[HEAD_CONFIG_FIELD])
    except ValueError as err:
        raise HeadCheckpointError(f"{path}: {err}") from None
    fields = {k: v for k, v in raw.items() if k not in ("model_type", "transformers_version")}
    return family.config_class(**fields)


def load_head(head_dir: str | Path, embed_tokens: nn.Module | None = None, lm_head: nn.Module | None = None,
              dtype: torch.dtype | None = None) -> MTPHead:
    """Build a head from a head directory and bind it to the backbone's embedding and lm_head."""
    config = read_head_config(head_dir)
    head = MTPHead(config, embed_tokens, lm_head)
    state = _read_safetensors(Path(head_dir) / HEAD_WEIGHTS)
    _load_exact(head, state, Path(head_dir) / HEAD_WEIGHTS)
    return head.to(dtype) if dtype is not None else head


def _load_exact(head: MTPHead, state: dict[str, torch.Tensor], source: Path) -> None:
    check_shapes({name: tuple(t.shape) for name, t in head.state_dict().items()},
                  {name: tuple(t.shape) for name, t in state.items()}, source, head.config)
    head.load_state_dict(state)


def _read_safetensors(path: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    read_safetensors_header(path)  # whole, or a sentence saying why not
    with naming_errors(path), safe_open(str(path), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys() if name.startswith(prefix)}


# ---- native heads --------------------------------------------------------------------------------------
def to_native_state_dict(state: dict[str, torch.Tensor], family: HeadFamily) -> dict[str, torch.Tensor]:
    if family.native_prefix is None:
        raise HeadCheckpointError(f"the {family.name} family ships no native head layout")
    out = {}
    for name, tensor in state.items():
        if name == f"{family.fc_name}.weight":
            tensor = ours_fc_to_native(tensor, family)
        out[family.native_prefix + name] = tensor
    return out


def from_native_state_dict(state: dict[str, torch.Tensor], family: HeadFamily) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state.items():
        local = name[len(family.native_prefix):]
        if local == f"{family.fc_name}.weight":
            tensor = native_fc_to_ours(tensor, family)
        out[local] = tensor
    return out


def load_native_head(model_dir: str | Path, embed_tokens: nn.Module | None = None,
                     lm_head: nn.Module | None = None, dtype: torch.dtype | None = None) -> MTPHead:
    """The native MTP head shipped inside a full model checkpoint (Qwen3.5 `mtp.*`, MiMo `model.mtp_layers.0.*`)."""
    family, text, raw = resolve_backbone(model_dir)
    if family.native_prefix is None or native_head_layers(family, raw) < 1:
        raise HeadCheckpointError(
            f"{model_dir}: --growmtp_head native needs a model that ships an MTP head, but this {family.name} "
            f"checkpoint declares none ({family.native_layers_field or 'no native layout'}); use 'random'")
    head = MTPHead(make_head_config(text, family), embed_tokens, lm_head)
    state = {}
    for shard in _weight_files(Path(model_dir)):
        state.update(_read_safetensors(shard, family.native_prefix))
    if not state:
        raise HeadCheckpointError(f"{model_dir}: no tensors under {family.native_prefix!r} in the checkpoint")
    _load_exact(head, from_native_state_dict(state, family), Path(model_dir))
    return head.to(dtype) if dtype is not None else head


def native_head_tensor_names(model_dir: str | Path) -> list[str] | None:
    """The native head's tensor names in a full checkpoint, read from the safetensors headers only (no
    tensor is loaded); empty when the family has no native layout or the checkpoint holds none; None for a
    directory without weight files (a config-only directory: nothing to read)."""
    family, _, _ = resolve_backbone(model_dir)
    if family.native_prefix is None:
        return []
    if not any((Path(model_dir) / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json")):
        return None
    names = []
    for shard in _weight_files(Path(model_dir)):
        with safe_open(str(shard), framework="pt") as f:
            names += [name for name in f.keys() if name.startswith(family.native_prefix)]
    return names


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / name for name in names]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise HeadCheckpointError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
