"""The draft vocabulary in check `rollout_loop` (`--draft-vocab N`): the head drafts over N ids alone, as the product
does with `--growmtp_draft_vocab N` (`openrlhf_growmtp/core/draft_vocab.py`), and the cycle is timed beside the
draft over every id.

The ids. N ids drawn at random (seed 0), ascending: which ids they are costs nothing. The loop slices their lm_head
rows once and keeps q over them alone ([B, K, N], zero at every other id); the rejection step
(`reference_drafting.rejection_step`) reads p at the drafts and, at a rejection, draws from max(p - q, 0), which
is p itself outside the ids: exact.

The target. A random policy spreads p over the whole vocabulary, so no q over N of its V ids could reach the
paper's tau (sum min(p, q) <= p's mass on the ids). A real policy's mass sits on its frequent ids, which the
product's ranking picks (its `growmtp/draft_vocab_coverage`). So for these runs the policy's logits outside the
ids are lowered by one constant (a bias of its lm_head, removed after), which leaves OUTSIDE_MASS of a flat p
outside them. Only values change: every phase has the shape it has without it. Then the head's scale is set
for tau 2.91 (`gpu_loop.calibrate`), as for the draft over every id.

What it reports: per context, the cycle at the measured depths, and at 36 layers (the per-layer line through them,
`gpu_cycle.at_real_layers`) the speedup at tau 2.91 with and without the subset; the same over the paper's
8K-token rollout; the subset's first-draft acceptance against sum min(p_1, q_1) (q restricted) within 5 sigma.
"""

from __future__ import annotations

import contextlib
import math

import torch

from benchmarks.gpu_check.gpu_cycle import PAPER, at_real_layers, rollout_from_loop
from benchmarks.gpu_check.gpu_report import Row
from benchmarks.gpu_check.gpu_sampler import Z_LIMIT
from growmtp_lab.reference_drafting import acceptance_z

OUTSIDE_MASS = 0.05  # a flat p's mass outside the draft vocabulary, in the subset's runs
IDS_SEED = 0


def draft_vocab_ids(vocab_size: int, size: int, device: torch.device) -> torch.Tensor:
    """`size` distinct ids of [0, vocab_size), ascending, int64, on `device`."""
    if not 1 <= size < vocab_size:
        raise ValueError(f"a draft vocabulary is 1 to {vocab_size - 1} ids of the {vocab_size}, got {size}")
    drawn = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(IDS_SEED))[:size]
    return torch.sort(drawn).values.to(device)


def outside_shift(vocab_size: int, size: int, mass: float = OUTSIDE_MASS) -> float:
    """The logit offset d with which a flat p over `vocab_size` ids has `mass` outside `size` of them:
    (V - N) e^-d / (N + (V - N) e^-d) = mass."""
    return math.log((vocab_size - size) / size * (1.0 - mass) / mass)


@contextlib.contextmanager
def shifted_outside(policy, ids: torch.Tensor):
    """The policy's lm_head with a bias of -d outside `ids` (0 on them) while inside; yields d."""
    lm_head = policy.lm_head
    if lm_head.bias is not None:
        raise ValueError("the policy's lm_head has a bias already")
    weight = lm_head.weight
    shift = outside_shift(weight.shape[0], ids.numel())
    bias = torch.full((weight.shape[0],), -shift, dtype=weight.dtype, device=weight.device)
    bias[ids] = 0.0
    lm_head.bias = torch.nn.Parameter(bias, requires_grad=False)
    try:
        yield shift
    finally:
        lm_head.bias = None


