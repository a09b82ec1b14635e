"""Check (d) of the GPU check: the rejection rule's acceptance against E_{x~q}[min(1, p(x)/q(x))].

The rule is the lab's one reference sampler (`growmtp_lab/reference_drafting.py`, terms there), in torch since
vLLM's is not on the GPU machine; the loop (`gpu_loop.py`) draws with it. Check (d) holds the rule to its law on
fixed rows (no context, `rejection_sample`: 2^20 chains of one (p, q) pair, its recovered tokens drawn per
position), where position j accepts with probability alpha_j = sum min(p_j, q_j) and the accepted count A has
P(A >= l) = prod_{i<=l} alpha_i.

What is checked, on `trials` independent chains per (p, q) pair:
- the first position's acceptance rate against alpha_1, within Z_LIMIT standard errors sqrt(a(1-a)/n);
- the mean accepted count against sum_l prod_{i<=l} alpha_i (its variance computed from the same law);
- at every position, the token emitted there by the chains that reached it (accepted, recovered or bonus)
  is distributed as p_j: Pearson's chi-square over the ids of p_j's and q_j's top 32 that expect at
  least MIN_EXPECTED counts, the rest in one bin, with a p-value of at least P_MIN.
Z_LIMIT = 5 (two-sided 5.7e-7) and P_MIN = 1e-6: over the ~30 tests of a run the chance of a false
failure is below 1e-4, while at 2^20 trials a bias of 0.5% in an acceptance rate is ~10 standard errors.
"""

from __future__ import annotations

import math

import torch

from benchmarks.gpu_check.gpu_report import Row
from growmtp_lab.reference_drafting import acceptance_z, accepted_count, residual

Z_LIMIT = 5.0
P_MIN = 1e-6
MIN_EXPECTED = 5.0
BIN_IDS = 32


def rejection_sample(p: torch.Tensor, q: torch.Tensor, trials: int, generator: torch.Generator
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """`trials` chains of one (p, q) pair: p [K+1, V] target rows (the last for the bonus), q [K, V] draft rows,
    both normalised. The chains share their rows, so the recovered tokens of each position are drawn together
    (`rejection_step`'s per-chain rows would be [trials, V] at the vocabulary's size).

    Returns (accepted [trials] in 0..K, emitted [trials, K+1]: the token each chain emits at each
    position, -1 past its recovered or bonus token)."""
    assert p.ndim == q.ndim == 2 and p.shape[0] == q.shape[0] + 1 and p.shape[1] == q.shape[1], (p.shape, q.shape)
    depth = q.shape[0]
    drafts = torch.stack([torch.multinomial(q[j], trials, replacement=True, generator=generator)
                          for j in range(depth)], dim=1)  # [trials, K]
    u = torch.rand(trials, depth, generator=generator, device=q.device, dtype=q.dtype)
    accepted = accepted_count(p[:depth].gather(1, drafts.T).T, q.gather(1, drafts.T).T, u)
    emitted = torch.full((trials, depth + 1), -1, dtype=torch.long, device=q.device)
    keep = torch.arange(depth, device=q.device)[None, :] < accepted[:, None]
    emitted[:, :depth] = torch.where(keep, drafts, emitted[:, :depth])
    for j in range(depth + 1):
        stopped = accepted == j
        count = int(stopped.sum())
        if count == 0:
            continue
        source = residual(p[j], q[j]) if j < depth else p[j]
        emitted[stopped, j] = torch.multinomial(source / source.sum(), count, replacement=True, generator=generator)
    return accepted, emitted


def sampler_statistics(p: torch.Tensor, q: torch.Tensor, accepted: torch.Tensor, emitted: torch.Tensor) -> dict:
    """The three tests above for one (p, q) pair and one sampler's output."""
    depth, trials = q.shape[0], accepted.shape[0]
    alpha = torch.minimum(p[:depth], q).sum(-1).double()  # [K]
    survive = torch.cumprod(alpha, 0)  # P(A >= l), l = 1..K
    rate = (accepted >= 1).double().mean().item()
    a1 = alpha[0].item()
    z_first = acceptance_z({"cycles": trials, "first_accepted": rate * trials, "alpha_sum": a1 * trials,
                            "alpha_var": a1 * (1 - a1) * trials})
    mean = survive.sum().item()
    second = ((2 * torch.arange(1, depth + 1, dtype=torch.float64, device=p.device) - 1) * survive).sum().item()
    z_mean = (accepted.double().mean().item() - mean) / math.sqrt(max(second - mean * mean, 1e-12) / trials)
    positions = []
    for j in range(depth + 1):
        reached = emitted[:, j] >= 0
        tokens = emitted[reached, j]
        positions.append(chi_square(tokens, p[j], q[j] if j < depth else p[j]))
    return {"alpha": alpha.tolist(), "first_rate": rate, "z_first": z_first,
            "mean_accepted": accepted.double().mean().item(), "expected_mean_accepted": mean, "z_mean": z_mean,
            "positions": positions}


def chi_square(tokens: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> dict:
    """Pearson's chi-square of `tokens` against p over the ids of p's and q's top BIN_IDS expecting at
    least MIN_EXPECTED counts, one bin for the rest; p-value from the regularised upper incomplete gamma."""
    n = int(tokens.numel())
    ids = torch.unique(torch.cat([p.topk(BIN_IDS).indices, q.topk(BIN_IDS).indices]))
    ids = ids[n * p[ids] >= MIN_EXPECTED]
    if n == 0 or ids.numel() == 0:
        return {"n": n, "bins": 0, "chi2": None, "p_value": None}
    counts = torch.bincount(tokens, minlength=p.shape[0]).double()
    observed, expected = counts[ids], n * p[ids].double()
    rest_observed, rest_expected = n - observed.sum(), n - expected.sum()
    if rest_expected >= MIN_EXPECTED:
        observed = torch.cat([observed, rest_observed[None]])
        expected = torch.cat([expected, rest_expected[None]])
    else:  # too little mass for a bin of its own: it joins the smallest bin
        smallest = torch.argmin(expected)
        observed[smallest] += rest_observed
        expected[smallest] += rest_expected
    if expected.numel() < 2:
        return {"n": n, "bins": int(expected.numel()), "chi2": None, "p_value": None}
    chi2 = ((observed - expected) ** 2 / expected).sum()
    dof = expected.numel() - 1
    p_value = torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), chi2.cpu() / 2).item()
    return {"n": n, "bins": int(expected.numel()), "chi2": chi2.item(), "p_value": p_value}


