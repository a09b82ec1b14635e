"""Head objectives on reconstructed draft distributions q and recorded target distributions p.

alpha_k = sum_d min(p_k(d), q_k(d)) = 1 - TV(p_k, q_k), the probability that rejection sampling accepts
a draft sampled from q_k. It is estimated on the target's recorded top-k ids plus one residual bin
(target mass outside the top-k vs head mass outside those ids); q is the head's full-vocabulary softmax
gathered at the ids. Merging the tail into one bin can only raise the overlap, by at most the target
mass outside the top-k.

Without the residual bin (`residual=False`) the estimate is the top-k overlap alone, which can only be
below the true alpha, by at most the overlap outside the top-k.

Per cycle, with L = min(j, K) under verify-gated masking (j = accepted + 1 is the first rejection) or
L = K without it:
    TV  chain:  -sum_{l<=L} prod_{i<=l} alpha_i
    DCA:        -log sum_{l<=L} prod_{i<=l} alpha_i     (computed in log space)
CE and KL compare q with the recorded top-k (+ residual bin) per position and average positions 1..L.
The hybrid (a cold-start objective) is lambda CE + (1 - lambda) DCA, both over the same L, with lambda set
by the caller (the trainer: exp(-3 alpha_1), alpha_1 the previous rollout's realised first-position
acceptance, `hybrid_lambda`).
Every batch loss is a mean over cycles. Recorded p and accepted are constants.
"""

from __future__ import annotations

import math

import torch

CHAIN_OBJECTIVES = ("dca", "tv")  # on the acceptance chain
POSITION_OBJECTIVES = ("ce", "kl")  # per draft position (the ablations)
HYBRID = "hybrid"  # lambda CE + (1 - lambda) DCA, lambda given per call
STATIC_OBJECTIVES = CHAIN_OBJECTIVES + POSITION_OBJECTIVES  # need nothing but q, p and the accepted counts
OBJECTIVES = STATIC_OBJECTIVES + (HYBRID,)
ALPHA_ESTIMATES = ("residual", "topk")  # the top-k overlap plus the residual bin (an upper bound), or alone
HYBRID_ETA = 3.0  # lambda = exp(-HYBRID_ETA * alpha_1)
# A target residual below this is fp32/bf16 rounding of a top-k that holds all the mass: the bin is
# dropped, since which side of min() wins there is noise (the error stays <= the target residual).
MIN_RESIDUAL_MASS = 1e-6
# log α of a cycle position the estimate puts at exactly 0, which only a draft vocabulary makes (q is 0 at every
# recorded id, and no target residual above MIN_RESIDUAL_MASS): the smallest normal fp32, with no gradient (there
# is none to give), so that the chain's loss stays finite.
LOG_ALPHA_FLOOR = math.log(torch.finfo(torch.float32).tiny)


