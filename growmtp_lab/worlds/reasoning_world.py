"""The ablations' third world, with the statistics of reasoning models' RL rollouts (`python -m
growmtp_lab.ablations --worlds reasoning`): built once and cached like the demo's, nothing downloaded.

The demo world's task and code (`demo_world.py`, `task.py`) under another spec:
- The task: worked additions of 3 to 6 digits, and before each column's step one connective word drawn
  uniformly from 32 (`task.CONNECTIVES`, the same 32 for every problem). Most tokens are near-deterministic;
  the connectives are the forks.

      prompt:   3 4 7 + 5 8 9 =
      solution: so 7 + 9 = 1 6 , hence 4 + 8 + 1 = 1 3 , well 3 + 5 + 1 = 9 , A 9 3 6 <eos>

- A word-level vocabulary of 4,096 ids: the demo's symbols, the 32 connectives, and never-used words.
- The policy: a Qwen3 of 8 layers (hidden 256, heads of 32), pretrained on worked solutions until its expected
  sampled accuracy (the demo world's estimate, counting a solution with any connectives as worked) reaches a
  half; its random head (seed 0).
- The prompts are the demo's (the problem and `=`) with their answers as labels; the reward is the demo's
  (`reasoning_reward.py`): the answer after the last `A`.
Its cache directory is reasoning-<key>/.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

from growmtp_lab.worlds import task
from growmtp_lab.worlds.demo_world import World, WorldSpec, build_world

WORLD_VERSION = 1  # bump when anything here, in demo_world.py's build or in task.py changes what a cached world holds


@dataclass(frozen=True)
class ReasoningWorldSpec(WorldSpec):
    """The demo world's spec at the paper world's sizes (8 layers, hidden 256, a 4,096-id vocabulary; the paper
    world's pretraining LR, warm-up and step cap), with problems of 3 to 6 digits and connectives."""

    name: ClassVar[str] = "reasoning"
    prefix: ClassVar[str] = "reasoning"
    min_digits: int = 3
    max_digits: int = 6
    hidden_size: int = 256
    num_layers: int = 8
    lr: float = 1e-3
    warmup_steps: int = 50
    max_steps: int = 3000
    vocab_size: int = 4096
    connectives: tuple[str, ...] = task.CONNECTIVES

    def key(self) -> str:
        blob = json.dumps({"world": self.name, "version": WORLD_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def vocabulary(self) -> list[str]:
        return task.vocabulary(self.vocab_size, self.connectives)

    def connective_words(self) -> tuple[str, ...]:
        return self.connectives


def build_reasoning_world(cache_dir: str | Path, spec: ReasoningWorldSpec = ReasoningWorldSpec(),
                          log=print) -> World:
    """The world for `spec` under cache_dir/reasoning-<key>/, built unless a complete one is already there."""
    return build_world(cache_dir, spec, log)
