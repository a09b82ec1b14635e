"""The speed world of `make demo`: the demo world's policy at a deep, wide model's cost, built once and cached.

Speculative decoding pays where a draft step costs a small fraction of a target's decode step and a verify of
K + 1 positions costs about one decode step. The demo world's 2-layer target is the wrong shape for that (its
head costs half a target step), and pretraining a deep, wide policy on 2 cores is too slow for a demo. So this
world grows the demo world's pretrained policy into a larger one that computes the same function:

- **wider**: the hidden size goes from 128 to `hidden_size` with heads of the same head_dim (more of them,
  the same query heads per key-value head) and the same MLP ratio. The old weights fill the first 128
  dimensions; what the new dimensions, heads and MLP units write into the residual stream starts at zero, so
  the stream's new dimensions stay zero and the old ones hold the old values. RMSNorm over the wider stream
  divides by a root mean square smaller by sqrt(128 / hidden_size); every norm weight is scaled by that
  factor and the norm's epsilon by its square, which undoes it exactly (powers of two here: the norm's output
  is the small policy's bit for bit; the GEMMs over the wider stream add exact zeros, in another order).
- **deeper**: `num_layers - 2` new layers after the pretrained two, each starting as the identity (its
  attention's and MLP's output projections zero).
Every other new weight is drawn as transformers initialises a model (seed `seed`), so nothing stays at a
saddle: the RL run trains all of it. The policy's sampled accuracy is the demo world's.

Its size (layers, hidden) was chosen from the cost ratios measured on this machine (docs/demo.md,
`benchmarks/bench_regime.py`, `benchmarks/bench_rollout.py --sweep`). Its cache directory is speed-<key>/,
beside the demo world's it grows from.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from math import sqrt
from pathlib import Path
from typing import ClassVar

import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from growmtp_lab.worlds.demo_world import World, WorldSpec, build_world, write_policy

WORLD_VERSION = 1  # bump when anything here changes what a cached world holds


@dataclass(frozen=True)
class SpeedWorldSpec:
    """The demo world (`base`) grown to `num_layers` x `hidden_size`."""

    name: ClassVar[str] = "speed"
    prefix: ClassVar[str] = "speed"
    base: WorldSpec = field(default_factory=WorldSpec)
    num_layers: int = 10
    hidden_size: int = 512
    seed: int = 0  # the new weights' draw

    def key(self) -> str:
        blob = json.dumps({"world": self.name, "version": WORLD_VERSION, "base_key": self.base.key(),
                           **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def build_speed_world(cache_dir: str | Path, spec: SpeedWorldSpec = SpeedWorldSpec(), log=print) -> World:
    """The world for `spec` under cache_dir/speed-<key>/ (the demo world it grows from is built or reused beside
    it), built unless a complete one is already there."""
    cache_dir = Path(cache_dir)
    root = cache_dir / f"{spec.prefix}-{spec.key()}"
    stamp = root / "world.json"
    if not stamp.exists():
        began = time.perf_counter()
        base = build_world(cache_dir, spec.base, log)
        root.mkdir(parents=True, exist_ok=True)
        small = Qwen3ForCausalLM.from_pretrained(str(base.policy), dtype=torch.float32).eval()
        grown = grow(small, spec.num_layers, spec.hidden_size, spec.seed)
        write_policy(root, grown, AutoTokenizer.from_pretrained(str(base.policy)))
        shutil.copyfile(base.prompts, root / "prompts.jsonl")
        info = {"spec": {**asdict(spec), "base": base.info["spec"]}, "base": str(base.root),
                "pretrain": base.info["pretrain"], "params": sum(p.numel() for p in grown.parameters()),
                "build_s": round(time.perf_counter() - began, 1)}
        stamp.write_text(json.dumps(info, indent=2) + "\n")  # written last: marks the world complete
        log(f"speed world ready in {info['build_s']:.0f} s: the demo world's policy grown to {spec.num_layers} "
            f"layers x hidden {spec.hidden_size} ({info['params'] / 1e6:.1f}M parameters)")
    info = json.loads(stamp.read_text())
    return World(root=root, policy=root / "policy", head=root / "head-random", prompts=root / "prompts.jsonl",
                 info=info)


def grown_config(small: Qwen3Config, num_layers: int, hidden_size: int) -> Qwen3Config:
    """`small`'s config at `num_layers` x `hidden_size`: heads of the same head_dim and grouping, the same MLP
    ratio, the norm's epsilon scaled with the mean square it is added to."""
    scale = hidden_size // small.hidden_size
    if scale * small.hidden_size != hidden_size or scale < 1 or num_layers < small.num_hidden_layers:
        raise ValueError(f"can grow {small.num_hidden_layers} x {small.hidden_size} only to at least as many layers "
                         f"and a multiple of the width, not {num_layers} x {hidden_size}")
    fields = small.to_dict()
    for name in ("architectures", "model_type", "transformers_version", "layer_types", "torch_dtype", "dtype"):
        fields.pop(name, None)
    fields.update(hidden_size=hidden_size, num_hidden_layers=num_layers,
                  intermediate_size=small.intermediate_size * scale,
                  num_attention_heads=small.num_attention_heads * scale,
                  num_key_value_heads=small.num_key_value_heads * scale,
                  rms_norm_eps=small.rms_norm_eps / scale)
    return Qwen3Config(**fields)


