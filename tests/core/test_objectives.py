"""Objectives: sparse alpha vs the full vocabulary, DCA vs TV, verify-gated masking, CE/KL."""

import math

import pytest
import torch

from openrlhf_growmtp.core import (HeadLossConfig, acceptance_rates, chain_loss, head_loss_backward, position_loss,
                                   validate_record)
from openrlhf_growmtp.core.objectives import log_acceptance_rates, position_loss_per_cycle
from helpers.tiny import make_head, make_records


def _full_alpha(draft_logits, target_logprobs):
    """Reference: sum_d min(p, q) over the whole vocabulary."""
    return torch.minimum(target_logprobs.exp(), draft_logits.softmax(-1)).sum(-1)


def _topk(target_logprobs, k):
    top = target_logprobs.topk(k, dim=-1)
    return top.indices, top.values


def test_sparse_alpha_error_is_bounded_by_target_mass_outside_topk():
    g = torch.Generator().manual_seed(0)
    draft = torch.randn(64, 5, 300, generator=g) * 2
    target = torch.log_softmax(torch.randn(64, 5, 300, generator=g) * 2, -1)
    ids, lp = _topk(target, 16)
    sparse, full = acceptance_rates(draft, ids, lp), _full_alpha(draft, target)
    outside = 1 - lp.exp().sum(-1)
    assert outside.min() > 0.05  # a real truncation, not a no-op
    assert ((sparse - full).abs() <= outside + 1e-6).all()
    assert (sparse >= full - 1e-6).all()  # merging the tail into one bin can only raise the overlap


def test_sparse_alpha_is_exact_on_peaked_targets():
    g = torch.Generator().manual_seed(1)
    draft = torch.randn(32, 3, 500, generator=g)
    scores = torch.randn(32, 3, 500, generator=g)
    scores[..., :4] += 25.0  # nearly all target mass on 4 tokens
    target = torch.log_softmax(scores, -1)
    ids, lp = _topk(target, 64)
    diff = (acceptance_rates(draft, ids, lp) - _full_alpha(draft, target)).abs().max().item()
    assert diff <= 1e-5, diff


def test_alpha_is_one_minus_total_variation_with_the_whole_vocabulary():
    g = torch.Generator().manual_seed(2)
    draft = torch.randn(8, 2, 40, generator=g)
    target = torch.log_softmax(torch.randn(8, 2, 40, generator=g), -1)
    ids, lp = _topk(target, 40)
    tv = 0.5 * (target.exp() - draft.softmax(-1)).abs().sum(-1)
    assert torch.allclose(acceptance_rates(draft, ids, lp), 1 - tv, atol=1e-6)


def test_chain_losses_match_hand_computed_values():
    alpha = torch.tensor([[0.5, 0.4, 0.2]])
    # M = 0.5 + 0.5*0.4 + 0.5*0.4*0.2 = 0.74
    assert chain_loss(alpha, None, "tv").item() == pytest.approx(-0.74, abs=1e-6)
    assert chain_loss(alpha, None, "dca").item() == pytest.approx(-math.log(0.74), abs=1e-6)
    # VGM: accepted = 1 -> first rejection at j = 2 -> chain sums positions 1..2: 0.5 + 0.2
    assert chain_loss(alpha, torch.tensor([1]), "tv").item() == pytest.approx(-0.7, abs=1e-6)
    # accepted = 0 keeps the first position
    assert chain_loss(alpha, torch.tensor([0]), "dca").item() == pytest.approx(-math.log(0.5), abs=1e-6)
    # all accepted: L = min(K + 1, K) = K
    assert chain_loss(alpha, torch.tensor([3]), "tv").item() == pytest.approx(-0.74, abs=1e-6)
    # mean over cycles
    two = torch.tensor([[0.5, 0.4, 0.2], [1.0, 1.0, 1.0]])
    assert chain_loss(two, None, "tv").item() == pytest.approx(-(0.74 + 3.0) / 2, abs=1e-6)
    with pytest.raises(ValueError, match="objective"):
        chain_loss(alpha, None, "ce")


