"""The head's config and its fc's native layout: what a head directory's config.json and weights hold.

The head's config is the backbone's text config cut to one full-attention layer, with the family named under
`growmtp_family`; a native checkpoint's fc reads its two inputs in the family's order ([e, h] or [h, e]),
ours always [e, h].
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from .families import CONCAT_EH, HeadFamily

HEAD_CONFIG_FIELD = "growmtp_family"


def make_head_config(backbone_config: PretrainedConfig, family: HeadFamily) -> PretrainedConfig:
    """The config of the head's single decoder layer: the backbone's text config, one full-attention layer."""
    text = backbone_config.get_text_config() if hasattr(backbone_config, "get_text_config") else backbone_config
    fields = text.to_dict()
    for key in ("num_hidden_layers", "layer_types", "architectures", "model_type", "transformers_version",
                "auto_map", "torch_dtype", "dtype", "sliding_window", "use_sliding_window", "max_window_layers"):
        fields.pop(key, None)
    config = family.config_class(**fields, num_hidden_layers=1, layer_types=["full_attention"])
    setattr(config, HEAD_CONFIG_FIELD, family.name)
    config.architectures = ["GrowMTPHead"]
    return config


def native_fc_to_ours(weight: torch.Tensor, family: HeadFamily) -> torch.Tensor:
    """A native fc weight [H, 2H] in our [e, h] input order (swap halves for [h, e] checkpoints)."""
    if family.native_concat == CONCAT_EH:
        return weight
    first, second = weight.chunk(2, dim=1)
    return torch.cat([second, first], dim=1).contiguous()


ours_fc_to_native = native_fc_to_ours  # swapping the two halves is its own inverse