def _logsumexp(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """torch.logsumexp, except that a slice of only -inf (log q outside a draft vocabulary) gives -inf with a
    zero gradient: torch's gradient there is exp(-inf - -inf), NaN. Elsewhere the same values and gradients."""
    empty = torch.isneginf(x).all(dim, keepdim=True)
    value = torch.logsumexp(torch.where(empty, torch.zeros_like(x), x), dim)
    return torch.where(empty.squeeze(dim), torch.full_like(value, float("-inf")), value)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x <= 0, stable at both ends; about -69 at x = 0, with finite gradients everywhere.

    Each branch is evaluated only where it is the one kept (the other sees a harmless -1): `where` sends a
    zero gradient into the discarded branch, and 0 times that branch's infinite derivative would be NaN
    (log1p(-exp(x)) once exp(x) rounds to 1, i.e. for x in (-6e-8, 0) in fp32).
    """
    x = x.clamp(max=-1e-30)
    near = x > -math.log(2.0)
    other = torch.full_like(x, -1.0)
    return torch.where(near, torch.log(-torch.expm1(torch.where(near, x, other))),
                       torch.log1p(-torch.exp(torch.where(near, other, x))))


def _residual_logprob(logprobs: torch.Tensor, min_mass: float = 0.0) -> torch.Tensor:
    """log of the probability mass outside the given ids: [..., k] -> [...], floored at min_mass.

    For the head's q pass min_mass=MIN_RESIDUAL_MASS: below it the sum over the ids is 1 to within fp32
    rounding, so the residual (and its gradient, which divides by it) would be rounding noise; there the
    residual reads min_mass and gets no gradient (its share of any alpha is below min_mass).
    """
    top = _logsumexp(logprobs, dim=-1).clamp(max=math.log1p(-min_mass))
    return _log1mexp(top)


def _gathered_logq(draft_logits: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """log q at the ids, q = full-vocabulary softmax of the draft logits. [N, K, V], [N, K, k] -> [N, K, k]."""
    logq = torch.log_softmax(draft_logits.float(), dim=-1)
    return logq.gather(-1, topk_ids.long())


def _check(draft_logits: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor) -> None:
    assert draft_logits.ndim == 3, f"draft_logits must be [N, K, V], got {tuple(draft_logits.shape)}"
    assert topk_ids.shape == topk_logprobs.shape, (tuple(topk_ids.shape), tuple(topk_logprobs.shape))
    assert topk_ids.ndim == 3 and topk_ids.shape[:2] == draft_logits.shape[:2], (
        f"topk_ids must be [N, K, k] with N, K of draft_logits, got {tuple(topk_ids.shape)}")


def log_acceptance_rates(draft_logits: torch.Tensor, topk_ids: torch.Tensor,
                         topk_logprobs: torch.Tensor) -> torch.Tensor:
    """log alpha [N, K] from draft_logits [N, K, V], topk_ids [N, K, k], topk_logprobs [N, K, k].

    Stays finite (with finite gradients) however small alpha gets.
    """
    _check(draft_logits, topk_ids, topk_logprobs)
    return log_acceptance_rates_at(_gathered_logq(draft_logits, topk_ids), topk_logprobs)


def log_acceptance_rates_at(logq: torch.Tensor, topk_logprobs: torch.Tensor, residual: bool = True) -> torch.Tensor:
    """log alpha [..., ] from log q and log p at the same recorded ids ([..., k] each); without `residual`, the
    top-k overlap alone (a lower bound)."""
    logp = topk_logprobs.float()
    log_min = torch.minimum(logp, logq)  # [..., k]
    if residual:
        residual_p = _residual_logprob(logp)
        residual = torch.where(residual_p > math.log(MIN_RESIDUAL_MASS),
                               torch.minimum(residual_p, _residual_logprob(logq, MIN_RESIDUAL_MASS)),
                               torch.full_like(residual_p, float("-inf")))
        log_min = torch.cat([log_min, residual.unsqueeze(-1)], dim=-1)
    log_alpha = _logsumexp(log_min, dim=-1)
    return torch.where(torch.isneginf(log_alpha), torch.full_like(log_alpha, LOG_ALPHA_FLOOR), log_alpha)


def acceptance_rates(draft_logits: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor) -> torch.Tensor:
    """alpha [N, K] = sparse sum_d min(p, q) over the top-k ids plus one residual bin."""
    return log_acceptance_rates(draft_logits, topk_ids, topk_logprobs).exp()


def chain_lengths(accepted: torch.Tensor | None, num_cycles: int, k: int, device=None) -> torch.Tensor:
    """L per cycle: min(accepted + 1, K) under VGM (first position always kept), K without it."""
    if accepted is None:
        return torch.full((num_cycles,), k, dtype=torch.long, device=device)
    assert accepted.shape == (num_cycles,), f"accepted must be [N={num_cycles}], got {tuple(accepted.shape)}"
    return (accepted.long() + 1).clamp(max=k)


def chain_loss(alpha: torch.Tensor, accepted: torch.Tensor | None = None, objective: str = "dca", *,
               alpha_is_log: bool = False) -> torch.Tensor:
    """Mean over cycles of the DCA or TV chain loss. alpha [N, K] (or log alpha with alpha_is_log).

    accepted [N] (0..K) enables verify-gated masking: the chain sum stops at and includes position
    min(accepted + 1, K). None: no masking, the chain runs over all K positions.
    """
    return chain_loss_per_cycle(alpha, accepted, objective, alpha_is_log=alpha_is_log).mean()


def chain_loss_per_cycle(alpha: torch.Tensor, accepted: torch.Tensor | None = None, objective: str = "dca", *,
                         alpha_is_log: bool = False) -> torch.Tensor:
    if objective not in CHAIN_OBJECTIVES:
        raise ValueError(f"chain loss objective must be one of {CHAIN_OBJECTIVES}, got {objective!r}")
    assert alpha.ndim == 2, f"alpha must be [N, K], got {tuple(alpha.shape)}"
    num_cycles, k = alpha.shape
    log_alpha = alpha.float() if alpha_is_log else alpha.float().log()
    lengths = chain_lengths(accepted, num_cycles, k, device=alpha.device)
    log_terms = torch.cumsum(log_alpha, dim=1)  # log prod_{i<=l} alpha_i, [N, K]
    # Masked positions get -inf through `where` (not arithmetic), so no gradient reaches them.
    keep = torch.arange(k, device=alpha.device)[None, :] < lengths[:, None]
    log_terms = torch.where(keep, log_terms, torch.full_like(log_terms, float("-inf")))
    log_chain = torch.logsumexp(log_terms, dim=1)  # log M, [N]
    return -log_chain if objective == "dca" else -log_chain.exp()


def position_loss(draft_logits: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor,
                  accepted: torch.Tensor | None = None, objective: str = "kl") -> torch.Tensor:
    """Mean over cycles of the per-position CE or KL(p || q), averaged over positions 1..L.

    p is the recorded top-k plus its residual bin; q is gathered at the same ids plus its own residual.
    """
    return position_loss_per_cycle(draft_logits, topk_ids, topk_logprobs, accepted, objective).mean()


def position_loss_per_cycle(draft_logits: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor,
                            accepted: torch.Tensor | None = None, objective: str = "kl") -> torch.Tensor:
    _check(draft_logits, topk_ids, topk_logprobs)
    return position_loss_per_cycle_at(_gathered_logq(draft_logits, topk_ids), topk_logprobs, accepted, objective)


def position_loss_per_cycle_at(logq: torch.Tensor, topk_logprobs: torch.Tensor, accepted: torch.Tensor | None = None,
                               objective: str = "kl") -> torch.Tensor:
    """`position_loss_per_cycle` from log q at the recorded ids, logq [N, K, k]."""
    if objective not in POSITION_OBJECTIVES:
        raise ValueError(f"position loss objective must be one of {POSITION_OBJECTIVES}, got {objective!r}")
    num_cycles, k = logq.shape[:2]
    logp = topk_logprobs.float()
    logp_all = torch.cat([logp, _residual_logprob(logp).unsqueeze(-1)], dim=-1)  # [N, K, k+1]
    logq_all = torch.cat([logq, _residual_logprob(logq, MIN_RESIDUAL_MASS).unsqueeze(-1)], dim=-1)
    p = logp_all.exp()
    cross = -(p * logq_all).sum(-1)  # [N, K]
    if objective == "kl":
        # p log p is 0 where p is 0; where() keeps the -inf of an empty residual bin out of the sum.
        entropy_term = torch.where(p > 0, p * logp_all, torch.zeros_like(p)).sum(-1)
        per_position = cross + entropy_term
    else:
        per_position = cross
    lengths = chain_lengths(accepted, num_cycles, k, device=logq.device)
    keep = (torch.arange(k, device=logq.device)[None, :] < lengths[:, None]).float()
    return (per_position * keep).sum(1) / lengths.float()


def head_loss_per_cycle(draft_logits: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor,
                        accepted: torch.Tensor | None, objective: str = "dca"
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss per cycle [N], alpha [N, K] detached) for any objective; `accepted` None disables VGM."""
    _check(draft_logits, topk_ids, topk_logprobs)
    return head_loss_per_cycle_at(_gathered_logq(draft_logits, topk_ids), topk_logprobs, accepted, objective)


def head_loss_per_cycle_at(logq: torch.Tensor, topk_logprobs: torch.Tensor, accepted: torch.Tensor | None,
                           objective: str = "dca", *, alpha_residual: bool = True,
                           hybrid_lambda: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`head_loss_per_cycle` from log q at the recorded ids, logq [N, K, k]: what the head update computes
    without full-vocabulary logits. Positions past the chain length (VGM) get no gradient; they must be
    finite. `alpha_residual`: the α estimate (module docstring); `hybrid_lambda`: the hybrid's λ."""
    if objective not in OBJECTIVES:
        raise ValueError(f"the head's objective must be one of {OBJECTIVES}, got {objective!r}")
    if (objective == HYBRID) != (hybrid_lambda is not None):
        raise ValueError(f"hybrid_lambda is the {HYBRID} objective's weight, and only its: got {hybrid_lambda!r} "
                         f"for {objective!r}")
    log_alpha = log_acceptance_rates_at(logq, topk_logprobs, residual=alpha_residual)
    if objective in CHAIN_OBJECTIVES:
        loss = chain_loss_per_cycle(log_alpha, accepted, objective, alpha_is_log=True)
    elif objective == HYBRID:
        loss = (hybrid_lambda * position_loss_per_cycle_at(logq, topk_logprobs, accepted, "ce")
                + (1.0 - hybrid_lambda) * chain_loss_per_cycle(log_alpha, accepted, "dca", alpha_is_log=True))
    else:
        loss = position_loss_per_cycle_at(logq, topk_logprobs, accepted, objective)
    return loss, log_alpha.detach().exp()


def hybrid_lambda(alpha_1: float) -> float:
    """The hybrid's weight of CE, exp(-3 alpha_1): 1 from a head that drafts nothing acceptable, e^-3 from one
    whose first drafts are always accepted (alpha_1: the previous rollout's realised acceptance there)."""
    if not 0.0 <= alpha_1 <= 1.0:
        raise ValueError(f"alpha_1 is an acceptance rate in [0, 1], got {alpha_1}")
    return math.exp(-HYBRID_ETA * alpha_1)
