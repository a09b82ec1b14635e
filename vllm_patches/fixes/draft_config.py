"""A GrowMTP head directory keeps its own architecture when vLLM builds the draft model's config.

vLLM 0.29 passes every draft config through `SpeculativeConfig.hf_config_override` (`config/speculative.py`,
applied to the draft `ModelConfig` through `compose_draft_hf_overrides` in `SpeculativeConfig.__post_init__`).
For model_type `qwen3_5_text` it rewrites the config into vLLM's own Qwen3.5 MTP module (model_type
`qwen3_5_mtp`, architecture `Qwen3_5MTP`), so a `qwen3_5` GrowMTP head, whose
config is Qwen3.5's text config, would be loaded as vLLM's MTP instead of `GrowMTPHead`. The wrapper below
returns a config that carries `growmtp_family` unchanged and leaves every other config to vLLM.

The wrapper is a module-level function: vLLM pickles the draft ModelConfig, overrides included, into the
processes it spawns, which import this module by name.
"""

from __future__ import annotations

from openrlhf_growmtp.core.head_config import HEAD_CONFIG_FIELD

from .. import check_vllm_version

check_vllm_version()

from vllm.config.speculative import SpeculativeConfig  # noqa: E402

_HOOK_MARK = "__growmtp_hook__"
_VLLM_OVERRIDE = getattr(SpeculativeConfig.hf_config_override, "__wrapped__", SpeculativeConfig.hf_config_override)


def hf_config_override(hf_config):
    """vLLM's draft-config override, except for a GrowMTP head's config (returned as it is)."""
    if getattr(hf_config, HEAD_CONFIG_FIELD, None) is not None:
        return hf_config
    return _VLLM_OVERRIDE(hf_config)


hf_config_override.__wrapped__ = _VLLM_OVERRIDE
setattr(hf_config_override, _HOOK_MARK, True)


def install_draft_config_hook() -> None:
    """Rebind `SpeculativeConfig.hf_config_override` (idempotent)."""
    if not getattr(SpeculativeConfig.hf_config_override, _HOOK_MARK, False):
        SpeculativeConfig.hf_config_override = staticmethod(hf_config_override)
