"""H_p, the backbone's final-norm hidden states the head reads (transport-free mode): from a forward of the
policy over the records' committed tokens, or from the policy's own training forward of a micro-batch.

Every rank makes the same backbone forwards (ZeRO-3 gathers parameters in each): ranks with fewer
records run one-token padding forwards. No openrlhf or DeepSpeed import here.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from ..core.lockstep import Lockstep
from ..core.records import SequenceRecord


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def backbone_hidden_states(backbone: nn.Module, records: Sequence[SequenceRecord], num_batches: int,
                           batch_size: int, grad: bool) -> list[torch.Tensor]:
    """H_p [T, H] per record from the backbone (final-norm output), in exactly `num_batches` forwards.

    Sequences are right-padded, which leaves every real position's causal hidden state unchanged. Forwards
    past this rank's records are one-token padding.
    """
    device = _device()
    hiddens: list[torch.Tensor] = []
    with torch.set_grad_enabled(grad):
        for b in range(num_batches):
            batch = records[b * batch_size:(b + 1) * batch_size]
            if not batch:
                backbone(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device))
                continue
            lengths = [int(rec.token_ids.shape[0]) for rec in batch]
            ids = torch.zeros(len(batch), max(lengths), dtype=torch.long, device=device)
            mask = torch.zeros_like(ids)
            for i, rec in enumerate(batch):
                ids[i, :lengths[i]] = rec.token_ids.to(device)
                mask[i, :lengths[i]] = 1
            out = backbone(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, Tmax, H]
            hiddens.extend(out[i, :lengths[i]] for i in range(len(batch)))
    return hiddens


def step_hidden_states(backbone: nn.Module, records: Sequence[SequenceRecord], batch_size: int, grad: bool,
                       lockstep: Lockstep) -> list[torch.Tensor]:
    """H_p [T, H] per record of this rank from the current backbone, in as many forwards as the busiest rank
    makes (with a graph if `grad`: joint mode). Read them before the policy's optimizer step."""
    (batches,) = lockstep.most([math.ceil(len(records) / batch_size)])
    return backbone_hidden_states(backbone, records, batches, batch_size, grad)


def rows_per_sample(last_hidden: torch.Tensor, attention_mask: torch.Tensor) -> list[torch.Tensor]:
    """Each sample's hidden states [T_i, H] (its valid tokens, in order) from a training forward's final
    hidden states: padded [B, T, H] over attention_mask [B, T], or packed [1, sum T_i, H] (the valid tokens
    of every row, in row order, as OpenRLHF's Actor unpads them)."""
    mask = attention_mask.bool()
    if last_hidden.shape[:2] == mask.shape:
        flat = last_hidden[mask]
    else:
        flat = last_hidden.reshape(-1, last_hidden.shape[-1])
        if flat.shape[0] != int(mask.sum()):
            raise ValueError(f"hidden states of {flat.shape[0]} packed tokens for {int(mask.sum())} valid tokens")
    return list(flat.split(mask.sum(-1).tolist()))


class TrainingForwardHiddens:
    """The backbone's final hidden states of the policy's own training forward of one micro-batch
    (detached), kept by a forward hook while `watch` is active."""

    def __init__(self, backbone: nn.Module):
        self.backbone, self.captured, self._hook = backbone, [], None

    def watch(self) -> None:
        self.captured.clear()
        self._hook = self.backbone.register_forward_hook(
            lambda module, args, output: self.captured.append(output.last_hidden_state.detach()))

    def stop(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def per_sample(self, attention_mask: torch.Tensor) -> list[torch.Tensor]:
        """The micro-batch's H_p per sample, once its one policy forward has run."""
        self.stop()
        if len(self.captured) != 1:
            raise RuntimeError(f"GrowMTP: expected one policy forward before the backward, saw {len(self.captured)}")
        return rows_per_sample(self.captured.pop(), attention_mask)
