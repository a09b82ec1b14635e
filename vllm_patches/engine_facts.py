"""What a vLLM `LLM` engine counts and runs with, read from the engine itself, and how to stop it.

    before = engine_counters(llm); llm.generate(...)
    delta = counter_delta(engine_counters(llm), before)   # e.g. spec_decode_num_drafts of that generate
    summary_from_counters(delta, k)                       # tau and alpha_k from vLLM's counters alone
    engine_facts(llm)                                     # runner, async scheduling, max_num_seqs (provenance)
    close_llm(llm)                                        # stop its engine now

`engine.SpecEngine` uses these for its own engine; the paired measurements use them for a plain engine beside it.
"""

from __future__ import annotations

import os

from openrlhf_growmtp.core.metrics import AcceptanceSummary

from .settings import RUNNER_ENV

COUNTERS = ("vllm:spec_decode_", "vllm:num_preemptions", "vllm:prefix_cache_hits")
ENGINE_FACTS_LINE = "growmtp engine facts: "  # a rollout actor's log line, read back by the studies (report.py)


def engine_counters(llm) -> dict:
    """vLLM's own cumulative counters for spec decoding, preemptions and prefix-cache hits ("vllm:" dropped)."""
    out = {}
    for metric in llm.get_metrics():
        if metric.name.startswith(COUNTERS):
            name = metric.name.removeprefix("vllm:")
            out[name] = list(metric.values) if hasattr(metric, "values") else metric.value
    return out


def counter_delta(after: dict, before: dict) -> dict:
    """Every counter's growth from `before` to `after` (per position for the vector counters)."""
    delta = {}
    for name, value in after.items():
        old = before.get(name, 0 if not isinstance(value, list) else [0] * len(value))
        delta[name] = [a - b for a, b in zip(value, old)] if isinstance(value, list) else value - old
    return delta


def summary_from_counters(counters: dict, k: int) -> AcceptanceSummary:
    """The acceptance summary of a generate from vLLM's counters alone (a generate without records)."""
    cycles = int(counters.get("spec_decode_num_drafts", 0))
    accepted = int(counters.get("spec_decode_num_accepted_tokens", 0))
    per_position = counters.get("spec_decode_num_accepted_tokens_per_pos", [0] * k)
    return AcceptanceSummary(cycles=cycles, accepted_tokens=accepted, tau=1.0 + accepted / max(cycles, 1),
                             alpha=[a / max(cycles, 1) for a in per_position])


def engine_facts(llm) -> dict:
    """What a vLLM `LLM` runs with, read from the engine itself (a kept measurement records it): its model
    runner's class, asynchronous scheduling and `max_num_seqs`, as vLLM resolved them, and the runner choice
    in the environment of the process that built it."""
    return _facts(llm.llm_engine.vllm_config.scheduler_config, llm.collective_rpc(_runner_name)[0])


async def engine_facts_async(llm) -> dict:
    """`engine_facts` of an `AsyncLLM` (a rollout actor's engine)."""
    return _facts(llm.vllm_config.scheduler_config, (await llm.collective_rpc(_runner_name))[0])


def _facts(scheduler_config, runner: str) -> dict:
    return {"runner": runner, "async_scheduling": bool(scheduler_config.async_scheduling),
            "max_num_seqs": int(scheduler_config.max_num_seqs), RUNNER_ENV: os.environ.get(RUNNER_ENV)}


def _runner_name(worker) -> str:
    runner = type(worker.model_runner)
    return f"{runner.__module__}.{runner.__qualname__}"


def close_llm(llm) -> None:
    """Stop a vLLM `LLM`'s engine now (`SpecEngine.close`; a plain engine beside it, e.g. the autoregressive arm
    of a paired measurement). In process, only its executor: the full shutdown hangs in zmq's teardown."""
    core = in_process_core(llm)
    if core is not None:
        core.model_executor.shutdown()
    else:
        llm.llm_engine.engine_core.shutdown()


def in_process_core(llm):
    """The EngineCore of an in-process engine (InprocClient, VLLM_ENABLE_V1_MULTIPROCESSING=0), else None."""
    return getattr(llm.llm_engine.engine_core, "engine_core", None)


def worker_in_process(llm) -> bool:
    """Whether `llm`'s worker runs in this process, so that collective_rpc returns its results unserialised
    (an in-process engine core with a single-process executor)."""
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    core = in_process_core(llm)
    return core is not None and isinstance(core.model_executor, UniProcExecutor)
