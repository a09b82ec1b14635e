"""The driver side: a speculative vLLM engine that drafts with a GrowMTP head and returns records.

    engine = SpecEngine(model_dir, head_dir, k=3, dtype="float32", enforce_eager=True, ...)
    result = engine.generate([[1, 2, 3], ...], SamplingParams(temperature=1.0, max_tokens=64))
    result.records[i]      # SequenceRecord of prompt i (validated), or None without capture
    result.metrics         # tau, alpha_k, cycles, record bytes per generated token, tokens/s
    engine.load_head(state_dict_or_dir); engine.load_target(hf_state_dict)
    engine.set_draft_vocab(DraftVocab(ids, vocab_size))  # q zero outside ids; None: every id
    engine.set_capture(False)  # e.g. evaluation rollouts: no records, no capture work; True switches it back
    engine = SpecEngine(..., k=3, dynamic_depth=True)   # K = 3 at most; then between generates:
    engine.set_depth(1); engine.cycle_costs()  # records and metrics at depth 1; the engine's step seconds per depth

The engine's settings come from `settings.spec_engine_kwargs` (sampled drafts from q, standard rejection
sampling; configurations that would verify against a one-hot q are refused there), and its records from
a `collector.RecordCollector` (a cycle vLLM verified without q at run time raises on collection).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from openrlhf_growmtp.core.checkpoint import HEAD_WEIGHTS, read_head_config
from openrlhf_growmtp.core.depth import CycleCosts
from openrlhf_growmtp.core.draft_vocab import DraftVocab
from openrlhf_growmtp.core.metrics import AcceptanceSummary, acceptance_summary
from openrlhf_growmtp.core.records import DEFAULT_TOPK, SequenceRecord

from . import check_vllm_version
from .collector import DROPPED_META, RecordCollector
from .engine_depth import awaitable, calibration, run_now
from .engine_facts import (close_llm, counter_delta, engine_counters, in_process_core, summary_from_counters,
                           worker_in_process)
from .settings import CaptureConfig, SpecConfigError, check_sampling_params, spec_engine_kwargs
from .transport import dump_blob

check_vllm_version()

logger = logging.getLogger(__name__)


@dataclass
class RolloutMetrics:
    acceptance: AcceptanceSummary
    generated_tokens: int
    wall_s: float
    record_bytes: int = 0
    vllm_counters: dict = field(default_factory=dict)
    dropped_cycles: int = 0  # cycles vLLM verified that the records leave out (collector.DROPPED_META)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def record_bytes_per_token(self) -> float:
        return self.record_bytes / max(self.generated_tokens, 1)

    def as_dict(self) -> dict[str, float]:
        out = self.acceptance.as_dict()
        out.update(generated_tokens=float(self.generated_tokens), rollout_s=self.wall_s,
                   tokens_per_s=self.tokens_per_s, record_bytes_per_token=self.record_bytes_per_token,
                   dropped_cycles=float(self.dropped_cycles))
        return out


@dataclass
class GenerateResult:
    outputs: list
    records: list[SequenceRecord | None]
    metrics: RolloutMetrics
    # debug (capture_q=True): per request, the q rows [R, K, V] the rejection sampler received
    draft_probs: list[torch.Tensor | None] = field(default_factory=list)


class SpecEngine:
    """A vLLM `LLM` drafting with a GrowMTP head, with record capture and live weight updates."""

    def __init__(self, model: str | Path, head_dir: str | Path | None, k: int, *, capture: bool = True,
                 topk: int = DEFAULT_TOPK, logprob_dtype: str = "bfloat16", capture_q: bool = False,
                 capture_hidden: bool = False, dynamic_depth: bool = False, **llm_kwargs):
        if head_dir is not None:  # None: the model's own native MTP layer drafts (vLLM's "mtp" method)
            read_head_config(head_dir)  # a clear error for a directory that is not a head, before vLLM starts
        self.capture_config = CaptureConfig(enabled=capture, topk=topk, logprob_dtype=logprob_dtype,
                                            capture_q=capture_q, capture_hidden=capture_hidden)
        llm_kwargs = spec_engine_kwargs(head_dir, k, self.capture_config, dynamic_depth=dynamic_depth,
                                        model=str(model), **llm_kwargs)
        llm_kwargs.setdefault("disable_log_stats", False)
        from vllm import LLM

        self.k, self.capture, self.head_dir = int(k), capture, None if head_dir is None else Path(head_dir)
        self.depth = self.k  # drafts per cycle now: K, or what set_depth chose
        self.llm = LLM(**llm_kwargs)
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()
        self._in_process = worker_in_process(self.llm)
        self._head_state: dict[str, torch.Tensor] | None = None
        self._slept_level = 0
        # always configured: in-process engines share the worker module state with earlier engines
        self.llm.collective_rpc("growmtp_configure_capture", args=(self.capture_config.as_dict(),))

    # ---- generation -------------------------------------------------------------------------------
    def set_capture(self, enabled: bool) -> None:
        """Switch record capture off or back on between generates (e.g. off for evaluation rollouts that need
        no records: their generates then return no records and cost no capture work). Only an engine built
        with capture=True can capture: vLLM takes what capture needs (synchronous scheduling, per-request
        spec-decode metrics) when it starts."""
        if enabled and not self.capture_config.enabled:
            raise SpecConfigError("this engine was built with capture=False: vLLM's settings for record capture "
                                  "are fixed when it starts; build it with capture=True to switch capture on")
        config = self.capture_config if enabled else CaptureConfig(enabled=False)
        self.llm.collective_rpc("growmtp_configure_capture", args=(config.as_dict(),))
        self.capture = bool(enabled)

    def generate(self, prompts: list[list[int]], sampling_params) -> GenerateResult:
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        for p in params:
            check_sampling_params(p, self.capture)
        inputs = [{"prompt_token_ids": list(map(int, ids))} for ids in prompts]
        before = engine_counters(self.llm)
        began = time.perf_counter()
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        wall = time.perf_counter() - began
        counters = counter_delta(engine_counters(self.llm), before)
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        if not self.capture:
            summary = summary_from_counters(counters, self.depth)
            return GenerateResult(outputs, [None] * len(outputs),
                                  RolloutMetrics(summary, generated, wall, vllm_counters=counters))
        config = self.capture_config
        collector = RecordCollector(self.depth, topk=config.topk, vocab_size=self.vocab_size,
                                    hidden_dtype=getattr(torch, config.logprob_dtype),
                                    capture_hidden=config.capture_hidden)
        for output, p in zip(outputs, params):
            collector.add_output(output, p)
        # After a preemption's recompute some captured hidden rows are off (vllm_patches/README.md, "Driver-side
        # metrics"): fall back to transport-free records, never wrong ones.
        keep_hidden = not (config.capture_hidden and counters.get("num_preemptions", 0) > 0)
        if not keep_hidden:
            logger.warning("GrowMTP: %d preemption(s) in this generate; dropping engine-captured hidden states "
                           "(the trainer recomputes them)", counters["num_preemptions"])
        # only the recording rank (worker_ext.RECORDING_RANK, the first) of a tensor-parallel engine captures
        # an in-process worker hands the payload over as it is; across processes it travels as a blob
        drained = self.llm.collective_rpc("growmtp_drain_records", args=(not self._in_process,))[0]
        collector.add_drained(drained, keep_hidden=keep_hidden)
        draft_probs = [collector.peek_draft_probs(o) for o in outputs]
        records = collector.pop_all(outputs)
        accepted = torch.cat([r.accepted for r in records]) if records else torch.zeros(0)
        record_bytes = sum(r.nbytes for r in records)
        dropped = sum(r.meta[DROPPED_META] for r in records)
        metrics = RolloutMetrics(acceptance_summary(accepted, self.depth), generated, wall, record_bytes, counters,
                                 dropped)
        return GenerateResult(outputs, records, metrics, draft_probs)

    def close(self) -> None:
        """Stop the engine now, with the worker processes of a tensor-parallel engine (which would otherwise
        live until the interpreter exits, with their KV caches). An in-process engine core stops only its
        executor: vLLM's full in-process shutdown hangs here in zmq's context teardown."""
        close_llm(self.llm)
        del self.llm

    # ---- drafting depth ------------------------------------------------------------------------------
    def set_depth(self, depth: int) -> None:
        """Draft `depth` (0..K) tokens per cycle from the next generate on (an engine built with
        dynamic_depth=True; `engine_depth`). Records and metrics then hold `depth` positions."""
        self.depth = self._core_call("growmtp_set_depth", int(depth))

    def step_times(self) -> list[tuple[int, int, float]]:
        """The engine's clean steps since the last call: (depth, running requests, seconds) (`engine_depth`)."""
        return [tuple(step) for step in self._core_call("growmtp_step_times")]

    def cycle_costs(self, requests: int) -> CycleCosts:
        """The engine's seconds per step at every depth 0..K, timed on its own generates with capture off: at
        depths 0, 1 and K, `requests` prompts together (`engine_depth.calibration`). Leaves the depth as it was."""
        plan = calibration(self.k, self.vocab_size, requests)
        depth, capture = self.depth, self.capture
        if capture:
            self.set_capture(False)
        try:
            return run_now(plan.measure(awaitable(lambda: self.generate(plan.prompts, plan.params)),
                                        awaitable(self.set_depth), awaitable(self.step_times)))
        finally:
            self.set_depth(depth)
            if capture:
                self.set_capture(True)

    def _core_call(self, method: str, *args):
        """An engine-core utility (`engine_depth`): called directly in-process, else through vLLM's client."""
        core = in_process_core(self.llm)
        if core is not None:
            return getattr(core, method)(*args)
        return self.llm.llm_engine.engine_core.call_utility(method, *args)

    # ---- weights ------------------------------------------------------------------------------------
    def set_draft_vocab(self, vocab: DraftVocab | None) -> None:
        """Draft over `vocab`'s ids only from the next generate on (None: every id); its records carry its tag
        (`core.draft_vocab`). Set it again after `load_target`: it gathers the lm_head's rows when set."""
        ids, tag = (None, None) if vocab is None else (vocab.ids.tolist(), vocab.tag)
        self.llm.collective_rpc("growmtp_set_draft_vocab", args=(ids, tag))

    def load_head(self, head: str | Path | dict[str, torch.Tensor]) -> list[str]:
        """Load head weights (a head directory or a core-head state dict) into the running engine."""
        state = load_file(str(Path(head) / HEAD_WEIGHTS)) if isinstance(head, (str, Path)) else head
        state = _cpu_state(state)
        loaded = self.llm.collective_rpc("growmtp_load_head_weights", args=(dump_blob(state),))[0]
        self._head_state = state
        return loaded

    def load_target(self, state: dict[str, torch.Tensor]) -> int:
        """Load HF-named policy weights into the running engine (the drafter shares embed/lm_head)."""
        return self.llm.collective_rpc("growmtp_load_target_weights", args=(dump_blob(_cpu_state(state)),))[0]

    # ---- sleep / wake -----------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Release engine memory; level 2 discards weights (GPU). A no-op where vLLM has no sleep mode (CPU)."""
        if self.llm.llm_engine.vllm_config.model_config.enable_sleep_mode:
            self.llm.sleep(level=level)
        self._slept_level = level

    def wake_up(self) -> None:
        """Wake the engine; after a level-2 sleep, reload the last head weights.

        vLLM restores the target's weights only from a new sync, and its drafter's are lost after
        level-2 sleep (acceptance then silently falls to 0), so the head is re-sent here.
        """
        if self.llm.llm_engine.vllm_config.model_config.enable_sleep_mode:
            self.llm.wake_up()
        if self._slept_level == 2:
            self.load_head(self._head_state if self._head_state is not None else self.head_dir)
        self._slept_level = 0


def _cpu_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict's tensors on the host, contiguous (what `dump_blob` ships)."""
    return {name: tensor.detach().to("cpu").contiguous() for name, tensor in state.items()}
