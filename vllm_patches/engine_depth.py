"""The drafting depth of a running engine, set between generates, and the engine's own step times.

vLLM 0.29's dynamic speculative decoding (`speculative_config.num_speculative_tokens_per_batch_size`) has
the scheduler read each step's drafting depth from a batch-size table (`Scheduler.dynamic_sd_lookup`, K at
most) and hand it to the runner (`SchedulerOutput.num_spec_tokens_to_schedule`); at depth 0 the runner
still runs the head's first pass and drafts nothing. An engine built with such a table
(`settings.speculative_config(..., dynamic_depth=True)`) takes a new one from `growmtp_set_depth`, without
being rebuilt. Both calls here are engine-core utilities, installed on vLLM's `EngineCore` in every process
that runs one (the plugin), and reached with `EngineCoreClient.call_utility` (or directly in-process):
- `growmtp_set_depth(depth)`: every batch size drafts `depth` (0..K) from the next step on; refused while
  requests are in flight (a record keeps one depth) and on an engine built with a fixed depth;
- `growmtp_step_times()`: the engine's steps since the last call, as (depth, running requests, seconds),
  for the steps whose every request verified `depth` drafts and drafts `depth` more (prefill steps and a
  depth change's first step left out; an engine of a fixed depth keeps none). A step's seconds are
  `EngineCore.step`'s: schedule, the forward, sampling, drafting and the scheduler's update, on the engine's
  own clock.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from dataclasses import dataclass

import torch

from openrlhf_growmtp.core.depth import CycleCosts

from . import check_vllm_version

check_vllm_version()

STEPS_KEPT = 1 << 16  # the most recent steps kept between two reads
_STEPS: deque = deque(maxlen=STEPS_KEPT)
_LAST_OUTPUT = "_growmtp_last_output"
_INSTALLED = False


CALIBRATION_TOKENS = 24  # tokens per request at each depth: 20-odd clean steps of the full batch
CALIBRATION_PROMPT = 8


@dataclass(frozen=True)
class Calibration:
    """What measuring an engine's cycle costs generates: at each depth, `prompts` together."""

    k: int
    depths: tuple[int, ...]
    prompts: list[list[int]]
    params: object  # vLLM SamplingParams

    async def measure(self, generate, set_depth, step_times) -> CycleCosts:
        """The engine's seconds per step at every depth 0..K: a first generate warms the engine (its first steps
        after start-up are slow) and its steps are dropped, then at each of `depths` a generate of `prompts` and
        its clean steps. `generate()`, `set_depth(depth)` and `step_times()` are the engine's calls, awaited: the
        async rollout actor's, or a synchronous engine's through `run_now` and `awaitable`."""
        await generate()
        await step_times()
        steps = []
        for depth in self.depths:
            await set_depth(depth)
            await generate()
            steps += await step_times()
        return CycleCosts.from_steps([tuple(step) for step in steps], self.k)


def awaitable(fn):
    """A synchronous call as a coroutine function (one that completes at once), for `Calibration.measure`."""

    async def call(*args):
        return fn(*args)

    return call


def run_now(coroutine):
    """The result of a coroutine whose every await completes at once (`awaitable` calls), with no event loop."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("the coroutine waited on an event: run it in an event loop")


def calibration(k: int, vocab_size: int, requests: int) -> Calibration:
    """Depths 0, 1 and K (the line through them gives the rest), `requests` prompts of random tokens (the
    running batch the rollouts run at), each generating CALIBRATION_TOKENS whatever it samples."""
    from vllm import SamplingParams

    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab_size, (requests, CALIBRATION_PROMPT), generator=generator).tolist()
    return Calibration(k, tuple(sorted({0, 1, k})), prompts,
                       SamplingParams(temperature=1.0, max_tokens=CALIBRATION_TOKENS, ignore_eos=True, seed=0))


def clean_step(output) -> tuple[int, int] | None:
    """(depth, requests) of a SchedulerOutput whose every request verifies `depth` drafts and then drafts
    `depth`; None for a step with a prefill or a mixed depth."""
    depth = int(output.num_spec_tokens_to_schedule)
    if output.scheduled_new_reqs or not output.num_scheduled_tokens:
        return None
    spec = output.scheduled_spec_decode_tokens
    for req_id, tokens in output.num_scheduled_tokens.items():
        verified = len(spec.get(req_id, ()))
        if verified != depth or tokens != 1 + verified:
            return None
    return depth, len(output.num_scheduled_tokens)


def _schedule_hook(original):
    @functools.wraps(original)
    def schedule(self, *args, **kwargs):
        output = original(self, *args, **kwargs)
        setattr(self, _LAST_OUTPUT, output)
        return output

    return schedule


def _step_hook(original):
    @functools.wraps(original)
    def step(self):
        if getattr(self.scheduler, "dynamic_sd_lookup", None) is None:  # a fixed depth: nothing asks for its steps
            return original(self)
        began = time.perf_counter()
        result = original(self)
        seconds = time.perf_counter() - began
        output = getattr(self.scheduler, _LAST_OUTPUT, None)
        setattr(self.scheduler, _LAST_OUTPUT, None)
        if output is not None and (shape := clean_step(output)) is not None:
            _STEPS.append((*shape, seconds))
        return result

    return step


def growmtp_set_depth(self, depth: int) -> int:
    """EngineCore utility: draft `depth` tokens per cycle at every batch size from the next step on."""
    scheduler = self.scheduler
    lookup = getattr(scheduler, "dynamic_sd_lookup", None)
    if lookup is None:
        raise RuntimeError("this engine drafts at a fixed depth; build it with dynamic_depth=True "
                           "(--growmtp_depth auto) to set the depth while it runs")
    k = int(scheduler.num_spec_tokens)
    if isinstance(depth, bool) or not isinstance(depth, int) or not 0 <= depth <= k:
        raise ValueError(f"depth must be an int in 0..{k} (the engine's K), got {depth!r}")
    if scheduler.has_unfinished_requests():
        raise RuntimeError("set the drafting depth between generates: requests are in flight, and a record "
                           "keeps the one depth its cycles were drafted at")
    scheduler.dynamic_sd_lookup = [depth] * len(lookup)
    return depth


def growmtp_step_times(self) -> list[tuple[int, int, float]]:
    """EngineCore utility: the clean steps since the last call (module docstring), oldest first."""
    steps = list(_STEPS)
    _STEPS.clear()
    return steps


def install_engine_depth() -> None:
    """Time EngineCore's steps and add the two utilities (idempotent; inert for an engine that never asks)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    Scheduler.schedule = _schedule_hook(Scheduler.schedule)
    EngineCore.step = _step_hook(EngineCore.step)
    EngineCore.growmtp_set_depth = growmtp_set_depth
    EngineCore.growmtp_step_times = growmtp_step_times
    _INSTALLED = True