@pytest.mark.parametrize("accepted", [0, 1, 2, 3, 4])
def test_vgm_removes_exactly_the_positions_after_the_first_rejection(accepted):
    k = 4
    alpha = torch.tensor([[0.9, 0.7, 0.5, 0.3]], requires_grad=True)
    chain_loss(alpha, torch.tensor([accepted]), "dca").backward()
    kept = min(accepted + 1, k)
    assert (alpha.grad[0, :kept] != 0).all()
    assert (alpha.grad[0, kept:] == 0).all()


def test_without_vgm_every_position_gets_gradient():
    alpha = torch.tensor([[0.9, 0.7, 0.5, 0.3]], requires_grad=True)
    chain_loss(alpha, None, "dca").backward()
    assert (alpha.grad != 0).all()


def test_dca_gradient_is_tv_gradient_divided_by_chain_value_on_a_single_cycle():
    head = make_head("qwen3")
    rec = make_records(k=4)[0]
    rec.start, rec.drafts, rec.accepted = rec.start[:1], rec.drafts[:1], rec.accepted[:1]
    rec.topk_ids, rec.topk_logprobs = rec.topk_ids[:1], rec.topk_logprobs[:1]
    validate_record(rec)
    grads = {}
    for objective in ("dca", "tv"):
        for p in head.parameters():
            p.grad = None
        stats = head_loss_backward(head, [rec], cfg=HeadLossConfig(objective=objective))
        grads[objective] = (stats.loss, torch.cat([p.grad.flatten() for p in head.parameters()]))
    chain_value = math.exp(-grads["dca"][0])  # M, from the DCA loss -log M
    assert chain_value == pytest.approx(-grads["tv"][0], rel=1e-5)  # and TV = -M
    g_dca, g_tv = grads["dca"][1], grads["tv"][1]
    assert g_tv.abs().max() > 0
    assert torch.allclose(g_dca, g_tv / chain_value, rtol=1e-4, atol=1e-7)


def test_dca_stays_finite_when_every_alpha_is_tiny():
    alpha = torch.full((3, 5), 1e-30, requires_grad=True)
    loss = chain_loss(alpha, None, "dca")
    loss.backward()
    assert math.isfinite(loss.item()) and loss.item() == pytest.approx(-math.log(1e-30), rel=1e-3)
    assert torch.isfinite(alpha.grad).all()
    # far below fp32's range, through log alpha and the logits themselves
    draft = torch.zeros(2, 3, 50)
    draft[..., 0] = 200.0  # the head puts all its mass on a token the target never chooses
    draft.requires_grad_(True)
    target = torch.full((2, 3, 50), -1000.0)
    target[..., 1:] = 0.0
    target = torch.log_softmax(target, -1)
    ids, lp = _topk(target, 49)
    log_alpha = log_acceptance_rates(draft, ids, lp)
    assert log_alpha.max() < -150  # alpha underflows fp32; its log does not
    loss = chain_loss(log_alpha, torch.tensor([0, 4]), "dca", alpha_is_log=True)
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(draft.grad).all() and draft.grad.abs().max() > 0


def test_kl_is_zero_when_q_equals_p_and_ce_is_entropy_plus_kl():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 3, 30, generator=g)
    target = torch.log_softmax(logits, -1)
    ids, lp = _topk(target, 30)
    assert position_loss(logits, ids, lp, None, "kl").abs().item() <= 1e-6
    other = torch.randn(4, 3, 30, generator=g)
    kl = position_loss(other, ids, lp, None, "kl")
    ce = position_loss(other, ids, lp, None, "ce")
    entropy = -(target.exp() * target).sum(-1).mean()
    assert ce.item() == pytest.approx(entropy.item() + kl.item(), abs=1e-5)
    full_kl = (target.exp() * (target - torch.log_softmax(other, -1))).sum(-1).mean()
    assert kl.item() == pytest.approx(full_kl.item(), abs=1e-5)


