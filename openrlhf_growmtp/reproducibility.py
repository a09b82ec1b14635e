"""What `--train.full_determinism_enable` turns on in a run of this CLI, one ingredient at a time.

Upstream's flag does two things: each policy actor calls `transformers.enable_full_determinism` (seeds,
and torch's deterministic mode), and each rollout actor runs vLLM's engine core with its model in one
process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`). Ours adds what makes rollouts reproducible
(`trainer/rollout_order.py`). The ingredients, by name:

- `deterministic_algorithms`: torch's deterministic algorithms in the policy actors (upstream's);
- `fill_uninitialized_memory`: under that mode torch fills every new tensor with NaN (upstream's), so a
  read of memory nothing wrote gives the same value in every run;
- `fill_gradient_bucket`: that fill for the gradient bucket DeepSpeed's ZeRO-1/2 allocates anew at every
  micro-step (5e8 elements by default). DeepSpeed reads only what it copied gradients into, so the fill
  changes nothing there; on CPU it is 2 GB of writes per micro-step and rank (its cost:
  docs/measurements.md#what-reproducibility-costs, the `upstream` row).
  Off where the CPU layer is active (`installer.install_cpu_support`); on a GPU it is a device memset and
  stays as upstream has it;
- `engine_in_process`: the engine core and its model in one process (upstream's);
- `request_seeds`: a sampling seed per request, from its place in the RL step's dispatch order;
- `seeded_drafts`: a seeded request's drafts from its own generator (`vllm_patches.seeded_drafts`);
- `ordered_scheduling`: each engine admits an RL step's requests while paused and schedules them in
  dispatch order (vLLM's priority scheduling).

What each costs and whether runs agree without it: `benchmarks/bench_determinism.py`. Under the flag
every ingredient is on but `fill_gradient_bucket` on CPU; `$GROWMTP_DETERMINISM` overrides them for
measurement (`name=0` or `name=1`, comma-separated; every process of a run reads it). Without the flag
none is on.
"""

from __future__ import annotations

import functools
import os

import torch

from . import cpu_support

OVERRIDE_ENV = "GROWMTP_DETERMINISM"
INGREDIENTS = ("deterministic_algorithms", "fill_uninitialized_memory", "fill_gradient_bucket", "engine_in_process",
               "request_seeds", "seeded_drafts", "ordered_scheduling")


def overrides() -> dict[str, bool]:
    """The ingredients `$GROWMTP_DETERMINISM` sets; a clear error for a name or value it does not know."""
    found = {}
    for item in filter(None, (part.strip() for part in os.environ.get(OVERRIDE_ENV, "").split(","))):
        name, _, value = item.partition("=")
        if name not in INGREDIENTS or value not in ("0", "1"):
            raise ValueError(f"${OVERRIDE_ENV}: {item!r} is not name=0 or name=1 with a name among {INGREDIENTS}")
        found[name] = value == "1"
    return found


def ingredient(name: str) -> bool:
    """Whether a run under full determinism uses this ingredient, in this process."""
    if name not in INGREDIENTS:
        raise KeyError(name)
    default = not (name == "fill_gradient_bucket" and cpu_support.needed())
    return overrides().get(name, default)


def apply_torch_ingredients() -> None:
    """In a policy actor, right after upstream's `enable_full_determinism`: the torch-side ingredients."""
    torch.use_deterministic_algorithms(ingredient("deterministic_algorithms"))
    torch.utils.deterministic.fill_uninitialized_memory = ingredient("fill_uninitialized_memory")


def unfilled(allocate):
    """`allocate` with torch's fill of new tensors off while it runs (`fill_gradient_bucket`)."""
    @functools.wraps(allocate)
    def run(*args, **kwargs):
        saved = torch.utils.deterministic.fill_uninitialized_memory
        torch.utils.deterministic.fill_uninitialized_memory = False
        try:
            return allocate(*args, **kwargs)
        finally:
            torch.utils.deterministic.fill_uninitialized_memory = saved

    return run
