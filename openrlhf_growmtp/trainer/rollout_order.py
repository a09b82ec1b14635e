"""Reproducible rollouts (upstream's `--train.full_determinism_enable`).

Three things make two runs of one command and seed draw different rollouts, all from timing:
- an engine schedules requests in the order they arrive, so which requests share a batch differs, and
  with it the numerics of small fp32 batches on CPU and every draw vLLM takes from its global RNG;
- the samples come back in the order they finish (`ray.wait`), which is the replay buffer's order.

So every request of an RL step gets a number from the samples generator's dispatch order (the prompt's
dispatch, then its sample): its sampling seed and its scheduling priority follow from it, and the step's
requests enter each engine while it is paused (`RolloutActor.growmtp_hold` / `growmtp_release`), so the
engine's first batch holds all of them in priority order and every later one follows from the
computation alone; drafts of a seeded request are drawn from its own generator
(`vllm_patches.seeded_drafts`); the step's samples are put back in dispatch order before they become
experience. What a run does not control (async training's queue timing, dynamic filtering's
replacement prompts) is not made reproducible.
"""

from __future__ import annotations

import contextvars
import hashlib
import itertools
from copy import copy
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

ORDER_KEY = "growmtp_order"  # on a response: (dispatch number, sample index)
# (run seed, dispatch number, a counter of the dispatch's samples) while a dispatch's requests are made
_DISPATCH: contextvars.ContextVar = contextvars.ContextVar("growmtp_dispatch", default=None)
# the scheduling priority of the request being made (read by `PrioritizedLLM.generate`)
_PRIORITY: contextvars.ContextVar = contextvars.ContextVar("growmtp_priority", default=None)
SAMPLES_PER_DISPATCH = 2**20  # priorities: dispatch number x this + sample index


def request_seed(run_seed: int, dispatch: int, sample: int) -> int:
    """A sampling seed per request, distinct for every (run seed, dispatch, sample)."""
    digest = hashlib.sha256(f"{run_seed}:{dispatch}:{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # vLLM takes a non-negative 64-bit seed


class NumberedEngines:
    """The samples generator's engine handles for one dispatch round: each `generate_responses` call carries
    the next dispatch number (and the run's seed), and the requests sent to each engine are counted."""

    def __init__(self, engines: list, run_seed: int, numbers: itertools.count):
        self.engines, self.requests = engines, [0] * len(engines)
        self.handles = [_Numbered(engine, i, self, run_seed, numbers) for i, engine in enumerate(engines)]


@dataclass
class _Numbered:
    engine: Any
    index: int
    owner: NumberedEngines
    run_seed: int
    numbers: itertools.count

    def __getattr__(self, name):  # get_num_unfinished_requests and the rest: the engine's own
        return getattr(self.engine, name)

    @property
    def generate_responses(self):
        def remote(**kwargs):
            self.owner.requests[self.index] += kwargs.get("num_samples", 1)
            return self.engine.generate_responses.remote(**kwargs,
                                                         growmtp_dispatch=(self.run_seed, next(self.numbers)))

        return SimpleNamespace(remote=remote)


def start_dispatch(dispatch: tuple[int, int]):
    """In the rollout actor, around one dispatch's samples (a context token for `end_dispatch`)."""
    run_seed, number = dispatch
    return _DISPATCH.set((run_seed, number, itertools.count()))


def end_dispatch(token) -> None:
    _DISPATCH.reset(token)


def number_request(sampling_params, seeded: bool = True):
    """The sampling params of the dispatch's next request, with its own seed (unless not `seeded`), and its
    priority set for `PrioritizedLLM` (the same params, and no priority, outside a numbered dispatch)."""
    dispatch = _DISPATCH.get()
    if dispatch is None:
        return sampling_params
    run_seed, number, samples = dispatch
    sample = next(samples)
    _PRIORITY.set(number * SAMPLES_PER_DISPATCH + sample)
    if not seeded:
        return sampling_params
    params = copy(sampling_params)
    params.seed = request_seed(run_seed, number, sample)
    return params


class PrioritizedLLM:
    """A vLLM AsyncLLM whose `generate` passes the current request's scheduling priority (vLLM's public
    `priority` argument; lower runs first under `scheduling_policy="priority"`)."""

    def __init__(self, llm):
        self._llm = llm

    def generate(self, *args, **kwargs):
        priority = _PRIORITY.get()
        if priority is not None:
            kwargs.setdefault("priority", priority)
        return self._llm.generate(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._llm, name)