def test_ce_and_kl_at_a_truncated_top_k_bin_the_rest_of_p_and_q():
    """At k = 16 of V = 300 the residual bins carry p's and q's tails: the losses against a float64 sum over
    the k ids and one bin of what is outside them, each mass from the full-vocabulary distributions."""
    g = torch.Generator().manual_seed(5)
    n, depth, vocab, k = 3, 2, 300, 16
    target = torch.log_softmax(torch.randn(n, depth, vocab, generator=g) * 2, -1)
    draft = torch.randn(n, depth, vocab, generator=g)
    ids, lp = _topk(target, k)
    p_full, q_full = target.double().exp(), draft.double().softmax(-1)
    want = {"ce": torch.zeros(n, dtype=torch.float64), "kl": torch.zeros(n, dtype=torch.float64)}
    for i in range(n):
        for j in range(depth):
            p, q = p_full[i, j, ids[i, j]], q_full[i, j, ids[i, j]]
            p_rest, q_rest = 1 - p.sum(), 1 - q.sum()  # the tails, well above the 1e-6 floor here
            ce = -(p * q.log()).sum() - p_rest * q_rest.log()
            want["ce"][i] += ce / depth
            want["kl"][i] += (ce + (p * p.log()).sum() + p_rest * p_rest.log()) / depth
    assert (p_full.sum(-1) - torch.gather(p_full, -1, ids).sum(-1)).min() > 0.05  # the bins matter
    for objective, expected in want.items():
        # fp32 sums of 17 terms of size <= ~10: ~1e-6 of rounding
        got = position_loss_per_cycle(draft, ids, lp, None, objective)
        assert torch.allclose(got.double(), expected, atol=1e-5), (objective, got, expected)


def test_position_loss_vgm_averages_positions_up_to_the_first_rejection():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(1, 4, 20, generator=g, requires_grad=True)
    ids, lp = _topk(torch.log_softmax(torch.randn(1, 4, 20, generator=g), -1), 20)
    per_position = torch.stack([position_loss(logits[:, i:i + 1], ids[:, i:i + 1], lp[:, i:i + 1], None, "kl")
                                for i in range(4)])
    masked = position_loss(logits, ids, lp, torch.tensor([1]), "kl")
    assert masked.item() == pytest.approx(per_position[:2].mean().item(), abs=1e-6)
    masked.backward()
    assert (logits.grad[0, 2:] == 0).all() and (logits.grad[0, :2] != 0).any()


def test_log1mexp_has_finite_gradients_where_exp_rounds_to_one():
    from openrlhf_growmtp.core.objectives import _log1mexp

    # (-6e-8, 0) is where fp32 exp(x) == 1: the discarded branch of where() used to turn its gradient into NaN
    x = torch.tensor([-2.0, -0.7, -0.69, -1e-3, -1e-6, -6e-8, -1e-9, -1e-20, -1e-30, 0.0], requires_grad=True)
    y = _log1mexp(x)
    (grad,) = torch.autograd.grad(y.sum(), x)
    assert torch.isfinite(y).all() and torch.isfinite(grad).all()
    ref = torch.log(-torch.expm1(x.detach().double()[:5]))  # float64, where fp32 still resolves 1 - exp(x)
    assert y[:5].double().sub(ref).abs().max() < 1e-6 * ref.abs().max()


@pytest.mark.parametrize("objective", ["dca", "tv", "kl", "ce"])
def test_a_head_sure_of_the_recorded_ids_gets_finite_gradients(objective):
    """The head's mass outside the recorded ids is 1 - exp(lse of log q there); below fp32's resolution a naive
    log(1 - exp(x)) has an infinite derivative, and its gradient turns NaN."""
    from openrlhf_growmtp.core.objectives import head_loss_per_cycle_at

    outside = torch.tensor([1e-2, 1e-5, 1e-7, 3e-8, 1e-9, 1e-20, 1e-30, 0.0])  # q's mass outside the one id
    logq = torch.log1p(-outside).reshape(-1, 1, 1).repeat(1, 2, 1).requires_grad_()  # [N, K=2, k=1]
    p_top = torch.tensor([0.9, 0.5]).reshape(1, 2, 1).expand(len(outside), 2, 1)
    loss, alpha = head_loss_per_cycle_at(logq, p_top.log(), torch.ones(len(outside), dtype=torch.long),
                                         objective)
    (grad,) = torch.autograd.grad(loss.sum(), logq)
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
    # alpha = min(p, q) at the id + min of the residuals; the residual of q is floored at 1e-6
    expected = torch.minimum(p_top[..., 0], 1 - outside[:, None]) + torch.minimum(1 - p_top[..., 0],
                                                                                  outside[:, None].clamp(min=1e-6))
    assert alpha.sub(expected).abs().max() < 1e-6


