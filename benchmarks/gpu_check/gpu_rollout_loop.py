"""Check `rollout_loop` of the GPU check: the draft-and-verify loop of `gpu_loop.py`, every phase a CUDA graph,
timed autoregressive and speculative side by side at the policy's shapes.

Per context (1K, 4K and 8K tokens for 64 sequences at Qwen3-4B's shapes), medians of `repeats`: the decode
step, and the cycle at each tau of the plan (1.5, 2.0, 2.5 and 2.91), the head's logit scale for each found
once (`gpu_loop.calibrate`, `calib_cycles` cycles per probe, at the smallest context).

Depth. The caches of 36 layers for 64 sequences of 8K tokens are 78 GB, so the loop runs the first `layers`
layers of a policy built with as many as fit the card's memory (`layers_that_fit`), and again with half of
them. The 36-layer times are read on the line through the two: t(36) = t(L) + (36 - L) x (t(L) - t(L/2)) /
(L - L/2), i.e. the measured per-layer time x 36 + the measured non-layer part (embedding, lm_head,
sampling, the head's steps), each context and phase on its own.

What it reports, per context: AR and speculative tokens per second at each tau (measured at L layers, and
read at 36); the break-even tau (cycle / decode seconds, = the tau at which the two loops' tokens per second
meet); the speedup at tau 2.91 (the paper: 2.13x) beside `cycle_cost`'s eager prediction; and over the
paper's rollout (8,192-token responses after 256) the speedup the contexts' lines give. The first draft's
acceptance over every timed cycle is held to sum min(p_1, q_1) within 5 standard errors (a sampler that
compared the wrong rows or positions would be far off). On a CPU (`--tiny`) also: with the target itself
as the drafter (q = p), every draft is accepted.

With a draft vocabulary (`--draft-vocab N`, `gpu_draft_vocab.py`), each context and depth is timed once more
with the head drafting over N ids alone, at tau 2.91 (its own scale), and read at 36 layers the same way.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass

import torch

from benchmarks.gpu_check.gpu_cycle import PAPER, at_real_layers, rollout_from_loop
from benchmarks.gpu_check.gpu_draft_vocab import draft_vocab_ids, draft_vocab_report, shifted_outside
from benchmarks.gpu_check.gpu_loop import Loop, calibrate
from benchmarks.gpu_check.gpu_report import Row
from benchmarks.gpu_check.gpu_sampler import Z_LIMIT
from benchmarks.shared.cycle_timing import KVBuffer, policy_caches
from growmtp_lab.reference_drafting import acceptance_z


@dataclass(frozen=True)
class LoopPlan:
    batch: int
    contexts: tuple[int, ...]
    taus: tuple[float, ...]
    ar_steps: int  # decode steps per timed run
    spec_cycles: int  # cycles per timed run
    repeats: int  # timed runs per (context, depth, tau); medians
    calib_cycles: int  # cycles per probe of the tau bisection
    calib_probes: int
    reserve_bytes: int  # device memory left to the graphs' pool, logits and the head
    check_cycles: int  # CPU only: cycles of the q = p and the acceptance checks


LOOP_PLANS = {
    "Qwen3-4B": LoopPlan(batch=64, contexts=(1024, 4096, 8192), taus=(1.5, 2.0, 2.5, 2.91), ar_steps=24,
                         spec_cycles=8, repeats=3, calib_cycles=4, calib_probes=7, reserve_bytes=12 * 2**30,
                         check_cycles=0),
    "tiny": LoopPlan(batch=16, contexts=(32, 64, 128), taus=(1.5, 2.0, 2.5, 2.91), ar_steps=8, spec_cycles=4,
                     repeats=2, calib_cycles=4, calib_probes=5, reserve_bytes=0, check_cycles=24),
}


def round_up(n: int, multiple: int = 64) -> int:
    return -(-n // multiple) * multiple


def capacity_for(context: int, plan: LoopPlan, k: int) -> int:
    """Slots a context's runs need: the context, the longest run's steps (a cycle commits up to K + 1
    tokens, and its verify writes K + 1 slots past its start), rounded up to 64 (aligned rows for the kernels)."""
    longest = max(plan.ar_steps, (max(plan.spec_cycles, plan.calib_cycles) + 1) * (k + 1) + 1)
    return round_up(context + longest)


def layers_that_fit(config, batch: int, capacity: int, free_bytes: int, reserve_bytes: int) -> int:
    """Policy layers whose weights and KV caches fit in `free_bytes` less the reserve, the embedding, the
    head (its layer and its cache) and the loop's logits; at most 36, at least 2 (two depths make the line)."""
    h, inter, kv, d = config.hidden_size, config.intermediate_size, config.num_key_value_heads, config.head_dim
    attn = h * d * (config.num_attention_heads * 2 + kv * 2)
    layer_bytes = 2 * (attn + 3 * h * inter)
    cache_bytes = 2 * 2 * batch * kv * capacity * d  # keys and values, bf16
    fixed = 2 * config.vocab_size * h + layer_bytes + 2 * 2 * h * h + cache_bytes
    fixed += 4 * batch * 16 * config.vocab_size * 4  # q, p and the samplers' fp32 rows, 16 rows a sequence
    fit = (free_bytes - reserve_bytes - fixed) // (layer_bytes + cache_bytes)
    return int(max(2, min(36, fit)))


