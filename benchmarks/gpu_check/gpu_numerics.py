"""Checks (a) and (b) of the GPU check: the head's math at the policy's shapes, in bf16 and fp32.

(a) Batched draft-path reconstruction (`reconstruct_draft_logits`; the head update, `bench_common.head_update`,
    in chunks that cut through a response and in one chunk) against chain-by-chain drafting
    (`reference_drafting.chain_by_chain`): log q at every draft position over the whole vocabulary, the
    head's gradients and the loss.
(b) α on the target's top-64 (`acceptance_rates`, log-probs stored in bf16 as records store them)
    against the dense α = sum over the vocabulary of min(p, q).

Tolerances, (a). Both paths compute the same function; they differ only in rounding (other kernels,
other reduction orders, attention merged by log-sum-exp in blocks). How far rounding moves this very
computation in a dtype is measured, not guessed: eps = the chain-by-chain result in that dtype against
the same computation in fp64 (the same weights and inputs, upcast exactly; transformers' RMSNorm and
RoPE and the draft logits stay fp32, far below bf16's error). The batched path may round more than the
chain, by a factor no premise fixes: on an H100 its fp32 gradients were 3.2-3.9 x the chain's distance
from fp64 (docs/gpu.md). What the bound must separate is rounding in the row's dtype from everything
else: a wrong key or position moves log q by the depth-to-depth scale (printed beside it), and a path
that silently runs a step in the next lower precision (TF32 or fp16, a 10-bit mantissa, under fp32;
fp8 e4m3 under bf16) rounds 2^13 (fp32) or 2^4 (bf16) times as much. So the bound is
noise_factor(dtype) x eps, the geometric middle between the dtype's rounding and the next lower one's:
sqrt(u_lower / u) = 2^6.5 for fp32, 4 for bf16 (+ one unit roundoff of the reference's scale, should eps
vanish). eps is a max over the log q entries, an L2 norm per gradient tensor and a mean per-cycle error
for the loss: statistics stable enough to hold to a factor (`_compare_grads`, `_compare_loss` say why).
"""

from __future__ import annotations

import math

import torch

from benchmarks.gpu_check.gpu_report import Row, sci
from benchmarks.gpu_check.gpu_world import Plan, head_copy
from benchmarks.shared.bench_common import accepted_at_tau, head_update
from openrlhf_growmtp.core import MTPHead, SequenceRecord, acceptance_rates, reconstruct_draft_logits
from openrlhf_growmtp.core.objectives import head_loss_per_cycle
from openrlhf_growmtp.core.recompute import worth_recomputing
from growmtp_lab.reference_drafting import chain_by_chain
from growmtp_lab.worlds.toy import synthetic_record

# The next lower precision a path in each dtype could slip into unnoticed: TF32 matmuls (fp16's 10-bit
# mantissa) under fp32, fp8 e4m3 under bf16.
NEXT_LOWER = {torch.float32: torch.float16, torch.bfloat16: torch.float8_e4m3fn}
# (b)'s targets: logits with this spread over the vocabulary (top-64 mass ~0.88 on Gaussian logits at
# V=151,936, as a trained model's next-token distributions hold most of their mass in few ids),
# correlated with the head's own logits with this coefficient so that alpha is neither ~0 nor ~1
# (~0.5 on Gaussian logits at V=151,936: deeper positions of check (d)'s chains see enough trials).
TARGET_LOGIT_STD, TARGET_CORRELATION = 5.0, 0.95
# (b): the sparse and dense alphas are fp32 sums of up to V terms <= 1 (error ~ log2(V) x 2^-24 ~ 1e-6
# each), and the core drops a residual bin below 1e-6 (MIN_RESIDUAL_MASS); 1e-5 covers both.
FP32_SUM_SLACK = 1e-5


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def noise_factor(dtype: torch.dtype) -> float:
    """(a)'s bound, in units of the chain's own rounding: sqrt(u_lower / u), as far in log from this dtype's
    rounding as from the next lower precision's (module docstring)."""
    return math.sqrt(unit_roundoff(NEXT_LOWER[dtype]) / unit_roundoff(dtype))


