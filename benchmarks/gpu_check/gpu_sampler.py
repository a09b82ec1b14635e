"""The GPU check's rejection sampler, and check (d): its acceptance against E_{x~q}[min(1, p(x)/q(x))].

The sampler is the check's own, in torch, since vLLM's is not on the GPU machine; the rollout loop
(`gpu_loop.py`) and the reference drafter (`gpu_drafter.py`) draw with it too. Terms as in `core/records.py`: a
chain drafts d_1..d_K, d_j ~ q_j; d_j is *accepted* with probability min(1, p_j(d_j) / q_j(d_j)) while every
earlier draft was (`accepted_count`); at the first rejection j the *recovered* token is drawn from
norm(max(p_j - q_j, 0)) (`residual`); when all K pass, the *bonus* token is drawn from p_{K+1}. `rejection_step`
does it for a batch of sequences, each with its own rows; tokens are sampled by the exponential race
(`sample`: argmax w / E, E ~ Exp(1)), exact for unnormalised weights and free of host synchronisation, where
torch.multinomial is not. Check (d) holds the rule to its law on fixed rows (no context, `rejection_sample`:
2^20 chains of one (p, q) pair, its recovered tokens drawn per position), where position j accepts with
probability alpha_j = sum min(p_j, q_j) and the accepted count A has P(A >= l) = prod_{i<=l} alpha_i.

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

Z_LIMIT = 5.0
P_MIN = 1e-6
MIN_EXPECTED = 5.0
BIN_IDS = 32


def sample(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One index per row of weights [..., V] (>= 0, unnormalised) with P(i) = w_i / sum w: the exponential
    race argmax w / E. E is floored at the smallest normal float, as a draw of exactly 0 would pick its id
    whatever its weight."""
    race = torch.empty_like(weights).exponential_(generator=generator).clamp_(min=torch.finfo(weights.dtype).tiny)
    return (weights / race).argmax(-1)


def accepted_count(p_draft: torch.Tensor, q_draft: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Drafts accepted before the first rejection, [...] in 0..K, from p_j(d_j), q_j(d_j) and uniforms u, each
    [..., K]: d_j passes where u < p / q, with probability min(1, p / q)."""
    return (u * q_draft < p_draft).long().cumprod(dim=-1).sum(dim=-1)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(p - q, 0): the unnormalised law of the token recovered at a rejection."""
    return (p - q).clamp(min=0.0)


def rejection_step(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, generator: torch.Generator | None,
                   ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """p [B, K+1, V] the target's rows, q [B, K, V] the drafter's, drafts [B, K] sampled from q.

    With `ids` [N] (a draft vocabulary), q [B, K, N] holds the drafter's rows over those ids alone (zero at
    every other id) and drafts [B, K] are places in `ids`: the same draws and results as q scattered to
    [B, K, V], without writing its zeros (the residual is p itself outside the ids).

    Returns (accepted [B] in 0..K, emitted [B]: the recovered token at the first rejection, or the bonus)."""
    k = q.shape[1]
    tokens = drafts if ids is None else ids[drafts]
    p_draft = p[:, :k].gather(2, tokens[..., None])[..., 0]
    q_draft = q.gather(2, drafts[..., None])[..., 0]
    u = torch.rand(p_draft.shape, generator=generator, device=p.device, dtype=p.dtype)
    accepted = accepted_count(p_draft, q_draft, u)
    stop = accepted.clamp(max=k - 1)[:, None, None]
    p_stop, q_stop = (rows.gather(1, stop.expand(-1, 1, rows.shape[-1]))[:, 0] for rows in (p, q))
    if ids is None:
        recovered = residual(p_stop, q_stop)
    else:
        recovered = p_stop.index_copy(1, ids, residual(p_stop.index_select(1, ids), q_stop))
    return accepted, sample(torch.where((accepted == k)[:, None], p[:, k], recovered), generator)


def rejection_sample(p: torch.Tensor, q: torch.Tensor, trials: int, generator: torch.Generator
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """`trials` chains of one (p, q) pair: p [K+1, V] target rows (the last for the bonus), q [K, V] draft rows,
    both normalised. The chains share their rows, so the recovered tokens of each position are drawn together
    (rejection_step's per-chain rows would be [trials, V] at the vocabulary's size).

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
    z_first = (rate - a1) / math.sqrt(max(a1 * (1 - a1), 1e-12) / trials)
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