def _add(total: dict, counts: dict) -> None:
    for name, value in counts.items():
        total[name] = total.get(name, 0.0) + value


class Sweep:
    """The loop at every context and tau, at the deepest policy that fits and at half its depth: the policy, its
    head and their caches (for the largest context), built once; the taus' head scales, found once."""

    def __init__(self, plan, loop_plan: LoopPlan, build_policy, build_head, device: torch.device, log,
                 draft_vocab: int | None = None):
        self.plan, self.loop_plan, self.device, self.log = plan, loop_plan, device, log
        self.capacity = {c: capacity_for(c, loop_plan, plan.k) for c in loop_plan.contexts}
        biggest = max(self.capacity.values())
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
        self.layers = (layers_that_fit(plan.config, loop_plan.batch, biggest, free, loop_plan.reserve_bytes)
                       if free is not None else plan.trainer_layers or 2)
        self.policy = build_policy(self.layers)
        self.head = build_head(self.policy)
        self.policy_kv = policy_caches(self.policy, loop_plan.batch, biggest)
        kv = self.policy_kv[0].keys
        self.head_kv = KVBuffer.empty(loop_plan.batch, kv.shape[1], biggest, kv.shape[3], device, kv.dtype)
        self.generator = torch.Generator(device=device).manual_seed(0)
        self.norm = getattr(self.head, self.head.family.final_norm_name).weight
        self.scales, self.totals = {}, {}
        # the draft vocabulary's ids (None: no subset runs), its scale for tau 2.91, its acceptance counters
        self.draft_ids = None if not draft_vocab else draft_vocab_ids(plan.config.vocab_size, draft_vocab, device)
        self.subset_scale, self.subset_totals = None, {}
        room = "" if free is None else f", {free / 2**30:.1f} GiB free"
        log(f"  (rollout_loop) {self.layers} of {plan.config.num_hidden_layers} layers fit (caches for "
            f"{loop_plan.batch} x {biggest} positions{room})")

    def run(self) -> dict:
        depths = (self.layers, max(1, self.layers // 2))
        # each context's loop (its graphs and their pool) is gone before the next context's is captured
        per = {(depth, c): self.context_row(depth, c) for depth in depths for c in self.loop_plan.contexts}
        with torch.no_grad():
            self.norm.copy_(next(iter(self.scales.values()))["base"])
        return {"layers": self.layers, "depths": list(depths), "per": per, "scales": self.scales,
                "counts": self.totals, "graphs": self.device.type == "cuda", "batch": self.loop_plan.batch,
                "capacity": self.capacity, "subset_scale": self.subset_scale, "subset_counts": self.subset_totals,
                "draft_vocab_size": None if self.draft_ids is None else int(self.draft_ids.numel())}

    def context_row(self, depth: int, context: int) -> dict:
        """One context at one depth (its caches filled at random): every id's row, then the draft vocabulary's."""
        for cache in self.policy_kv + [self.head_kv]:
            cache.fill_random(context, self.generator)
        row = self.all_ids_row(depth, context)
        if self.draft_ids is not None:
            try:  # its failure must not cost the rows of every id
                row["draft_vocab"] = self.subset_row(depth, context, row["decode_s"])
            except Exception as err:  # noqa: BLE001 - recorded in the row, reported by gpu_draft_vocab
                row["draft_vocab"] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
                self.log(f"  (rollout_loop) draft vocabulary at {depth} layers, {context} tokens: {row['draft_vocab']}")
        return row

    def _fresh_pool(self) -> None:
        """The last loop's graphs and their pool gone before the next loop's are captured."""
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def all_ids_row(self, depth: int, context: int) -> dict:
        """Its loop captured, the decode and each tau's cycle timed, the head drafting over every id."""
        lp, batch = self.loop_plan, self.loop_plan.batch
        self._fresh_pool()
        t0 = time.perf_counter()
        loop = Loop(self.policy, depth, self.head, self.policy_kv, self.head_kv, context, self.capacity[context],
                    self.plan.k)
        loop.capture()
        captured = time.perf_counter() - t0
        if not self.scales:  # the scales of the taus, once, at the deepest policy and the smallest context
            self.calibrate(loop)
        ar = [loop.timed("decode", lp.ar_steps) for _ in range(lp.repeats)]
        decode_s = statistics.median(s for s, _ in ar) / lp.ar_steps
        row = {"layers": depth, "capacity": self.capacity[context], "capture_s": captured, "decode_s": decode_s,
               "ar_tokens_per_s": batch / decode_s, "taus": {}}
        for tau in (lp.taus if depth == self.layers else (PAPER["tau"],)):
            row["taus"][str(tau)] = self.spec_at(loop, self.scales[tau], decode_s,
                                                 self.totals if depth == self.layers else None)
        row["cycle_s"] = statistics.median(t["cycle_s"] for t in row["taus"].values())
        row["break_even_tau"] = row["cycle_s"] / decode_s
        self.log(f"  (rollout_loop) {depth} layers, {context} tokens: decode {decode_s * 1e3:.2f} ms, cycle "
                 f"{row['cycle_s'] * 1e3:.2f} ms, break-even tau {row['break_even_tau']:.2f} (graphs "
                 f"{captured:.1f} s)")
        return row

    def calibrate(self, loop: Loop) -> None:
        for tau in self.loop_plan.taus:
            found = calibrate(loop, tau, self.loop_plan.calib_cycles, self.loop_plan.calib_probes)
            self.scales[tau] = found
            self.log(f"  (rollout_loop) tau {tau}: scale 2^{found['log2_scale']:.2f} (probe tau "
                     f"{found['tau_probe']:.2f})")

    def subset_row(self, depth: int, context: int, decode_s: float) -> dict:
        """The cycle with the head drafting over the draft vocabulary alone, at tau 2.91 (its scale found once, at
        the first context of the deepest policy), with the policy's p mostly inside it (`shifted_outside`)."""
        lp = self.loop_plan
        self._fresh_pool()
        with shifted_outside(self.policy, self.draft_ids) as shift:
            loop = Loop(self.policy, depth, self.head, self.policy_kv, self.head_kv, context, self.capacity[context],
                        self.plan.k, draft_ids=self.draft_ids)
            loop.capture()
            if self.subset_scale is None:
                with torch.no_grad():  # from the head's own scale, as the taus of every id were found
                    self.norm.copy_(next(iter(self.scales.values()))["base"])
                self.subset_scale = calibrate(loop, PAPER["tau"], lp.calib_cycles, lp.calib_probes)
                scale = self.subset_scale
                scale["logit_shift_outside"] = shift
                self.log(f"  (rollout_loop) draft vocabulary of {self.draft_ids.numel()} ids, tau {PAPER['tau']}: "
                         f"scale 2^{scale['log2_scale']:.2f} (probe tau {scale['tau_probe']:.2f})")
            totals = self.subset_totals if depth == self.layers else None
            timed = self.spec_at(loop, self.subset_scale, decode_s, totals)
            del loop
        self._fresh_pool()
        self.log(f"  (rollout_loop) {depth} layers, {context} tokens, {self.draft_ids.numel()} draft ids: cycle "
                 f"{timed['cycle_s'] * 1e3:.2f} ms at tau {timed['tau']:.2f}, {timed['speedup']:.2f}x")
        return timed

    def spec_at(self, loop: Loop, scale: dict, decode_s: float, totals: dict | None) -> dict:
        """The cycle timed at the head scale `scale` (a `calibrate` result); its counters join `totals` (the
        acceptance check's) where given."""
        lp = self.loop_plan
        with torch.no_grad():
            self.norm.copy_(scale["base"] * 2.0 ** scale["log2_scale"])
        runs = [loop.timed("cycle", lp.spec_cycles) for _ in range(lp.repeats)]
        counts = {}
        for _, c in runs:
            _add(counts, c)
        if totals is not None:
            _add(totals, counts)
        cycle_s = statistics.median(s for s, _ in runs) / lp.spec_cycles
        measured_tau = counts["tokens"] / counts["cycles"]
        return {"tau": measured_tau, "cycle_s": cycle_s, "spec_tokens_per_s": measured_tau * lp.batch / cycle_s,
                "speedup": measured_tau * decode_s / cycle_s}


def target_drafts_are_all_accepted(plan, loop_plan: LoopPlan, build_policy, device) -> dict:
    """q = p: the policy drafts for itself (fp64, so that its one-token forwards and the verify's six-token
    forward round alike to ~1e-16) and the loop must accept every draft."""
    policy = build_policy(plan.trainer_layers or 2, torch.float64)
    context, batch = loop_plan.contexts[0], loop_plan.batch
    capacity = round_up(context + (loop_plan.check_cycles + 1) * (plan.k + 1) + 1)
    g = torch.Generator(device=device).manual_seed(3)
    caches = policy_caches(policy, batch, capacity)
    for cache in caches:
        cache.fill_random(context, g)
    loop = Loop(policy, len(caches), None, caches, None, context, capacity, plan.k, seed=3, drafter="target")
    counts = loop.timed("cycle", loop_plan.check_cycles)[1]
    return {"cycles": counts["cycles"], "all_accepted": counts["all_accepted"],
            "tau": counts["tokens"] / counts["cycles"]}


def check_rollout_loop(plan, build_policy, build_head, device: torch.device, log, draft_vocab: int | None = None
                       ) -> tuple[list[Row], dict]:
    """The rows and the details of check `rollout_loop` (module docstring). `build_policy(layers, dtype=bf16)`;
    `draft_vocab`: the size of the draft vocabulary to time as well (None: none)."""
    loop_plan = LOOP_PLANS[plan.name]
    measured = Sweep(plan, loop_plan, lambda n: build_policy(n, torch.bfloat16), build_head, device, log,
                     draft_vocab).run()
    contexts = loop_plan.contexts
    at_real = at_real_layers(measured, contexts, plan.real_layers)
    rollout = rollout_from_loop(at_real, contexts, plan)
    z = acceptance_z(measured["counts"])
    rows = [*_context_rows(plan, measured, at_real, contexts), *_summary_rows(plan, measured, rollout, z)]
    details = {"batch": loop_plan.batch, "k": plan.k, "layers_measured": measured["layers"],
               "depths": measured["depths"], "real_layers": plan.real_layers, "cuda_graphs": measured["graphs"],
               "contexts": list(contexts), "capacity": {str(c): v for c, v in measured["capacity"].items()},
               "scaling_rule": "t(36) = t(L) + (36 - L) x (t(L) - t(L2)) / (L - L2), per context and phase: the "
                               "per-layer time x 36 + the non-layer part, both measured at L and L2 = L // 2",
               "tau_scales": {str(t): {k2: v for k2, v in s.items() if k2 != "base"}
                              for t, s in measured["scales"].items()},
               "per_context": {str(c): {"measured": {d: {**measured["per"][(d, c)]} for d in measured["depths"]},
                                        "at_real_layers": at_real[c]} for c in contexts},
               "rollout": rollout, "acceptance": {**measured["counts"], "z": z}, "paper": PAPER,
               "leaves_out": ["vLLM's scheduler and paged attention", "the prefill",
                              "the length tail: every sequence runs to the cap",
                              "attention reads the whole static buffer (context + the runs' margin)"]}
    if loop_plan.check_cycles and device.type == "cpu":
        same = target_drafts_are_all_accepted(plan, loop_plan, build_policy, device)
        details["target_as_drafter"] = same
        rows.append(Row("rollout_loop", f"q = p (the target drafts): drafts accepted, {same['cycles']:.0f} cycles",
                        f"{same['all_accepted']:.0f} of {same['cycles']:.0f} cycles accept all {plan.k}",
                        "every one", same["all_accepted"] == same["cycles"], same))
    if draft_vocab:
        subset_rows, details["draft_vocab"] = draft_vocab_report(plan, measured, at_real, rollout, contexts)
        rows.extend(subset_rows)
    return rows, details


def _context_rows(plan, measured: dict, at_real: dict, contexts) -> list[Row]:
    """Per context: tokens per second at the measured depth, and the times read at the real depth."""
    batch, deep, real = measured["batch"], measured["layers"], plan.real_layers
    rows = []
    for c in contexts:
        row, real_c = measured["per"][(deep, c)], at_real[c]
        at_paper = row["taus"].get(str(PAPER["tau"]), {})
        taus = ", ".join(f"{t['tau']:.2f}: {t['spec_tokens_per_s']:.0f}" for t in row["taus"].values())
        rows.append(Row("rollout_loop", f"{batch} sequences at {c} tokens, {deep} layers: tokens/s AR; spec at "
                        f"measured tau", f"AR {row['ar_tokens_per_s']:.0f}; {taus}",
                        f"break-even tau {row['break_even_tau']:.2f}; at tau {at_paper.get('tau', float('nan')):.2f} "
                        f"{at_paper.get('speedup', float('nan')):.2f}x", None,
                        {"break_even_tau": row["break_even_tau"], "speedup": at_paper.get("speedup")}))
        rows.append(Row("rollout_loop", f"the same at {real} layers (per-layer line through {measured['depths'][0]} "
                        f"and {measured['depths'][1]})", f"decode {real_c['decode_s'] * 1e3:.2f} ms, cycle "
                        f"{real_c['cycle_s'] * 1e3:.2f} ms", f"break-even tau {real_c['break_even_tau']:.2f}; at tau "
                        f"{PAPER['tau']} {real_c['speedup_at_paper_tau']:.2f}x (paper {PAPER['rollout_speedup']}x)",
                        None, {"break_even_tau": real_c["break_even_tau"], "speedup": real_c["speedup_at_paper_tau"]}))
    return rows


def _summary_rows(plan, measured: dict, rollout: dict, z: float) -> list[Row]:
    """The paper's rollout speedup, and the first drafts' acceptance against its expectation."""
    counts = measured["counts"]
    return [Row("rollout_loop", f"rollout speedup at tau {PAPER['tau']}, {plan.rollout_response}-token responses, "
                f"{plan.real_layers} layers", f"{rollout['speedup']:.2f}x", f"paper {PAPER['rollout_speedup']}x",
                None, {"speedup": rollout["speedup"]}),
            Row("rollout_loop", f"first-draft acceptance vs sum min(p, q), {counts['cycles']:.0f} cycles",
                f"z {z:.2f} ({counts['first_accepted'] / counts['cycles']:.4f} vs "
                f"{counts['alpha_sum'] / counts['cycles']:.4f})", f"|z| <= {Z_LIMIT:g}", abs(z) <= Z_LIMIT,
                {"z": z})]