def test_the_topk_alpha_is_a_lower_bound_and_the_residual_alpha_an_upper_bound_of_the_true_alpha():
    from openrlhf_growmtp.core.objectives import log_acceptance_rates_at

    g = torch.Generator().manual_seed(3)
    draft = torch.randn(64, 5, 300, generator=g) * 2
    target = torch.log_softmax(torch.randn(64, 5, 300, generator=g) * 2, -1)
    ids, lp = _topk(target, 16)
    logq = torch.log_softmax(draft, -1).gather(-1, ids)
    lower = log_acceptance_rates_at(logq, lp, residual=False).exp()
    upper = log_acceptance_rates_at(logq, lp, residual=True).exp()
    true = _full_alpha(draft, target)
    assert (lower <= true + 1e-6).all() and (true <= upper + 1e-6).all()
    assert (upper - lower).min() > 0  # a real truncation: the two differ everywhere
    assert torch.allclose(lower, torch.minimum(lp.exp(), logq.exp()).sum(-1), atol=1e-6)  # the top-k overlap


def test_the_hybrid_weight_follows_the_rule():
    from openrlhf_growmtp.core.objectives import hybrid_lambda

    assert hybrid_lambda(0.0) == 1.0 and hybrid_lambda(1.0) == pytest.approx(math.exp(-3), rel=1e-12)
    assert hybrid_lambda(0.5) == pytest.approx(math.exp(-1.5), rel=1e-12)
    for bad in (-0.1, 1.1):
        with pytest.raises(ValueError, match="acceptance rate"):
            hybrid_lambda(bad)


@pytest.mark.parametrize("weight, equals", [(1.0, "ce"), (0.0, "dca")])
@pytest.mark.parametrize("vgm", [True, False])
def test_the_hybrid_is_ce_at_lambda_one_and_dca_at_lambda_zero_in_value_and_gradient(weight, equals, vgm):
    from openrlhf_growmtp.core.objectives import head_loss_per_cycle_at

    g = torch.Generator().manual_seed(4)
    logq = torch.log_softmax(torch.randn(16, 4, 300, generator=g), -1)[..., :24].clone().requires_grad_()
    lp = torch.log_softmax(torch.randn(16, 4, 300, generator=g) * 2, -1).topk(24, -1).values
    accepted = torch.randint(0, 5, (16,), generator=g) if vgm else None

    def loss_and_grad(objective, **kwargs):
        loss, _ = head_loss_per_cycle_at(logq, lp, accepted, objective, **kwargs)
        return loss, torch.autograd.grad(loss.sum(), logq)[0]

    hybrid, hybrid_grad = loss_and_grad("hybrid", hybrid_lambda=weight)
    single, single_grad = loss_and_grad(equals)
    assert torch.equal(hybrid, single) and torch.equal(hybrid_grad, single_grad)
    mixed, mixed_grad = loss_and_grad("hybrid", hybrid_lambda=0.25)  # and in between, the weighted sum
    ce, ce_grad = loss_and_grad("ce")
    dca, dca_grad = loss_and_grad("dca")
    assert torch.allclose(mixed, 0.25 * ce + 0.75 * dca, atol=1e-6)
    assert torch.allclose(mixed_grad, 0.25 * ce_grad + 0.75 * dca_grad, atol=1e-6)


def test_the_hybrid_needs_its_weight_and_no_other_objective_takes_one():
    from openrlhf_growmtp.core.objectives import head_loss_per_cycle_at

    logq, lp = torch.full((2, 3, 4), -2.0), torch.full((2, 3, 4), -1.5)
    with pytest.raises(ValueError, match="hybrid_lambda"):
        head_loss_per_cycle_at(logq, lp, None, "hybrid")
    with pytest.raises(ValueError, match="hybrid_lambda"):
        head_loss_per_cycle_at(logq, lp, None, "dca", hybrid_lambda=0.5)
