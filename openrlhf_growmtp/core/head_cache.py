"""The head's KV cache and the additive masks its attention reads while drafting and prefilling."""

from __future__ import annotations

import torch


class HeadKVCache:
    """Keys and values of the head's one attention layer, [B, kv_heads, L, head_dim].

    Duck-types the `update` of transformers' Cache, which is all the decoder layers call.
    """

    def __init__(self, key: torch.Tensor | None = None, value: torch.Tensor | None = None):
        self.key = key
        self.value = value

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int = 0, cache_kwargs=None):
        if self.key is None:
            self.key, self.value = key, value
        else:
            self.key = torch.cat([self.key, key], dim=2)
            self.value = torch.cat([self.value, value], dim=2)
        return self.key, self.value

    def __len__(self) -> int:
        return 0 if self.key is None else self.key.shape[2]

    def crop(self, length: int) -> None:
        """Keep the first `length` entries (drop a finished cycle's chain entries)."""
        if self.key is not None:
            self.key = self.key[:, :, :length]
            self.value = self.value[:, :, :length]


def prefix_extension_mask(num_cached: int, num_new: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive [1, 1, num_new, num_cached + num_new]: all cached entries visible, causal among new ones."""
    visible = torch.ones(num_new, num_cached + num_new, dtype=torch.bool, device=device)
    visible[:, num_cached:] = torch.tril(visible[:, num_cached:])
    return additive_mask(visible, dtype)[None, None]


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool visibility -> additive float mask (0 where visible, the dtype's min elsewhere)."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(
        ~visible, torch.finfo(dtype).min)
