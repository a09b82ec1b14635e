"""The driver side: a speculative vLLM engine that drafts with a GrowMTP head and returns records.

    engine = SpecEngine(model_dir, head_dir, k=3, dtype="float32", enforce_eager=True, ...)
    result = engine.generate([[1, 2, 3], ...], SamplingParams(temperature=1.0, max_tokens=64))
    result.records[i]      # SequenceRecord of prompt i (validated), or None without capture
    result.metrics         # tau, alpha_k, cycles, record bytes per generated token, tokens/s
    engine.load_head(state_dict_or_dir); engine.load_target(hf_state_dict)

Drafts are always sampled from q (`draft_sample_method="probabilistic"`) and verified with true
rejection sampling (`rejection_sample_method="standard"`); configurations that would verify against
a one-hot q are refused here, and a cycle vLLM verified without q at run time raises on collection.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from openrlhf_growmtp.core.checkpoint import HEAD_WEIGHTS, read_head_config
from openrlhf_growmtp.core.metrics import AcceptanceSummary, acceptance_summary
from openrlhf_growmtp.core.records import DEFAULT_TOPK, SequenceRecord

from . import check_vllm_version
from .capture import CYCLE_FIELDS, dump_blob, load_blob

check_vllm_version()

logger = logging.getLogger(__name__)
WORKER_EXTENSION = "vllm_patches.worker_ext.GrowMTPWorkerExtension"


class SpecConfigError(ValueError):
    """A speculative-decoding or sampling configuration GrowMTP refuses."""


def speculative_config(head_dir: str | Path, k: int) -> dict:
    """vLLM's speculative_config for drafting K tokens per cycle by sampling from the head."""
    return {"method": "eagle", "model": str(head_dir), "num_speculative_tokens": int(k),
            "draft_sample_method": "probabilistic", "rejection_sample_method": "standard"}


def check_speculative_config(config: dict) -> None:
    """Refuse anything that is not sampled drafting from q verified by standard rejection sampling."""
    k = config.get("num_speculative_tokens")
    if not isinstance(k, int) or k < 1:
        raise SpecConfigError(f"num_speculative_tokens must be an int >= 1, got {k!r}")
    if config.get("method") not in ("eagle", "mtp"):
        raise SpecConfigError(f"method must be 'eagle' (a GrowMTP head directory) or 'mtp', got {config.get('method')!r}")
    if config.get("draft_sample_method", "greedy") != "probabilistic":
        raise SpecConfigError(
            f"draft_sample_method={config.get('draft_sample_method', 'greedy')!r}: GrowMTP drafts by sampling from "
            "q and verifies with min(1, p/q); greedy drafts would be verified against a one-hot q. "
            "Use draft_sample_method='probabilistic'.")
    if config.get("rejection_sample_method", "standard") != "standard":
        raise SpecConfigError(f"rejection_sample_method={config['rejection_sample_method']!r}: only 'standard' "
                              "(true rejection sampling) keeps the target distribution")


def check_sampling_params(params, capture: bool) -> None:
    """Per-request settings the records (or true rejection sampling) cannot represent."""
    if params.temperature <= 0:
        raise SpecConfigError(f"temperature={params.temperature}: greedy requests are verified by argmax, not "
                              "min(1, p/q); GrowMTP needs temperature > 0")
    if not capture:
        return
    if params.n != 1:
        raise SpecConfigError(f"n={params.n}: records are joined per request; repeat the prompt instead of n > 1")
    if params.top_p < 1.0 or params.top_k not in (0, -1) or params.min_p > 0.0:
        raise SpecConfigError(f"top_p={params.top_p}, top_k={params.top_k}, min_p={params.min_p}: records hold "
                              "full-vocabulary p; truncated sampling is supported only without capture")


@dataclass
class RolloutMetrics:
    acceptance: AcceptanceSummary
    generated_tokens: int
    wall_s: float
    record_bytes: int = 0
    vllm_counters: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def record_bytes_per_token(self) -> float:
        return self.record_bytes / max(self.generated_tokens, 1)

    def as_dict(self) -> dict[str, float]:
        out = self.acceptance.as_dict()
        out.update(generated_tokens=float(self.generated_tokens), rollout_s=self.wall_s,
                   tokens_per_s=self.tokens_per_s, record_bytes_per_token=self.record_bytes_per_token)
        return out


@dataclass
class GenerateResult:
    outputs: list
    records: list[SequenceRecord | None]
    metrics: RolloutMetrics
    # debug (capture_q=True): per request, the q rows [R, K, V] the rejection sampler received
    draft_probs: list[torch.Tensor | None] = field(default_factory=list)


