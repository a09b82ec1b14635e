"""The head's RMSNorm: transformers' forward, operator for operator, with a backward of its own.

Why. A head update applies seven RMSNorms per recurrent position, forward and backward, and at a chunk of
1,024 cycles each operator is a kernel launch that the GPU waits for (`benchmarks/bench_launches.py`).
Through autograd one norm costs eight operators forward and about twenty backward, and the recompute that
keeps only its input (`recompute.py`) ran the eight again. Here the forward is transformers' own sequence
(its outputs are bit-identical, in every dtype), it keeps only its input and the fp32 reciprocal RMS
([..., 1]), and the backward is written out: about twelve operators, nothing recomputed but the
normalised input.

The two conventions of the families (`families.HeadFamily.norm_unit_weight`):
- scale 1 at w = 1 (Qwen3, MiMo/Qwen2):   y = w * cast(x32 * r)
- scale 1 at w = 0 (Qwen3.5):              y = cast(x32 * r * (1 + w32))
with x32 = x in fp32, r = rsqrt(mean(x32²) + eps), cast to x's dtype.

Gradients, with n = x32 * r, g the output's gradient and H the normalised width:
    scale s = w (first) or 1 + w32 (second);   dL/dn = g * s
    dL/dx = r * (dL/dn - n * sum(dL/dn * n) / H)
    dL/dw = sum over rows of g * cast(n) (first) or of g32 * n (second)
The casts' own gradients are the identity (rounded to the dtype), as autograd's.
"""

from __future__ import annotations

import torch
from torch import nn

from .families import HeadFamily


def norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, r): the norm's output in x's dtype and the fp32 reciprocal RMS [..., 1] (module docstring).
    A plain function, so that a caller may compile it (`torch.compile`) where it wants fewer kernels."""
    x32 = x.to(torch.float32)
    r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    normed = x32 * r
    out = (normed * (1.0 + weight.float())).type_as(x) if offset else weight * normed.to(x.dtype)
    return out, r


def norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, r: torch.Tensor, offset: bool,
                  need_x: bool, need_weight: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dL/dx, dL/dw) from the output's gradient (module docstring); None where not needed. A plain function,
    as `norm_forward`."""
    normed = x.to(torch.float32) * r
    rows = tuple(range(grad.ndim - 1))
    if offset:
        grad32 = grad.to(torch.float32)
        grad_weight = (grad32 * normed).sum(rows).to(weight.dtype) if need_weight else None
        grad_normed = grad32 * (1.0 + weight.float())
    else:
        grad_weight = (grad * normed.to(x.dtype)).sum(rows) if need_weight else None
        grad_normed = (grad * weight).to(torch.float32)
    grad_x = None
    if need_x:
        projection = (grad_normed * normed).sum(-1, keepdim=True)
        grad_x = (torch.addcmul(grad_normed, normed, projection, value=-1.0 / x.shape[-1]) * r).to(x.dtype)
    return grad_x, grad_weight


class _RMSNorm(torch.autograd.Function):
    # the module's functions are looked up at each call: a caller that rebinds them (compiled) is used
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
        out, r = norm_forward(x, weight, eps, offset)
        ctx.save_for_backward(x, weight, r)
        ctx.offset = offset
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, r = ctx.saved_tensors
        grad_x, grad_weight = norm_backward(grad, x, weight, r, ctx.offset, *ctx.needs_input_grad[:2])
        return grad_x, grad_weight, None, None


class HeadRMSNorm(nn.Module):
    """RMSNorm over the last dimension, with the family's convention (`unit_weight`: the weight meaning
    scale 1) and transformers' parameter name, so that state dicts and checkpoints are unchanged."""

    def __init__(self, weight: nn.Parameter, eps: float, unit_weight: float):
        super().__init__()
        if unit_weight not in (0.0, 1.0):
            raise ValueError(f"an RMSNorm's unit weight is 1 (w * x) or 0 ((1 + w) * x), got {unit_weight}")
        self.weight = weight
        self.eps = float(eps)
        self.offset = unit_weight == 0.0

    @classmethod
    def like(cls, norm: nn.Module, unit_weight: float) -> "HeadRMSNorm":
        """The same norm (its very weight Parameter and eps) as transformers' `norm`."""
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        if eps is None:
            raise TypeError(f"{type(norm).__name__} has no eps (variance_epsilon or eps)")
        return cls(norm.weight, eps, unit_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNorm.apply(x, self.weight, self.eps, self.offset)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, offset={self.offset}"


def family_norm(family: HeadFamily, width: int, eps: float) -> HeadRMSNorm:
    """A new norm of `family`'s (its transformers class's initial weight and eps), as a `HeadRMSNorm`."""
    return HeadRMSNorm.like(family.norm_class(width, eps=eps), family.norm_unit_weight)


def replace_norms(module: nn.Module, family: HeadFamily) -> None:
    """Put a `HeadRMSNorm` in place of every norm of `family`'s class below `module`, in place."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, family.norm_class):
                setattr(parent, name, HeadRMSNorm.like(child, family.norm_unit_weight))
