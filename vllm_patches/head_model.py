"""The GrowMTP head as a vLLM draft model, for every head family.

Loaded with `speculative_config={"method": "eagle", "model": <head dir>, ...}`; the head directory is
what `openrlhf_growmtp.core.checkpoint.export_head` writes (architectures ["GrowMTPHead"], the family in
`growmtp_family`, parameters under the core head's names). vLLM's EAGLE config renames the
architecture to "EagleGrowMTPHead" after validating the raw name, so both names are registered.

The class deliberately has no `has_own_embed_tokens` / `has_own_lm_head`: vLLM then treats it as an
MTP head and binds the target's embedding and lm_head, so they are shared, never copied.

Computation (identical to `core.head.MTPHead`, which the tests check through the engine's q):
    x = fc(cat[norm_e(embed(token)), norm_h(hidden)]);  o = layer(x) (with its residual)
    returns (norm(o), fed-back state = o or norm(o) per family)
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from torch import nn

from openrlhf_growmtp.core.families import FEED_PRE_NORM, HeadFamily, get_family
from openrlhf_growmtp.core.head_config import HEAD_CONFIG_FIELD

from . import check_vllm_version, draft_sampling

check_vllm_version()

from vllm.compilation.decorators import support_torch_compile  # noqa: E402
from vllm.config import VllmConfig  # noqa: E402
from vllm.model_executor.layers.layernorm import RMSNorm  # noqa: E402
from vllm.model_executor.layers.logits_processor import LogitsProcessor  # noqa: E402
from vllm.model_executor.model_loader.weight_utils import default_weight_loader  # noqa: E402

ARCHITECTURE = "GrowMTPHead"
ARCHITECTURE_NAMES = (ARCHITECTURE, "Eagle" + ARCHITECTURE)

# checkpoint projection -> vLLM's fused parameter and its shard id
_FUSED = ((".q_proj.", ".qkv_proj.", "q"), (".k_proj.", ".qkv_proj.", "k"), (".v_proj.", ".qkv_proj.", "v"),
          (".gate_proj.", ".gate_up_proj.", 0), (".up_proj.", ".gate_up_proj.", 1))
_SHARED = ("embed_tokens", "lm_head")


def _vllm_layer(family: HeadFamily, vllm_config: VllmConfig, config, prefix: str) -> nn.Module:
    """vLLM's decoder layer of the family; returns (out, residual) from (positions, hidden, residual)."""
    if family.name == "qwen3":
        from vllm.model_executor.models.qwen3 import Qwen3DecoderLayer

        return Qwen3DecoderLayer(config, cache_config=vllm_config.cache_config, quant_config=None, prefix=prefix)
    if family.name == "mimo":
        from vllm.model_executor.models.qwen2 import Qwen2DecoderLayer

        return Qwen2DecoderLayer(config, cache_config=vllm_config.cache_config, quant_config=None, prefix=prefix)
    if family.name == "qwen3_5":
        from vllm.model_executor.models.qwen3_5 import Qwen3_5DecoderLayer

        # Qwen3.5's layer reads its config from vllm_config.model_config.hf_text_config: give it the head's
        # own text config (the draft model config's is vLLM's EAGLE wrapper, model_type "eagle").
        head_model_config = copy.copy(vllm_config.speculative_config.draft_model_config)
        head_model_config.hf_text_config = _unwrapped(config)
        head_vllm_config = copy.copy(vllm_config)
        head_vllm_config.model_config = head_model_config
        return Qwen3_5DecoderLayer(head_vllm_config, layer_type="full_attention", prefix=prefix)
    raise ValueError(f"no vLLM decoder layer for head family {family.name!r}")


def _unwrapped(config):
    """The head directory's own config inside vLLM's EAGLE wrapper (`transformers_utils/configs/eagle.py`,
    `EAGLEConfig`)."""
    from transformers import PretrainedConfig

    inner = getattr(config, "model", None)
    return inner if isinstance(inner, PretrainedConfig) else config


