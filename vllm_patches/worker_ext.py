"""The worker extension: OpenRLHF's `WorkerWrap` (so its weight sync keeps working) plus GrowMTP's calls.

Passed as `worker_extension_cls="vllm_patches.worker_ext.GrowMTPWorkerExtension"`; every method is
reachable through `LLM.collective_rpc(name, args=...)`. Tensors travel as `transport` blobs; the capture
config travels as `CaptureConfig.as_dict()`.
"""

from __future__ import annotations

import torch
from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap

from openrlhf_growmtp import device_memory

from . import head_model, plugin
from .capture import core as capture
from .capture.v1 import hooks_active
from .settings import ASYNC_SCHEDULING, RUNNER_ENV, RUNNER_ENV_VALUE, CaptureConfig, SpecConfigError
from .transport import load_blob

plugin.register()  # the entry point normally did this already; idempotent

RECORDING_RANK = 0  # the rank whose captured cycles become records (collective_rpc returns rank order)


class GrowMTPWorkerExtension(WorkerWrap):
    def growmtp_configure_capture(self, config: dict) -> str:
        """Switch record capture per `CaptureConfig.as_dict()`; raise if this worker's runner bypasses the hooks
        or its engine schedules asynchronously (see settings.ASYNC_SCHEDULING)."""
        config = CaptureConfig.from_dict(config)
        runner = self.model_runner
        if config.enabled and bool(self.vllm_config.scheduler_config.async_scheduling) is not ASYNC_SCHEDULING:
            raise SpecConfigError("this engine schedules asynchronously, which records a cycle after a request's "
                                  "end; build it with async_scheduling=False (settings.spec_engine_kwargs does)")
        if config.enabled and not hooks_active(runner):
            raise RuntimeError(
                f"GrowMTP record capture hooks vLLM's V1 model runner, but this worker runs "
                f"{type(runner).__module__}.{type(runner).__qualname__}. Set {RUNNER_ENV}={RUNNER_ENV_VALUE} "
                "(settings.spec_engine_kwargs does) before the engine starts.")
        # Every tensor-parallel rank verifies the same drafts; rank 0's cycles are the records (the driver
        # reads its payload), so the other ranks capture nothing and ship empty payloads.
        capture.configure(config if self.rank == RECORDING_RANK else CaptureConfig(enabled=False))
        return type(runner).__qualname__

    def growmtp_drain_records(self, as_blob: bool = True) -> bytes | dict:
        """The capture payload (`capture.drain`); as_blob=False returns the dict itself, for a caller in this
        process (an in-process executor hands results over without serialising them)."""
        return capture.drain(as_blob)

    def growmtp_load_head_weights(self, blob: bytes) -> list[str]:
        """Load core-head-named weights into the live draft head (vLLM's layerwise reload protocol); returns the
        names loaded. Weights that would not fill the whole head exactly are refused before any is loaded
        (`head_model.load_problems`): a head part left out would keep drafting with its old value.

        The CPU backend repacks weights after loading (the original parameters are left empty), so a
        plain `load_weights` would not reach the kernels; the reload protocol re-runs that processing.
        """
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        weights = load_blob(blob)
        model = self.model_runner.get_draft_model()
        if problems := head_model.load_problems(model, weights):
            more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
            raise KeyError(f"GrowMTP head weights refused by rank {self.rank}, the live head unchanged: "
                           + "; ".join(problems[:8]) + more)
        initialize_layerwise_reload(model)
        model.load_weights(iter(weights.items()))
        finalize_layerwise_reload(model, self.vllm_config.speculative_config.draft_model_config)
        return sorted(name for name in weights if not head_model.is_shared(name))

    def growmtp_load_target_weights(self, blob: bytes) -> int:
        """Load HF-named policy weights into the live target model (vLLM's layerwise reload, which re-runs the
        CPU backend's weight packing), and re-tie a tied lm_head to the new embedding."""
        weights = load_blob(blob)
        self.model_runner.reload_weights(weights_iterator=iter(weights.items()))
        _retie_lm_head(self.model_runner.get_model())
        draft = self.model_runner.get_draft_model()
        if isinstance(draft, head_model.GrowMTPHeadModel):  # its draft vocabulary's rows are the old target's
            draft.refresh_draft_vocab()
        return len(weights)

    def growmtp_set_draft_vocab(self, ids: list[int] | None, tag: str | None) -> None:
        """Draft over `ids` only from the next step on (None: every id); the records of its cycles carry `tag`
        (`openrlhf_growmtp.core.draft_vocab`). Set between generates, after the target's weights are in."""
        draft = self.model_runner.get_draft_model()
        if not isinstance(draft, head_model.GrowMTPHeadModel):
            raise ValueError(f"a draft vocabulary needs a GrowMTP head drafting, not {type(draft).__name__}")
        draft.set_draft_vocab(None if ids is None else torch.tensor(ids), tag)

    def growmtp_head_sync_diff(self, blob: bytes) -> dict:
        """How far this rank's live head is from `blob`'s core-head weights (the trainer's).

        The expected value of each readable head parameter is what vLLM's own loaders make of those weights
        on this rank: its tensor-parallel shard, q/k/v and gate/up fused. The loaders write into scratch
        tensors swapped in for this call, so the live tensors are never written. On CPU, vLLM repacks Linear
        weights after loading and leaves the original parameters empty: those are not readable (`params`
        counts what was compared; the repacked ones are covered by tests comparing the engine's q).
        """
        model = self.model_runner.get_draft_model()
        readable = {name: p for name, p in model.named_parameters()
                    if p.numel() > 0 and not head_model.is_shared(name)}
        weights = [(name, tensor) for name, tensor in load_blob(blob).items()
                   if (target := head_model.vllm_parameter(name)) is not None and target[0] in readable]
        live = {name: p.data for name, p in readable.items()}
        try:
            for p in readable.values():
                p.data = torch.empty_like(p.data)
            loaded = model.load_weights(iter(weights))
            expected = {name: p.data for name, p in readable.items()}
        finally:
            for name, p in readable.items():
                p.data = live[name]
        if missing := sorted(set(readable) - loaded):
            raise KeyError(f"live head parameters {missing} have no weight in the state they are compared with")
        worst = max((float((live[n].float() - expected[n].float()).abs().max()) for n in readable), default=0.0)
        return {"rank": self.rank, "max_diff": worst, "params": len(readable)}

    def growmtp_memory(self) -> dict:
        """This rank's device memory (`openrlhf_growmtp.device_memory.reading`): peak allocated, in use, total."""
        return {"rank": self.rank, **device_memory.reading()}


def _retie_lm_head(model) -> None:
    """A tied model's lm_head after a reload: share the reloaded embedding again and re-run its processing.

    The model's `load_weights` skips `lm_head.weight` when the embeddings are tied, so the layerwise reload
    sees nothing loaded for the lm_head and puts its old tensor back without processing it again
    (reload/layerwise.py, finalize_layerwise_processing). On CPU the logits then keep multiplying by the
    packed copy of the old embedding (`layer.cpu_linear`, layers/utils.py dispatch_cpu_unquantized_gemm):
    verification and drafting would score tokens with the previous policy's output embedding.
    """
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if not getattr(config, "tie_word_embeddings", False):
        return
    lm_head = model.lm_head.tie_weights(model.model.embed_tokens)
    lm_head.quant_method.process_weights_after_loading(lm_head)
