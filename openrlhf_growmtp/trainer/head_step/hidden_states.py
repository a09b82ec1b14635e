"""H_p, the backbone's final-norm hidden states the head reads (transport-free mode), and the two sources an
RL step's head updates take them from (`head_rl_step.py` chooses one per RL step):

- `OwnForward`: one forward of the rollout policy over the records' committed tokens, before the policy's
  first step; every rank makes the same backbone forwards (ZeRO-3 gathers parameters in each), ranks with
  fewer records run one-token padding forwards;
- `TrainingForward`: the policy's own training forward of a micro-batch, where that forward runs the
  rollout policy over exactly the records' tokens (`training_forward_mismatch` says where it does not).

Both answer the calls of `HiddenStateSource`, in its order.

No openrlhf or DeepSpeed import here.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, ContextManager, Protocol, Sequence, runtime_checkable

import torch
from torch import nn

from ...core.lockstep import Lockstep
from ...core.records import SequenceRecord
from ..keys import RECORD_INDEX_KEY

Update = Callable[[list[int], list[torch.Tensor]], None]  # HeadRLStep.update: records due, their H_p


@runtime_checkable
class HiddenStateSource(Protocol):
    """Where an RL step's head updates read H_p, called in this order within one RL step."""

    def start(self) -> None:
        """When the RL step starts (a forward of its own runs here, in lockstep with the other ranks)."""

    def micro_batch(self, due: list[int] | None, attention_mask: torch.Tensor, update: Update) -> ContextManager:
        """Around each policy micro-batch: `update` receives its due records with their H_p as soon as they are
        ready (before the forward, or between the forward and the backward)."""

    def before_policy_backward(self) -> None:
        """At the strategy's seam, between the micro-batch's forward and its backward."""

    def release(self) -> None:
        """Once no record is due any more."""

    def of_records(self, indices: Sequence[int]) -> list[torch.Tensor]:
        """H_p of these records after the RL step (the lag probe; only a forward of its own can answer)."""

    def metrics(self) -> dict[str, float]:
        """What the source logs (`growmtp/head_hidden_from_forward`)."""


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


class OwnForward:
    """H_p of every record from one forward of the rollout policy, read in `start` (with a graph in joint mode;
    otherwise kept off the accelerator until their micro-batch comes)."""

    def __init__(self, backbone: nn.Module, records: Sequence[SequenceRecord], batch_size: int, grad: bool,
                 lockstep: Lockstep, keep: bool = False):
        self.backbone, self.records, self.batch_size = backbone, records, batch_size
        self.grad, self.lockstep = grad, lockstep
        self.keep = keep  # held through the RL step (the lag probe reads them after it)
        self.hiddens: list[torch.Tensor] = []

    def start(self) -> None:
        """The forward, in lockstep with the other ranks, before the policy's first micro-batch."""
        with torch.random.fork_rng(devices=[]):  # upstream's RNG stream (its data order) untouched
            hiddens = step_hidden_states(self.backbone, self.records, self.batch_size, grad=self.grad,
                                         lockstep=self.lockstep)
        self.hiddens = hiddens if self.grad else [h.to("cpu") for h in hiddens]

    @contextlib.contextmanager
    def micro_batch(self, due: list[int] | None, attention_mask: torch.Tensor, update: Update):
        """Around one micro-batch of the policy: the due records update at once (their H_p are ready)."""
        if due is not None:
            update(due, self.of_records(due))
        yield

    def before_policy_backward(self) -> None:
        """Nothing left to do there: the micro-batch's update ran before its forward."""

    def of_records(self, indices: Sequence[int]) -> list[torch.Tensor]:
        return [self.hiddens[i] for i in indices]

    def release(self) -> None:
        """Used up: not held through the policy's other micro-batches."""
        if not self.keep:
            self.hiddens = []

    def metrics(self) -> dict[str, float]:
        return {"head_hidden_from_forward": 0.0}


class TrainingForward:
    """The backbone's final hidden states of the policy's own training forward of one micro-batch
    (detached), kept by a forward hook while a micro-batch with due records runs; the update runs between
    that forward and the micro-batch's backward."""

    def __init__(self, backbone: nn.Module):
        self.backbone, self.captured = backbone, []
        self._pending: tuple[list[int], torch.Tensor, Update] | None = None

    def start(self) -> None:
        """Nothing to read ahead: each micro-batch's own forward brings its H_p."""

    @contextlib.contextmanager
    def micro_batch(self, due: list[int] | None, attention_mask: torch.Tensor, update: Update):
        if due is None:
            yield
            return
        self._pending = (due, attention_mask, update)
        self.captured.clear()
        hook = self.backbone.register_forward_hook(
            lambda module, args, output: self.captured.append(output.last_hidden_state.detach()))
        try:
            yield
        finally:
            hook.remove()
            self._pending = None

    def before_policy_backward(self) -> None:
        """The micro-batch's update, from the H_p of its one policy forward."""
        if self._pending is None:
            return
        due, attention_mask, update = self._pending
        self._pending = None
        if len(self.captured) != 1:
            raise RuntimeError(f"GrowMTP: expected one policy forward before the backward, saw {len(self.captured)}")
        update(due, rows_per_sample(self.captured.pop(), attention_mask))

    def of_records(self, indices: Sequence[int]) -> list[torch.Tensor]:
        raise RuntimeError("GrowMTP: the policy's training forward keeps no hidden states past its micro-batch "
                           "(the lag probe reads them from a forward of its own)")

    def release(self) -> None:
        self.captured.clear()

    def metrics(self) -> dict[str, float]:
        return {"head_hidden_from_forward": 1.0}


def training_forward_mismatch(items, records: Sequence[SequenceRecord]) -> str | None:
    """Why the policy's training forward of these samples (upstream's Experience objects) is not over exactly
    their records' tokens (None: it is)."""
    for item in items:
        index = item.info.get(RECORD_INDEX_KEY)
        if index is None:
            return "a sample whose tokens are not its record's: no record"
        tokens = item.sequences.reshape(-1)[item.attention_mask.reshape(-1).bool()].cpu()
        recorded = records[int(index)].token_ids.cpu()
        if tokens.shape != recorded.shape:
            return (f"a sample whose tokens are not its record's: {tokens.shape[0]} valid tokens, "
                    f"{recorded.shape[0]} recorded")
        if not torch.equal(tokens, recorded):
            return ("a sample whose tokens are not its record's: first difference at position "
                    f"{int((tokens != recorded).nonzero()[0])}")
    return None