def join_records(outputs, by_request: dict[str, dict], temperatures: list[float], k: int,
                 hidden_dtype: torch.dtype = torch.bfloat16) -> list[SequenceRecord]:
    """One validated SequenceRecord per RequestOutput from the drained capture, keyed by request id."""
    records = []
    for output, temperature in zip(outputs, temperatures):
        entry = by_request.get(output.request_id, {})
        token_ids = torch.tensor(list(output.prompt_token_ids) + list(output.outputs[0].token_ids), dtype=torch.int64)
        if "start" in entry:
            fields = {name: entry[name] for name in ("start", "drafts", "topk_ids", "topk_logprobs", "accepted")}
        else:  # finished before any cycle
            fields = dict(start=torch.zeros(0, dtype=torch.int64), drafts=torch.zeros(0, k, dtype=torch.int32),
                          topk_ids=torch.zeros(0, k, 1, dtype=torch.int32),
                          topk_logprobs=torch.zeros(0, k, 1, dtype=torch.bfloat16),
                          accepted=torch.zeros(0, dtype=torch.int64))
        meta = {"request_id": output.request_id}
        record = SequenceRecord(token_ids=token_ids, prompt_len=len(output.prompt_token_ids),
                                hidden=_hidden_rows(entry, len(token_ids), fields["start"], hidden_dtype),
                                temperature=float(temperature), meta=meta, **fields)
        records.append(record.validate(k=k))
    return records


def entries_by_request(payload: dict) -> dict[str, dict]:
    """A drained capture payload keyed by the caller's request ids; raises on engine-side errors."""
    if payload["errors"]:
        raise RuntimeError("speculative verification went wrong in the engine: " + "; ".join(payload["errors"]))
    counts = payload["counts"].tolist()
    split = {name: torch.split(payload[name], counts) for name in CYCLE_FIELDS if name in payload}
    by_request: dict[str, dict] = {}
    internal_ids = list(payload["req_ids"]) + [r for r in payload["hidden"] if r not in set(payload["req_ids"])]
    for i, internal_id in enumerate(internal_ids):
        external_id = internal_id.rsplit("-", 1)[0]  # vLLM appends "-<random suffix>" to the caller's id
        if external_id in by_request:
            raise RuntimeError(f"two engine requests map to request {external_id!r}")
        entry = {name: parts[i] for name, parts in split.items()} if i < len(counts) else {}
        if internal_id in payload["hidden"]:
            entry["hidden_positions"], entry["hidden"] = payload["hidden"][internal_id]
        by_request[external_id] = entry
    return by_request


