"""Elementwise recompute in backward: the same gradients, less kept for backward, modules restored."""

import pytest
import torch

from openrlhf_growmtp.core.recompute import elementwise_recomputed
from helpers.tiny import FAMILY_NAMES, make_head


def _step(head, hidden, ids, positions):
    """(gradients, bytes autograd kept for backward) of one head application's summed output."""
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    params = {p.untyped_storage().data_ptr() for p in head.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = head(hidden, ids, positions)
    (out.normed.float() ** 2).sum().backward()
    grads = {name: p.grad.clone() for name, p in head.named_parameters()}
    head.zero_grad(set_to_none=True)
    return grads, sum(n for ptr, n in kept.items() if ptr not in params)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_same_gradients_with_less_kept_for_backward(family):
    head = make_head(family).to(torch.bfloat16)  # bf16 as the trainer runs it: RMSNorms keep fp32 copies
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 24, head.config.hidden_size, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, head.config.vocab_size, (1, 24), generator=g)
    positions = torch.arange(24)[None]
    plain, plain_bytes = _step(head, hidden, ids, positions)
    with elementwise_recomputed(head):
        lean, lean_bytes = _step(head, hidden, ids, positions)
    assert lean_bytes < 0.8 * plain_bytes, (lean_bytes, plain_bytes)
    for name in plain:  # the recompute repeats the same ops on the same inputs
        assert torch.equal(lean[name], plain[name]), name
    assert not any("forward" in m.__dict__ for m in head.modules())  # every module's own forward again
