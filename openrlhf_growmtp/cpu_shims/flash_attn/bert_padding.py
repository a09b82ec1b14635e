"""Padding helpers with flash-attn 2.8's signatures, in plain torch."""

import torch
import torch.nn.functional as F
from einops import rearrange  # re-exported: OpenRLHF imports it from here

__all__ = ["index_first_axis", "pad_input", "rearrange", "unpad_input"]


def index_first_axis(tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """tensor [N, ...] -> tensor[indices] [len(indices), ...]."""
    return tensor[indices]


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask: torch.Tensor | None = None):
    """hidden_states [B, S, ...], attention_mask [B, S] -> (tokens [nnz, ...], indices [nnz], cu_seqlens [B+1],
    max_seqlen, seqused [B]); `unused_mask` marks tokens that are kept but not attended (flash-attn's meaning)."""
    keep = attention_mask + unused_mask if unused_mask is not None else attention_mask
    seqlens = keep.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(keep.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu_seqlens, int(seqlens.max().item()) if seqlens.numel() else 0, used


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """tokens [nnz, ...] scattered back to [batch, seqlen, ...] (zeros elsewhere)."""
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out[indices] = hidden_states
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
