"""The per-family table of the MTP head.

One head implementation serves every family; everything that differs between families is a field
of `HeadFamily`, never a branch spread through the code:

- which transformers classes build the decoder layer, its RMSNorm and its rotary embedding;
- the parameter names of the native checkpoint (so one state dict serves trainer, engine and export);
- the concat order of the native fc (our implementation always computes `fc(cat[e, h])`; a native
  `[h, e]` checkpoint has its fc halves swapped on load and swapped back on export);
- whether the state fed back to the next draft position is the layer output before or after the final norm;
- whether the token embedding is zeroed at absolute position 0 (MiMo's and DeepSeek's MTP do this);
- the RMSNorm weight that means "scale 1" (Qwen3.5 norms compute `x * (1 + w)`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn
from transformers import PretrainedConfig
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen2.configuration_qwen2 import Qwen2Config
from transformers.models.qwen3 import modeling_qwen3
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config
from transformers.models.qwen3_5 import modeling_qwen3_5
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

CONCAT_EH = "eh"  # fc(cat[norm_e(embed), norm_h(hidden)]) -- the order our implementation computes
CONCAT_HE = "he"  # fc(cat[norm_h(hidden), norm_e(embed)]) -- MiMo's native order
FEED_PRE_NORM = "pre_norm"
FEED_POST_NORM = "post_norm"


@dataclass(frozen=True)
class HeadFamily:
    name: str
    config_class: type[PretrainedConfig]
    layer_class: Callable[..., nn.Module]  # (config, layer_idx) -> decoder layer
    norm_class: Callable[..., nn.Module]  # (hidden_size, eps) -> RMSNorm
    rotary_class: Callable[..., nn.Module]  # (config) -> rotary embedding returning (cos, sin)
    apply_rotary: Callable  # the layer's (q, k, cos, sin) -> (q, k) RoPE, for keys computed without attention
    # parameter names inside the head (= native checkpoint names with `native_prefix` stripped)
    fc_name: str
    norm_embedding_name: str
    norm_hidden_name: str
    final_norm_name: str
    layer_prefix: str  # "" puts the decoder layer's parameters at the head's top level (MiMo)
    native_prefix: str | None  # where the head lives inside a full model checkpoint; None: no native head
    native_concat: str
    feed_back: str
    zero_embed_at_position_0: bool
    norm_unit_weight: float
    # name of the config field that says how many native MTP layers a full model ships
    native_layers_field: str | None


FAMILIES: dict[str, HeadFamily] = {
    # Qwen3-4B ships no head: it is built from scratch, with Qwen3.5's names and concat order.
    "qwen3": HeadFamily(
        name="qwen3",
        config_class=Qwen3Config,
        layer_class=modeling_qwen3.Qwen3DecoderLayer,
        norm_class=modeling_qwen3.Qwen3RMSNorm,
        rotary_class=modeling_qwen3.Qwen3RotaryEmbedding,
        apply_rotary=modeling_qwen3.apply_rotary_pos_emb,
        fc_name="fc",
        norm_embedding_name="pre_fc_norm_embedding",
        norm_hidden_name="pre_fc_norm_hidden",
        final_norm_name="norm",
        layer_prefix="layers.0",
        native_prefix=None,
        native_concat=CONCAT_EH,
        feed_back=FEED_PRE_NORM,
        zero_embed_at_position_0=False,
        norm_unit_weight=1.0,
        native_layers_field=None,
    ),
    # Qwen3.5-4B-Base: `mtp.*` inside the model checkpoint, full-attention Qwen3.5 layer.
    "qwen3_5": HeadFamily(
        name="qwen3_5",
        config_class=Qwen3_5TextConfig,
        layer_class=modeling_qwen3_5.Qwen3_5DecoderLayer,
        norm_class=modeling_qwen3_5.Qwen3_5RMSNorm,
        rotary_class=modeling_qwen3_5.Qwen3_5TextRotaryEmbedding,
        apply_rotary=modeling_qwen3_5.apply_rotary_pos_emb,
        fc_name="fc",
        norm_embedding_name="pre_fc_norm_embedding",
        norm_hidden_name="pre_fc_norm_hidden",
        final_norm_name="norm",
        layer_prefix="layers.0",
        native_prefix="mtp.",
        native_concat=CONCAT_EH,
        feed_back=FEED_POST_NORM,
        zero_embed_at_position_0=False,
        norm_unit_weight=0.0,
        native_layers_field="mtp_num_hidden_layers",
    ),
    # MiMo-7B: `model.mtp_layers.0.*`, a Qwen2 layer whose parameters sit next to the head's own.
    "mimo": HeadFamily(
        name="mimo",
        config_class=Qwen2Config,
        layer_class=modeling_qwen2.Qwen2DecoderLayer,
        norm_class=modeling_qwen2.Qwen2RMSNorm,
        rotary_class=modeling_qwen2.Qwen2RotaryEmbedding,
        apply_rotary=modeling_qwen2.apply_rotary_pos_emb,
        fc_name="input_proj",
        norm_embedding_name="token_layernorm",
        norm_hidden_name="hidden_layernorm",
        final_norm_name="final_layernorm",
        layer_prefix="",
        native_prefix="model.mtp_layers.0.",
        native_concat=CONCAT_HE,
        feed_back=FEED_POST_NORM,
        zero_embed_at_position_0=True,
        norm_unit_weight=1.0,
        native_layers_field="num_nextn_predict_layers",
    ),
}

# model_type of a backbone config -> head family
MODEL_TYPE_TO_FAMILY = {
    "qwen3": "qwen3",
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "mimo": "mimo",
    "qwen2": "mimo",
}


def get_family(name: str) -> HeadFamily:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown head family {name!r}; known: {sorted(FAMILIES)}") from None


def family_for_model_type(*model_types: str | None) -> HeadFamily:
    """The family of the first known model_type (e.g. a wrapper's, then its text config's)."""
    for model_type in model_types:
        if model_type in MODEL_TYPE_TO_FAMILY:
            return FAMILIES[MODEL_TYPE_TO_FAMILY[model_type]]
    raise ValueError(f"no GrowMTP head family for backbone model_type {model_types}; "
                     f"supported: {sorted(MODEL_TYPE_TO_FAMILY)}")


def family_for_backbone(config: PretrainedConfig) -> HeadFamily:
    """The head family of a backbone config (its text config for multimodal wrappers)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return family_for_model_type(getattr(config, "model_type", None), getattr(text, "model_type", None))