def check_sampler(logp: torch.Tensor, draft_logits: torch.Tensor, chains: int, trials: int, seed: int = 0
                  ) -> tuple[list[Row], dict]:
    """Rejection-sample `chains` (p, q) chains: cycle c's K positions (q from draft_logits [N, K, V], p from
    the targets' logp [N, K, V]), with the next cycle's first target row as the bonus row."""
    assert logp.shape[0] > chains, "one more cycle than chains is needed for the bonus rows"
    g = torch.Generator(device=logp.device).manual_seed(seed)
    results = []
    for c in range(chains):
        p = torch.cat([logp[c], logp[c + 1, :1]]).double().softmax(-1)  # renormalised in fp64
        q = draft_logits[c].double().softmax(-1)
        accepted, emitted = rejection_sample(p, q, trials, g)
        results.append(sampler_statistics(p, q, accepted, emitted))
    z_first = max(abs(r["z_first"]) for r in results)
    z_mean = max(abs(r["z_mean"]) for r in results)
    tests = [pos for r in results for pos in r["positions"] if pos["p_value"] is not None]
    p_min = min(pos["p_value"] for pos in tests) if tests else None
    first = results[0]
    rows = [
        Row("d", f"first-position acceptance vs sum min(p, q), {chains} x {trials} chains",
            f"max|z| {z_first:.2f} ({first['first_rate']:.4f} vs {first['alpha'][0]:.4f}, ...)",
            f"|z| <= {Z_LIMIT:g}", z_first <= Z_LIMIT, {"max_abs_z": z_first}),
        Row("d", "mean accepted count vs sum_l prod alpha", f"max|z| {z_mean:.2f} ({first['mean_accepted']:.3f} vs "
            f"{first['expected_mean_accepted']:.3f}, ...)", f"|z| <= {Z_LIMIT:g}", z_mean <= Z_LIMIT,
            {"max_abs_z": z_mean}),
        Row("d", "emitted token ~ p at each position (chi-square)",
            f"min p-value {p_min:.2g} over {len(tests)} tests" if tests else "no test had enough counts",
            f">= {P_MIN:g}", bool(tests) and p_min >= P_MIN, {"min_p_value": p_min, "tests": len(tests)}),
    ]
    return rows, {"chains": chains, "trials": trials, "results": results}