def draft_vocab_report(plan, measured: dict, at_real: dict, rollout: dict, contexts) -> tuple[list[Row], dict]:
    """The subset's rows and its JSON section, from the sweep's `measured` (its rows' "draft_vocab" entries) and the
    draft over every id's `at_real` and `rollout` (`gpu_rollout_loop`)."""

    depths, size = measured["depths"], measured["draft_vocab_size"]
    errors = {f"{d}/{c}": measured["per"][(d, c)]["draft_vocab"]["error"] for d in depths for c in contexts
              if "error" in measured["per"][(d, c)]["draft_vocab"]}
    details = {"size": size, "vocab_size": plan.config.vocab_size, "ids": f"{size} ids drawn at random (seed "
               f"{IDS_SEED}), ascending", "outside_mass": OUTSIDE_MASS, "errors": errors,
               "scale": _scale_json(measured["subset_scale"]), "q": "over the ids alone ([B, K, N]); zero elsewhere"}
    if errors:
        return [Row("rollout_loop", f"draft vocabulary of {size} ids", f"error: {next(iter(errors.values()))[:80]}",
                    "-", False)], details
    subset = {"depths": depths, "per": {(d, c): {"decode_s": measured["per"][(d, c)]["decode_s"],
                                                 "cycle_s": measured["per"][(d, c)]["draft_vocab"]["cycle_s"]}
                                        for d in depths for c in contexts}}
    sub_real = at_real_layers(subset, contexts, plan.real_layers)
    sub_rollout = rollout_from_loop(sub_real, contexts, plan)
    counts = measured["subset_counts"]
    z = acceptance_z(counts)
    details.update(
        per_context={str(c): {"measured": {str(d): measured["per"][(d, c)]["draft_vocab"] for d in depths},
                              "at_real_layers": sub_real[c],
                              "speedup_at_paper_tau": sub_real[c]["speedup_at_paper_tau"],
                              "speedup_at_paper_tau_all_ids": at_real[c]["speedup_at_paper_tau"]}
                     for c in contexts},
        rollout=sub_rollout, rollout_speedup=sub_rollout["speedup"], rollout_speedup_all_ids=rollout["speedup"],
        acceptance={**counts, "z": z})
    return _rows(plan, measured, details, contexts, z), details


def _scale_json(scale: dict | None) -> dict | None:
    return None if scale is None else {k: v for k, v in scale.items() if k != "base"}


def _rows(plan, measured: dict, d: dict, contexts, z: float) -> list[Row]:
    deep, real, size, tau = measured["layers"], plan.real_layers, d["size"], PAPER["tau"]
    rows = []
    for c in contexts:
        entry = d["per_context"][str(c)]
        sub, full = entry["measured"][str(deep)], measured["per"][(deep, c)]
        rows.append(Row("rollout_loop", f"draft over {size} ids, {c} tokens: cycle at {deep} layers (all ids); "
                        f"speedup at tau {tau}, {real} layers", f"{sub['cycle_s'] * 1e3:.2f} ms at tau "
                        f"{sub['tau']:.2f} ({full['cycle_s'] * 1e3:.2f} ms); {entry['speedup_at_paper_tau']:.2f}x",
                        f"all ids {entry['speedup_at_paper_tau_all_ids']:.2f}x", None,
                        {"speedup": entry["speedup_at_paper_tau"], "all_ids": entry["speedup_at_paper_tau_all_ids"]}))
    counts = d["acceptance"]
    rows += [Row("rollout_loop", f"rollout speedup at tau {tau}, {plan.rollout_response}-token responses, {real} "
                 f"layers, draft over {size} ids", f"{d['rollout_speedup']:.2f}x",
                 f"all ids {d['rollout_speedup_all_ids']:.2f}x; paper {PAPER['rollout_speedup']}x", None,
                 {"speedup": d["rollout_speedup"], "all_ids": d["rollout_speedup_all_ids"]}),
             Row("rollout_loop", f"draft over {size} ids: first-draft acceptance vs sum min(p, q), "
                 f"{counts['cycles']:.0f} cycles", f"z {z:.2f} ({counts['first_accepted'] / counts['cycles']:.4f} vs "
                 f"{counts['alpha_sum'] / counts['cycles']:.4f})", f"|z| <= {Z_LIMIT:g}", abs(z) <= Z_LIMIT,
                 {"z": z})]
    return rows
