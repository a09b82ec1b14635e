"""log q at the recorded top-k: the sparse, in-place path equals the full-vocabulary one."""

import torch

from helpers.tiny import HIDDEN, VOCAB, make_head
from openrlhf_growmtp.core.topk_logq import TopKLogQ


def test_topk_logq_gives_the_full_vocabulary_loss_and_gradient():
    head = make_head("qwen3")
    g = torch.Generator().manual_seed(3)
    normed = torch.randn(23, HIDDEN, generator=g, requires_grad=True)
    ids = torch.randint(0, VOCAB, (23, 8), generator=g)
    temperature = torch.rand(23, generator=g) + 0.5
    weights = torch.randn(23, 8, generator=g)

    def loss_of(logq):  # nonlinear in log q, so the gradient's dependence on it is exercised
        return (weights * logq).sum() + logq.exp().sum(-1).log().sum()

    dense = loss_of((head.logits(normed).float() / temperature[:, None]).log_softmax(-1).gather(-1, ids))
    dense.backward()
    scores = TopKLogQ(head, normed, ids, temperature)
    loss = loss_of(scores.logq)
    (grad_logq,) = torch.autograd.grad(loss, scores.logq)
    grad = scores.input_grad(grad_logq)
    # fp32, the same matmul and one logsumexp per row either way: only summation order may differ (~1e-7)
    assert abs(loss.item() - dense.item()) <= 1e-5 * max(1.0, abs(dense.item()))
    assert (grad - normed.grad).abs().max().item() <= 1e-5 * max(1.0, normed.grad.abs().max().item())
    assert normed.grad.abs().max() > 0
