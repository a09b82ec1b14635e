"""The rollout loop's times read where they were not timed: at the policy's real depth, on the line through
the two depths the loop ran (`at_real_layers`), and over the paper's whole rollout, linear in the context
(`rollout_from_loop`). Both the full-vocabulary rows (`gpu_rollout_loop.py`) and the draft vocabulary's
(`gpu_draft_vocab.py`) read them."""

from __future__ import annotations

from benchmarks.gpu_check.gpu_cycle import PAPER
from benchmarks.shared.bench_common import fit_line
from benchmarks.shared.cycle_timing import rollout_prediction


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
