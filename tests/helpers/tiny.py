"""Shared builders: tiny backbones with the real config classes and parameter names, heads, records."""

from __future__ import annotations

import torch
from torch import nn
from transformers import Qwen2Config, Qwen3Config
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

from openrlhf_growmtp.core import MTPHead, SequenceRecord, make_head_config
from openrlhf_growmtp.core.families import get_family
from growmtp_lab.worlds.toy import synthetic_record

FAMILY_NAMES = ("qwen3", "qwen3_5", "mimo")
VOCAB, HIDDEN = 97, 64
TINY = dict(hidden_size=HIDDEN, num_attention_heads=2, num_key_value_heads=1, intermediate_size=96,
            num_hidden_layers=2, vocab_size=VOCAB, initializer_range=0.02, rms_norm_eps=1e-6)


def tiny_backbone_config(family: str, **overrides):
    """Tiny config of the family's real backbone class (head_dim 32, as vLLM's CPU attention needs)."""
    fields = {**TINY, **overrides}
    if family == "qwen3":
        return Qwen3Config(head_dim=32, **fields)
    if family == "qwen3_5":
        fields.setdefault("mtp_num_hidden_layers", 1)
        return Qwen3_5TextConfig(head_dim=32, **fields)
    if family == "mimo":
        fields.setdefault("num_nextn_predict_layers", 1)
        return Qwen2Config(**fields)
    raise ValueError(family)


def backbone_modules(seed: int = 0) -> tuple[nn.Embedding, nn.Linear]:
    g = torch.Generator().manual_seed(seed)
    embed = nn.Embedding(VOCAB, HIDDEN)
    lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=g))
        lm_head.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=g) * 0.3)
    return embed, lm_head


def make_head(family: str, seed: int = 0, std: float = 0.1) -> MTPHead:
    """A head with weights large enough that attention and q are far from uniform."""
    config = make_head_config(tiny_backbone_config(family), get_family(family))
    head = MTPHead(config, *backbone_modules(seed))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in sorted(head.named_parameters()):
            if name.endswith("norm.weight") or "layernorm" in name or "norm_" in name:
                p.copy_(head.family.norm_unit_weight + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return head


def make_records(k: int = 4, topk: int = 8, seed: int = 0, layouts=None, vocab_size: int = VOCAB,
                 hidden_size: int | None = HIDDEN) -> list[SequenceRecord]:
    """Records of (prompt length, accepted per cycle) `layouts`; by default three sequences of different
    lengths, with full accepts, early rejections and a mixed temperature. `hidden_size` None: no hidden."""
    default = layouts is None
    layouts = [(5, [2, 0, k, 1, 0]), (3, [0, 0]), (9, [k, k, 1, 3])] if default else layouts
    records = [synthetic_record(prompt_len=p, accepted=[min(a, k) for a in acc], depth=k, topk=topk,
                                vocab_size=vocab_size, hidden_size=hidden_size, seed=seed + i)
               for i, (p, acc) in enumerate(layouts)]
    if default:
        records[1].temperature = 0.7
    return records

