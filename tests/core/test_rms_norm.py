"""The head's RMSNorm against transformers' own, for every family's convention: the same outputs bit for bit,
the same gradients (exactly where the operations are the same, to rounding where the backward reorders
fp32 arithmetic), and fewer tensors kept for backward."""

import pytest
import torch

from openrlhf_growmtp.core.families import FAMILIES
from openrlhf_growmtp.core.rms_norm import HeadRMSNorm
from helpers.tiny import FAMILY_NAMES, make_head

# (width, shape of the input): a hidden state, and per-head (q_norm / k_norm over head_dim)
SHAPES = [(48, (2, 7, 48)), (16, (2, 7, 3, 16))]


def _pair(family: str, width: int, dtype: torch.dtype, seed: int = 0):
    """transformers' norm of `family` with a random weight around its unit, and ours sharing that weight."""
    fam = FAMILIES[family]
    theirs = fam.norm_class(width, eps=1e-6)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        theirs.weight.copy_(fam.norm_unit_weight + 0.3 * torch.randn(width, generator=g))
    theirs.to(dtype)
    return theirs, HeadRMSNorm.like(theirs, fam.norm_unit_weight)


def _grads(norm, x, grad_out):
    x = x.clone().requires_grad_(True)
    norm.weight.grad = None
    out = norm(x)
    out.backward(grad_out)
    return out.detach(), x.grad, norm.weight.grad.clone()


@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("width,shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # (fp64 input: transformers computes in fp32)
def test_same_outputs_and_gradients_as_transformers(family, width, shape, dtype):
    theirs, ours = _pair(family, width, dtype)
    g = torch.Generator().manual_seed(1)
    x = (3.0 * torch.randn(shape, generator=g)).to(dtype)
    grad_out = torch.randn(shape, generator=g).to(dtype)
    out_ref, gx_ref, gw_ref = _grads(theirs, x, grad_out)
    out, gx, gw = _grads(ours, x, grad_out)
    assert out.dtype == out_ref.dtype and gx.dtype == gx_ref.dtype and gw.dtype == gw_ref.dtype
    assert torch.equal(out, out_ref)  # the forward is transformers' sequence of operations
    # The weight's gradient is the same operations on the same values as autograd's.
    assert torch.equal(gw, gw_ref)
    # The input's gradient reorders the fp32 (fp64) arithmetic: each element agrees to a few units of the
    # fp32 at the tensor's scale (fp32's spacing is 1.2e-7 relative; 1e-5 leaves ~100 of them for the sums over
    # 48 elements); rounded to bf16, an element can land one bf16 spacing apart, at most 2^-7 of the largest.
    bound = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -7}[dtype]
    scale = gx_ref.abs().max()
    assert (gx - gx_ref).abs().max() <= bound * scale, (gx - gx_ref).abs().max() / scale
    if dtype == torch.bfloat16:  # nearly all elements are the same bf16 number
        assert (gx != gx_ref).float().mean() < 0.05


def test_gradients_are_the_derivative():
    """Against the formula differentiated by autograd in fp64 (not transformers' code): both conventions."""
    g = torch.Generator().manual_seed(2)
    for family in ("qwen3", "qwen3_5"):
        _, ours = _pair(family, 32, torch.float32)
        x, grad_out = torch.randn(5, 32, generator=g), torch.randn(5, 32, generator=g)
        _, gx, gw = _grads(ours, x, grad_out)
        x64, w64 = x.double().requires_grad_(True), ours.weight.detach().double().requires_grad_(True)
        scale = w64 + 1.0 if ours.offset else w64
        (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + ours.eps) * scale).backward(grad_out.double())
        # fp32 arithmetic on O(1) values over 32-element sums: a few 1e-7, far below 1e-5
        assert torch.allclose(gx.double(), x64.grad, rtol=1e-5, atol=1e-5)
        assert torch.allclose(gw.double(), w64.grad, rtol=1e-5, atol=1e-5)


def _kept_bytes(module, x) -> int:
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x.requires_grad_(True)).sum().backward()
    return sum(kept.values())


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_keeps_only_its_input_and_the_reciprocal_rms(family):
    theirs, ours = _pair(family, 256, torch.bfloat16)
    x = torch.randn(8, 256).to(torch.bfloat16)
    input_bytes, weight_bytes, r_bytes = x.nbytes, ours.weight.nbytes, 8 * 4
    assert _kept_bytes(ours, x.clone()) == input_bytes + weight_bytes + r_bytes
    assert _kept_bytes(theirs, x.clone()) > 2 * input_bytes  # an fp32 copy of the input at least


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_every_norm_of_the_head_is_ours_under_transformers_names(family):
    head = make_head(family)
    fam = FAMILIES[family]
    assert not any(isinstance(m, fam.norm_class) for m in head.modules())
    norms = {name for name, m in head.named_modules() if isinstance(m, HeadRMSNorm)}
    # the layer's own (input, post-attention, and q and k norms where the family has them) and the head's three:
    # the embedding's, the hidden state's and the final one
    expected = sum(isinstance(m, fam.norm_class) for m in fam.layer_class(head.config, 0).modules()) + 3
    assert len(norms) == expected >= 5, norms
    assert all(f"{name}.weight" in head.state_dict() for name in norms)
    # the layer's forward reaches the same modules as the head registers (MiMo registers the layer's children)
    assert head.decoder_layer.input_layernorm is dict(head.named_modules())[
        next(n for n in norms if n.endswith("input_layernorm"))]
    if family != "mimo":  # Qwen2's attention has no q/k norms
        assert isinstance(head.decoder_layer.self_attn.q_norm, HeadRMSNorm)