def _hidden_rows(entry: dict, length: int, starts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """[T, H] from captured (position, hidden) rows; rows after the last cycle start were never consumed."""
    if "hidden" not in entry:
        return None
    positions, rows = entry["hidden_positions"], entry["hidden"]
    hidden = torch.zeros(length, rows.shape[-1], dtype=rows.dtype)
    keep = positions < length
    hidden[positions[keep]] = rows[keep]
    seen = torch.zeros(length, dtype=torch.bool)
    seen[positions[keep]] = True
    needed = int(starts.max()) + 1 if starts.numel() else 0
    if not bool(seen[:needed].all()):
        missing = (~seen[:needed]).nonzero().flatten()[:8].tolist()
        raise RuntimeError(f"hidden states of committed positions {missing} were never computed by the engine "
                           "(prefix-cache hit?); exact mode needs enable_prefix_caching=False")
    return hidden.to(dtype)


COUNTERS = ("vllm:spec_decode_", "vllm:num_preemptions", "vllm:prefix_cache_hits")


def engine_counters(llm) -> dict:
    """vLLM's own cumulative counters for spec decoding, preemptions and prefix-cache hits ("vllm:" dropped)."""
    out = {}
    for metric in llm.get_metrics():
        if metric.name.startswith(COUNTERS):
            name = metric.name.removeprefix("vllm:")
            out[name] = list(metric.values) if hasattr(metric, "values") else metric.value
    return out


def _counter_delta(after: dict, before: dict) -> dict:
    delta = {}
    for name, value in after.items():
        old = before.get(name, 0 if not isinstance(value, list) else [0] * len(value))
        delta[name] = [a - b for a, b in zip(value, old)] if isinstance(value, list) else value - old
    return delta


class SpecEngine:
    """A vLLM `LLM` drafting with a GrowMTP head, with record capture and live weight updates."""

    def __init__(self, model: str | Path, head_dir: str | Path, k: int, *, capture: bool = True,
                 topk: int = DEFAULT_TOPK, logprob_dtype: str = "bfloat16", capture_q: bool = False,
                 capture_hidden: bool = False, **llm_kwargs):
        if "speculative_config" in llm_kwargs:
            raise SpecConfigError("pass head_dir and k; SpecEngine builds the speculative_config itself")
        read_head_config(head_dir)  # a clear error for a directory that is not a head, before vLLM starts
        if capture_hidden:  # exact mode records hidden states the engine computes; cache hits skip them
            if llm_kwargs.setdefault("enable_prefix_caching", False):
                raise SpecConfigError("capture_hidden (exact mode) needs enable_prefix_caching=False: prefix-cache "
                                      "hits skip computing the hidden states it records")
        config = speculative_config(head_dir, k)
        check_speculative_config(config)
        # The hooks target the V1 runner; vLLM 0.29 picks runner V2 by default where Triton works (GPU).
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        from vllm import LLM

        self.k, self.capture, self.head_dir = int(k), capture, Path(head_dir)
        self.capture_hidden = capture and capture_hidden
        self.hidden_dtype = getattr(torch, logprob_dtype)
        llm_kwargs.setdefault("disable_log_stats", False)
        self.llm = LLM(model=str(model), speculative_config=config, worker_extension_cls=WORKER_EXTENSION,
                       **llm_kwargs)
        self._head_state: dict[str, torch.Tensor] | None = None
        self._slept_level = 0
        # always configured: in-process engines share the worker module state with earlier engines
        self.llm.collective_rpc("growmtp_configure_capture",
                                args=(capture, topk, logprob_dtype, capture_q, capture_hidden))

    # ---- generation -------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling_params) -> GenerateResult:
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        for p in params:
            check_sampling_params(p, self.capture)
        inputs = [{"prompt_token_ids": list(map(int, ids))} for ids in prompts]
        before = engine_counters(self.llm)
        began = time.perf_counter()
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        wall = time.perf_counter() - began
        counters = _counter_delta(engine_counters(self.llm), before)
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        if not self.capture:
            summary = _summary_from_counters(counters, self.k)
            return GenerateResult(outputs, [None] * len(outputs),
                                  RolloutMetrics(summary, generated, wall, vllm_counters=counters))
        payload = load_blob(self.llm.collective_rpc("growmtp_drain_records")[0])  # TP ranks agree; rank 0
        entries = entries_by_request(payload)
        if counters.get("num_preemptions", 0) > 0 and self.capture_hidden:
            # Measured: after a preemption's recompute some captured hidden rows are off (q still matches the
            # records with recomputed hiddens to 5e-7). Fall back to transport-free records, never wrong ones.
            logger.warning("GrowMTP: %d preemption(s) in this generate; dropping engine-captured hidden states "
                           "(the trainer recomputes them)", counters["num_preemptions"])
            entries = {rid: {k: v for k, v in e.items() if not k.startswith("hidden")} for rid, e in entries.items()}
        records = join_records(outputs, entries, [p.temperature for p in params], self.k, self.hidden_dtype)
        draft_probs = [entries.get(o.request_id, {}).get("q") for o in outputs]
        accepted = torch.cat([r.accepted for r in records]) if records else torch.zeros(0)
        record_bytes = sum(r.nbytes for r in records)
        metrics = RolloutMetrics(acceptance_summary(accepted, self.k), generated, wall, record_bytes, counters)
        return GenerateResult(outputs, records, metrics, draft_probs)

    # ---- weights ------------------------------------------------------------------------------------
    def load_head(self, head: str | Path | dict[str, torch.Tensor]) -> list[str]:
        """Load head weights (a head directory or a core-head state dict) into the running engine."""
        state = load_file(str(Path(head) / HEAD_WEIGHTS)) if isinstance(head, (str, Path)) else head
        state = {name: tensor.detach().to("cpu").contiguous() for name, tensor in state.items()}
        loaded = self.llm.collective_rpc("growmtp_load_head_weights", args=(dump_blob(state),))[0]
        self._head_state = state
        return loaded

    def load_target(self, state: dict[str, torch.Tensor]) -> int:
        """Load HF-named policy weights into the running engine (the drafter shares embed/lm_head)."""
        state = {name: tensor.detach().to("cpu").contiguous() for name, tensor in state.items()}
        return self.llm.collective_rpc("growmtp_load_target_weights", args=(dump_blob(state),))[0]

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


def _summary_from_counters(counters: dict, k: int) -> AcceptanceSummary:
    cycles = int(counters.get("spec_decode_num_drafts", 0))
    accepted = int(counters.get("spec_decode_num_accepted_tokens", 0))
    per_position = counters.get("spec_decode_num_accepted_tokens_per_pos", [0] * k)
    return AcceptanceSummary(cycles=cycles, accepted_tokens=accepted, tau=1.0 + accepted / max(cycles, 1),
                             alpha=[a / max(cycles, 1) for a in per_position])