def make_records(plan: Plan, seed: int = 0) -> list[SequenceRecord]:
    """One response per prompt length, `recon_cycles` cycles each at τ; hidden states N(0, 1) as the
    target's final norm leaves them (unit RMS); targets drawn over the first 4,096 ids (they only weigh
    the loss here)."""
    g = torch.Generator().manual_seed(seed)
    vocab = min(plan.config.vocab_size, 4096)
    return [synthetic_record(prompt_len=prompt, accepted=accepted_at_tau(plan.recon_cycles, plan.tau,
                                                                          plan.k, g),
                             depth=plan.k, topk=plan.topk, vocab_size=vocab,
                             hidden_size=plan.config.hidden_size, seed=seed + i)
            for i, prompt in enumerate(plan.recon_prompts)]


def _grads(head: MTPHead) -> dict[str, torch.Tensor]:
    out = {name: p.grad.detach().double().clone() for name, p in head.named_parameters()}
    head.zero_grad(set_to_none=True)
    return out


def chain_run(head: MTPHead, records, hiddens) -> dict:
    """Chain by chain: log q [N, K, V], the loss (DCA + VGM, mean over cycles), per cycle, and its gradients."""
    head.zero_grad(set_to_none=True)
    logits = chain_by_chain(head, records, hiddens)
    device = logits.device
    loss, _ = head_loss_per_cycle(logits, torch.cat([r.topk_ids for r in records]).to(device),
                                  torch.cat([r.topk_logprobs for r in records]).to(device),
                                  torch.cat([r.accepted for r in records]).to(device), "dca")
    per_cycle = loss.detach().double()
    loss.mean().backward()
    return {"logq": logits.detach().log_softmax(-1), "loss": per_cycle.mean().item(), "per_cycle": per_cycle,
            "grads": _grads(head)}


def batched_run(head: MTPHead, records, hiddens, chunks: tuple[int, ...]) -> dict:
    """Batched: log q (chunks of chunks[0] cycles), and per chunking the head update's loss and gradients."""
    head.zero_grad(set_to_none=True)
    with torch.no_grad():
        logits = reconstruct_draft_logits(head, records, hiddens, chunk_cycles=chunks[0])
    out = {"logits": logits, "logq": logits.log_softmax(-1), "loss": {}, "grads": {}}
    for chunk in chunks:
        stats = head_update(head, records, hiddens, chunk)
        if not stats.finite:
            raise RuntimeError(f"the head update's loss is not finite ({next(head.parameters()).dtype}, chunk {chunk})")
        out["loss"][chunk], out["grads"][chunk] = stats.loss, _grads(head)
    return out


