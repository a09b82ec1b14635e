"""flash_attn.utils.distributed.all_gather in plain torch.distributed (CPU machines only)."""

import torch
import torch.distributed as dist


def all_gather(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Concatenate every rank's `tensor` along dim 0."""
    world = dist.get_world_size(group)
    out = tensor.new_empty(world * tensor.shape[0], *tensor.shape[1:])
    dist.all_gather_into_tensor(out, tensor.contiguous(), group=group)
    return out
