"""What one chunk of the head update is: the head's states at its slots, the recorded targets they are
scored against, and the module calls it makes (what data-parallel ranks pad to the same)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftStates:
    """The head's states at the (cycle, draft position) slots that were built, one row per slot."""

    normed: torch.Tensor  # [M, H] norm(o), what the lm_head reads
    cycle: torch.Tensor  # [M] the slot's cycle (index into the chunk's cycles)
    position: torch.Tensor  # [M] its draft position, 0-based
    temperature: torch.Tensor  # [N] per cycle


@dataclass
class Chunk:
    """One chunk's slots and targets. A padding chunk (weight 0) pads a rank to the busiest rank's work."""

    states: DraftStates
    topk_ids: torch.Tensor  # [N, K, k] the target's recorded top-k ids at each draft position
    topk_logprobs: torch.Tensor  # [N, K, k] their log p
    accepted: torch.Tensor  # [N] a_r: the cycle reached positions 1..min(a_r + 1, K) and passed 1..a_r
    weight: float  # of each cycle's loss in the backward; 0 for padding
    vgm: bool = True  # the chain stops at min(a_r + 1, K); False: every cycle's chain runs over all K

    @property
    def num_cycles(self) -> int:
        return int(self.topk_ids.shape[0])


@dataclass(frozen=True)
class ChunkWork:
    """The head calls one chunk makes besides its K chain forwards (which every chunk makes): prefix pieces
    opened and closed, and lm_head groups scored. Each is padded to the busiest rank's count."""

    prefix_open: int = 0
    prefix_close: int = 0
    score_groups: int = 1

    def as_list(self) -> list[int]:
        return [self.prefix_open, self.prefix_close, self.score_groups]


def slots_per_chunk(lengths: torch.Tensor, depth: int) -> int:
    """Slots a draft-path chunk builds: every position up to each cycle's chain length, and one
    padding slot at a position no chain reaches (`reconstruction.reconstruct_states`)."""
    reach = [int((lengths >= position).sum()) for position in range(1, depth + 1)]
    return sum(max(1, count) for count in reach)