def check_reconstruction(plan: Plan, head: MTPHead, log) -> tuple[list[Row], dict, torch.Tensor]:
    """(rows, details, the bf16 batched draft logits [N, K, V] for check (b))."""
    records = make_records(plan)
    chunks = (plan.recon_chunk, plan.chunk_cycles)
    total = sum(r.num_cycles for r in records)
    hidden_bf16 = [r.hidden.to(device=head.embed_tokens.weight.device, dtype=torch.bfloat16) for r in records]
    heads = {torch.float64: head_copy(head, torch.float64), torch.float32: head_copy(head, torch.float32),
             torch.bfloat16: head}
    runs = {}
    for dtype, h in heads.items():
        hiddens = [x.to(dtype) for x in hidden_bf16]
        runs[dtype] = {"chain": chain_run(h, records, hiddens)}
        if dtype != torch.float64:
            runs[dtype]["batched"] = batched_run(h, records, hiddens, chunks)
        log(f"  (a) {str(dtype).replace('torch.', '')}: chain by chain and batched done")
    ref = runs[torch.float64]["chain"]
    depth_scale = (ref["logq"][:, 0] - ref["logq"][:, 1]).abs().max().item()
    rows, details = [], {"cycles": total, "prompts": list(plan.recon_prompts), "chunks": list(chunks),
                         "max_position": max(int(r.start[-1]) + plan.k for r in records),
                         "depth_to_depth_max_abs_dlogq": depth_scale}
    for dtype in (torch.bfloat16, torch.float32):
        name, u, factor = str(dtype).replace("torch.", ""), unit_roundoff(dtype), noise_factor(dtype)
        chain, batched = runs[dtype]["chain"], runs[dtype]["batched"]
        values = _compare_values(chain["logq"], batched["logq"], ref["logq"], u, factor)
        grads = _compare_grads(chain["grads"], batched["grads"], ref["grads"], u, factor)
        loss = _compare_loss(chain, batched["loss"], ref, factor)
        # at Qwen3-4B's widths a chunking of 1024 cycles recomputes the MLP's elementwise work, 48 does not
        recompute = {chunk: worth_recomputing(heads[dtype], chunk * plan.k) for chunk in chunks}
        details[name] = {"noise_factor": factor, "log_q": values, "gradients": grads, "loss": loss,
                         "recompute_by_chunk": recompute}
        rows.append(Row("a", f"log q, batched vs chain by chain, {name}", f"max|d| {sci(values['max_abs_diff'])}",
                        f"<= {factor:.3g} x {sci(values['eps'])} (vs fp64); depths differ by {depth_scale:.2f}",
                        values["max_abs_diff"] <= values["tolerance"], values))
        on = [str(c) for c in chunks if recompute[c]]
        rows.append(Row("a", f"gradients, chunks of {' and '.join(map(str, chunks))} cycles, {name}"
                        + (f" (recompute at {', '.join(on)})" if on else ""),
                        f"worst |d|2/tol {grads['worst_ratio']:.2f} ({grads['worst_tensor']})",
                        f"<= 1; cos vs fp64 >= {grads['min_cosine_vs_fp64']:.5f}", grads["worst_ratio"] <= 1.0, grads))
        rows.append(Row("a", f"loss, batched vs chain by chain, {name}", f"|d| {sci(loss['max_abs_diff'])}",
                        f"<= {sci(loss['tolerance'])}", loss["max_abs_diff"] <= loss["tolerance"], loss))
    return rows, details, runs[torch.bfloat16]["batched"]["logits"]


def _compare_values(chain, batched, ref, u, factor) -> dict:
    eps = (chain - ref).abs().max().item()
    return {"max_abs_diff": (batched - chain).abs().max().item(), "eps": eps, "tolerance": factor * eps + u,
            "batched_vs_fp64": (batched - ref).abs().max().item()}


def _compare_grads(chain: dict, batched: dict, ref: dict, u: float, factor: float) -> dict:
    """Per parameter tensor, L2 norms of the differences (a max over a few hundred entries of a norm
    weight is too noisy a statistic to hold to a factor): ||batched - chain|| <= factor x
    ||chain - fp64|| + u x ||fp64||, for each chunking."""
    worst, worst_name, per_tensor, min_cos = 0.0, "", {}, 1.0
    for name, want in ref.items():
        eps = (chain[name] - want).norm().item()
        tol = factor * eps + u * want.norm().item()
        diff = max((got[name] - chain[name]).norm().item() for got in batched.values())
        cos = min(torch.nn.functional.cosine_similarity(got[name].flatten(), want.flatten(), dim=0).item()
                  for got in batched.values())
        per_tensor[name] = {"l2_diff": diff, "eps_l2": eps, "tolerance": tol, "l2": want.norm().item(),
                            "cosine_vs_fp64": cos}
        min_cos = min(min_cos, cos)
        if diff / tol > worst or not worst_name:
            worst, worst_name = diff / tol, name
    return {"worst_ratio": worst, "worst_tensor": worst_name, "min_cosine_vs_fp64": min_cos, "tensors": per_tensor}


