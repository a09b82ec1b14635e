"""Gated DeltaNet (Qwen3.5's linear attention) in plain torch: the short causal convolution and the gated
delta rule, one sequence at a time, in any dtype (computed in fp32).

Terms (per value head h, with key/query heads repeated to the value heads):
- *gates*: decay g_t = -exp(A_log) * softplus(a_t + dt_bias) (log space) and write strength
  beta_t = sigmoid(b_t);
- *state* S [Dk, Dv]: the recurrent memory. Per token: S <- exp(g_t) S; then the delta rule writes the
  value the memory misses for key k_t, S <- S + k_t (beta_t (v_t - k_t^T S))^T; the output is q_t^T S,
  with q_t and k_t L2-normalised and q_t scaled by Dk^-1/2;
- *conv window*: the width-1 inputs before a token, which the depthwise causal conv1d (kernel `width`,
  SiLU) reads with it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

L2_EPS = 1e-6  # added to the squared norm before the inverse square root (the FLA kernels' convention)


def causal_conv(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                activation: str | None) -> torch.Tensor:
    """Depthwise causal conv1d over a segment that continues after `window`.

    x [dim, T] the segment's inputs; window [dim, width-1] the inputs before it (zeros at a sequence start);
    weight [dim, width]. Returns [dim, T] in fp32.
    """
    assert x.ndim == 2 and window.shape == (x.shape[0], weight.shape[1] - 1), (x.shape, window.shape)
    padded = torch.cat([window, x], dim=-1).float()[None]  # [1, dim, width-1+T]
    bias = None if bias is None else bias.float()
    out = F.conv1d(padded, weight.float()[:, None, :], bias, groups=weight.shape[0])[0]
    if activation in ("silu", "swish"):
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"unsupported GDN conv activation {activation!r}")
    return out


def gdn_gates(A_log: torch.Tensor, dt_bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor):  # noqa: N803
    """(g [T, Hv] log-decay, beta [T, Hv]) in fp32 from the layer's a, b [T, Hv]."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.float().sigmoid()


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, keep_states: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the recurrence over one sequence's tokens from `state`.

    q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]; state [Hv, Dk, Dv]. Hv must be a multiple of Hk
    (each key head serves Hv / Hk consecutive value heads). Returns (out [T, Hv, Dv] fp32, states):
    states [T, Hv, Dk, Dv] (the state after each token) if keep_states, else the final state [Hv, Dk, Dv].
    """
    assert q.ndim == k.ndim == v.ndim == 3 and g.shape == beta.shape == v.shape[:2], (q.shape, v.shape, g.shape)
    repeat = v.shape[1] // k.shape[1]
    q, k = (x.float().repeat_interleave(repeat, dim=1) for x in (q, k))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + L2_EPS) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2_EPS)
    v, decay = v.float(), g.exp()
    s = state.float()
    out = v.new_empty(v.shape)
    states = []
    for t in range(v.shape[0]):
        s = s * decay[t, :, None, None]
        missing = v[t] - torch.einsum("hk,hkv->hv", k[t], s)  # what the memory recalls for k_t falls short by
        s = s + k[t, :, :, None] * (beta[t, :, None] * missing)[:, None, :]
        out[t] = torch.einsum("hk,hkv->hv", q[t], s)
        if keep_states:
            states.append(s)
    return out, (torch.stack(states) if keep_states else s)