def _vllm_norm(family: HeadFamily, hidden: int, eps: float) -> nn.Module:
    if family.norm_unit_weight == 0.0:  # x * (1 + w): Qwen3.5's norm
        from vllm.model_executor.models.qwen3_5 import Qwen3_5RMSNorm

        return Qwen3_5RMSNorm(hidden, eps=eps)
    return RMSNorm(hidden, eps=eps)


def _head_config(vllm_config: VllmConfig):
    """The head directory's HF config and its family (refused when it is not a GrowMTP head)."""
    config = vllm_config.speculative_config.draft_model_config.hf_config
    family_name = getattr(config, HEAD_CONFIG_FIELD, None)
    if family_name is None:
        raise ValueError(f"draft model config has no {HEAD_CONFIG_FIELD!r}: not a GrowMTP head directory "
                         "(write one with growmtp-make-head)")
    return config, get_family(family_name)


# the token dimension of every input is dynamic; positions are [T], or [3, T] with M-RoPE
@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1, "hidden_states": 0, "inputs_embeds": 0})
class _HeadModules(nn.Module):
    """The head's parameters under the core head's names (+ the target's embed_tokens, bound later) and its
    computation, compiled (and CUDA-graphed) by vLLM like its own draft heads unless enforce_eager."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config, family = _head_config(vllm_config)
        self.family = family
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.embed_tokens = None  # the target's, set by vLLM's proposer
        self.add_module(family.norm_embedding_name, _vllm_norm(family, hidden, eps))
        self.add_module(family.norm_hidden_name, _vllm_norm(family, hidden, eps))
        self.add_module(family.fc_name, nn.Linear(2 * hidden, hidden, bias=False))
        # The attention layer's name must not collide with the target's: index it after the target's layers.
        index = vllm_config.model_config.get_num_layers(vllm_config.parallel_config)
        layer = _vllm_layer(family, vllm_config, config, prefix=f"model.layers.{index}")
        if family.layer_prefix:
            container, _ = family.layer_prefix.split(".")
            self.add_module(container, nn.ModuleList([layer]))
        else:  # MiMo: the layer's parameters sit at the head's top level
            for child_name, child in layer.named_children():
                self.add_module(child_name, child)
        self.__dict__["decoder_layer"] = layer
        self.add_module(family.final_norm_name, _vllm_norm(family, hidden, eps))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        fam, m = self.family, self
        if inputs_embeds is None:
            inputs_embeds = m.embed_tokens(input_ids)
        if fam.zero_embed_at_position_0:
            inputs_embeds = inputs_embeds.masked_fill((positions == 0).unsqueeze(-1), 0.0)
        embedded = getattr(m, fam.norm_embedding_name)(inputs_embeds)
        hidden = getattr(m, fam.norm_hidden_name)(hidden_states)
        x = getattr(m, fam.fc_name)(torch.cat([embedded, hidden], dim=-1))
        out, residual = m.decoder_layer(positions=positions, hidden_states=x, residual=None)
        o = out + residual
        normed = getattr(m, fam.final_norm_name)(o)
        return normed, (o if fam.feed_back == FEED_PRE_NORM else normed)


class GrowMTPHeadModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        self.config, self.family = _head_config(vllm_config)
        self.model = _HeadModules(vllm_config=vllm_config, prefix=prefix)
        self.lm_head = None  # the target's, set by vLLM's proposer
        self.logits_processor = LogitsProcessor(self.config.vocab_size)
        self._draft_ids: torch.Tensor | None = None  # [N] the draft vocabulary (None: every id)
        self._draft_rows: torch.Tensor | None = None  # [N, H] its lm_head rows, gathered once
        self.draft_vocab_tag: str | None = None  # what the records of its drafts say (core.draft_vocab)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model(input_ids, positions, hidden_states, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        if self._draft_ids is None:
            return self.logits_processor(self.lm_head, hidden_states)
        # [N, V]: the draft vocabulary's rows of the lm_head only, -inf elsewhere, so vLLM's draft sampler and
        # rejection sampler see q zero outside it (openrlhf_growmtp/core/draft_vocab.py); marked so that the
        # draft sampler samples over the vocabulary's ids alone (draft_sampling.py)
        logits = hidden_states.new_full((hidden_states.shape[0], self.config.vocab_size), float("-inf"))
        logits.index_copy_(1, self._draft_ids, torch.nn.functional.linear(hidden_states, self._draft_rows))
        return draft_sampling.mark(logits, self._draft_ids)

    def set_draft_vocab(self, ids: torch.Tensor | None, tag: str | None = None) -> None:
        """Draft over `ids` only (None: every id); `tag` names them in the records (capture reads it here).
        Gathers their lm_head rows once: set it again after the target's weights change (the worker extension
        does after its own loads; the trainer sets the draft vocabulary after every weight sync)."""
        if ids is None:
            self._draft_ids = self._draft_rows = self.draft_vocab_tag = None
            return
        if self.lm_head.tp_size > 1:
            raise ValueError("a draft vocabulary needs the whole lm_head on one rank (tensor_parallel_size 1)")
        weight = self.lm_head.weight
        self._draft_ids = ids.to(device=weight.device, dtype=torch.long)
        self._draft_rows = weight[self._draft_ids].contiguous()  # [N, H]
        self.draft_vocab_tag = tag

    def refresh_draft_vocab(self) -> None:
        """Gather the draft vocabulary's lm_head rows again (after the target's weights changed)."""
        if self._draft_ids is not None:
            self.set_draft_vocab(self._draft_ids, self.draft_vocab_tag)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load core-head names (`fc.weight`, `layers.0.self_attn.q_proj.weight`, ...); returns vLLM names."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            target = vllm_parameter(name)
            if target is None:
                continue  # the target's, shared
            vllm_name, shard = target
            param = _param(params, vllm_name, name)
            if shard is None:
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            else:
                param.weight_loader(param, tensor, shard)
            loaded.add(vllm_name)
        return loaded


def vllm_parameter(name: str) -> tuple[str, str | int | None] | None:
    """The vLLM parameter a core-head weight loads into, with its shard id in a fused parameter (None when
    unfused); None for the embedding and lm_head, which are the target's."""
    if is_shared(name):
        return None
    target = name if name.startswith("model.") else "model." + name
    for checkpoint_part, fused_part, shard in _FUSED:
        if checkpoint_part in target:
            return target.replace(checkpoint_part, fused_part), shard
    return target, None