def _compare_loss(chain: dict, batched: dict, ref: dict, factor: float) -> dict:
    """The loss is a mean over cycles, so |loss_b - loss_c| <= mean_r |l_b,r - l_c,r|: the bound takes eps
    as mean_r |l_c,r - l_fp64,r|, a stable statistic where one scalar's error could cancel by chance.
    The objective is fp32 in every dtype; each path sums the per-cycle losses in its own order (groups,
    chunks): up to cycles x 2^-24 x mean |l| apart."""
    eps = (chain["per_cycle"] - ref["per_cycle"]).abs().mean().item()
    terms, scale = chain["per_cycle"].numel(), ref["per_cycle"].abs().mean().item()
    return {"max_abs_diff": max(abs(v - chain["loss"]) for v in batched.values()), "eps_mean_per_cycle": eps,
            "tolerance": factor * eps + terms * unit_roundoff(torch.float32) * scale, "chain": chain["loss"],
            "batched": batched, "fp64": ref["loss"]}


def check_alpha(draft_logits: torch.Tensor, topk: int, seed: int = 0) -> tuple[Row, dict, torch.Tensor]:
    """(row, details, the targets' log p [N, K, V] for check (d)). draft_logits [N, K, V] (bf16 values).

    Bound per row: merging the target's mass outside the top-64 into one bin can only raise the overlap, by
    at most that mass; storing log p in bf16 moves each top-64 p_i by |delta_i| (computed exactly from
    the stored values), which moves sum min(p, q) over the top-64 by at most sum |delta_i| and the
    residual bin by as much again. So  -2 sum|delta| <= sparse - dense <= outside + 2 sum|delta|
    (+ FP32_SUM_SLACK on both sides).
    """
    z = draft_logits.float()
    g = torch.Generator(device=z.device).manual_seed(seed)
    standard = (z - z.mean(-1, keepdim=True)) / z.std(-1, keepdim=True)
    noise = torch.randn(z.shape, generator=g, device=z.device)
    rho = TARGET_CORRELATION
    logp = torch.log_softmax(TARGET_LOGIT_STD * (rho * standard + math.sqrt(1 - rho * rho) * noise), dim=-1)
    del noise, standard
    top = logp.topk(topk, dim=-1)
    stored = top.values.to(torch.bfloat16)
    sparse = acceptance_rates(z, top.indices, stored)
    p = logp.exp()
    dense = torch.minimum(p, torch.softmax(z, dim=-1)).sum(-1)
    outside = (1.0 - top.values.exp().sum(-1)).clamp(min=0.0)
    delta = (top.values.exp() - stored.float().exp()).abs().sum(-1)
    diff = sparse - dense
    upper, lower = outside + 2 * delta + FP32_SUM_SLACK, 2 * delta + FP32_SUM_SLACK
    use = torch.maximum(diff / upper, -diff / lower).max().item()
    details = {"rows": int(diff.numel()), "worst_use_of_bound": use, "max_abs_diff": diff.abs().max().item(),
               "mean_abs_diff": diff.abs().mean().item(), "mean_outside_mass": outside.mean().item(),
               "max_outside_mass": outside.max().item(), "mean_bf16_shift": delta.mean().item(),
               "mean_alpha_dense": dense.mean().item(), "mean_alpha_top64": sparse.mean().item()}
    row = Row("b", f"alpha on the top-{topk} vs dense ({diff.numel()} rows)",
              f"max|d| {sci(details['max_abs_diff'])}, mean {sci(details['mean_abs_diff'])}",
              f"outside mass + 2 x bf16 shift per row (worst use {use:.2f}; mean outside "
              f"{details['mean_outside_mass']:.3f})", use <= 1.0, details)
    return row, details, logp