@torch.no_grad()
def grow(small: Qwen3ForCausalLM, num_layers: int, hidden_size: int, seed: int = 0) -> Qwen3ForCausalLM:
    """A `num_layers` x `hidden_size` Qwen3 computing what `small` computes (module docstring)."""
    config = grown_config(small.config, num_layers, hidden_size)
    torch.manual_seed(seed)
    big = Qwen3ForCausalLM(config).eval()
    width, ffn = small.config.hidden_size, small.config.intermediate_size
    head_dim = small.config.head_dim
    q_rows, kv_rows = small.config.num_attention_heads * head_dim, small.config.num_key_value_heads * head_dim
    norm_scale = sqrt(width / hidden_size)

    def norm(new, old=None):  # RMSNorm over the wider stream (module docstring)
        if old is not None:
            new.weight[:width] = old.weight
        new.weight.mul_(norm_scale)

    def output(new, old=None, inner=0):  # writes into the stream: only the old block, from the old inputs
        new.weight.zero_()
        if old is not None:
            new.weight[:width, :inner] = old.weight

    big.model.embed_tokens.weight[:, width:] = 0
    big.model.embed_tokens.weight[:, :width] = small.model.embed_tokens.weight
    big.lm_head.weight[:, :width] = small.lm_head.weight
    norm(big.model.norm, small.model.norm)
    for i, layer in enumerate(big.model.layers):
        old = small.model.layers[i] if i < small.config.num_hidden_layers else None
        attn, mlp = layer.self_attn, layer.mlp
        if old is None:  # a new layer: the identity
            norm(layer.input_layernorm)
            norm(layer.post_attention_layernorm)
            output(attn.o_proj)
            output(mlp.down_proj)
            continue
        norm(layer.input_layernorm, old.input_layernorm)
        norm(layer.post_attention_layernorm, old.post_attention_layernorm)
        # the old heads are the first ones, so query head j still reads key-value head j // group
        attn.q_proj.weight[:q_rows, :width] = old.self_attn.q_proj.weight
        attn.k_proj.weight[:kv_rows, :width] = old.self_attn.k_proj.weight
        attn.v_proj.weight[:kv_rows, :width] = old.self_attn.v_proj.weight
        attn.q_norm.weight.copy_(old.self_attn.q_norm.weight)  # over head_dim: unchanged
        attn.k_norm.weight.copy_(old.self_attn.k_norm.weight)
        output(attn.o_proj, old.self_attn.o_proj, q_rows)
        mlp.gate_proj.weight[:ffn, :width] = old.mlp.gate_proj.weight
        mlp.up_proj.weight[:ffn, :width] = old.mlp.up_proj.weight
        output(mlp.down_proj, old.mlp.down_proj, ffn)
    return big