def load_problems(model: nn.Module, names) -> list[str]:
    """What loading weights under these core-head names into `model` (a GrowMTPHeadModel) would get wrong: a
    name with no parameter of the head, and every head parameter (each part of a fused one) none would fill,
    which would keep its old value without a word. Empty when the names fill the whole head exactly."""
    params = {name for name, _ in model.named_parameters() if not is_shared(name)}
    targets = {name: vllm_parameter(name) for name in names if not is_shared(name)}
    problems = [f"{name!r} has no parameter in the head"
                for name, (target, _) in targets.items() if target not in params]
    filled = set(targets.values())
    for param in sorted(params):
        parts = [shard for _, fused, shard in _FUSED if fused in param] or [None]
        problems += [f"no weight for {param}" + ("" if shard is None else f" (part {shard})")
                     for shard in parts if (param, shard) not in filled]
    return problems


def is_shared(name: str) -> bool:
    """Whether a head parameter name (core or vLLM) is the target's embedding or lm_head."""
    return any(part in name for part in _SHARED)


def _param(params: dict[str, nn.Parameter], vllm_name: str, checkpoint_name: str) -> nn.Parameter:
    try:
        return params[vllm_name]
    except KeyError:
        raise KeyError(f"head weight {checkpoint_name!r} has no parameter in the vLLM head "
                       f"(looked for {vllm_name!r})") from None


def register_head_model() -> None:
    """Register the class under the raw and the EAGLE-renamed architecture names (lazily imported)."""
    from vllm import ModelRegistry

    for name in ARCHITECTURE_NAMES:
        ModelRegistry.register_model(name, f"{__name__}:GrowMTPHeadModel")
