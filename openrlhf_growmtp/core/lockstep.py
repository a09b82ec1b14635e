"""The data-parallel ranks of one head update, kept in lockstep.

Under ZeRO-3 every call of a partitioned module gathers its parameters and every backward reduces its
gradients: both are collectives, so every rank must make the same module calls and the same backwards,
whatever its share of the records. A `Lockstep` is the one place where ranks meet: the work shape they
agree to pad to (`most`), a decision they take together (`every`), the sums they report (`total`), the
backward they share (the trainer's DeepSpeed backward), and the gather that makes partitioned parameters
whole (`gathered`: DeepSpeed's under ZeRO-3). `ONE_RANK` is a process alone: its own counts, its own
decisions, `loss.backward()`, its parameters whole.

The core never asks a rank's records what to do about another rank: it computes its own work shape
(`chunks.ChunkWork`), pads it here once, and runs exactly that work, with zero-weighted padding where
it has less.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ContextManager, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .draft_vocab import no_gather


def _plain_backward(loss: torch.Tensor) -> None:
    loss.backward()


@dataclass(frozen=True)
class Lockstep:
    """The ranks of torch.distributed's default group when `distributed` (and it is initialised), or this
    process alone; `backward` runs every backward of the head update (default: `loss.backward()`);
    `gathered(params)` is a context inside which those parameters are whole (default: they are)."""

    distributed: bool = False
    backward: Callable[[torch.Tensor], None] = _plain_backward
    gathered: Callable[[Sequence[nn.Parameter]], ContextManager] = no_gather

    @property
    def size(self) -> int:
        return dist.get_world_size() if self._active() else 1

    def most(self, counts: Sequence[int]) -> list[int]:
        """The largest of every rank's counts, position by position (every rank passes as many)."""
        return [int(v) for v in self._reduce([float(c) for c in counts], dist.ReduceOp.MAX)]

    def every(self, flag: bool) -> bool:
        """True only where `flag` is true on every rank."""
        return self._reduce([1.0 if flag else 0.0], dist.ReduceOp.MIN)[0] > 0.5

    def total(self, values: Sequence[float]) -> list[float]:
        """Every rank's values summed, position by position."""
        return self._reduce([float(v) for v in values], dist.ReduceOp.SUM)

    def _active(self) -> bool:
        return self.distributed and dist.is_available() and dist.is_initialized()

    def _reduce(self, values: list[float], op) -> list[float]:
        if not self._active() or not values:
            return values
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        tensor = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(tensor, op=op)
        return tensor.tolist()


ONE_RANK = Lockstep()
