"""The worker extension: OpenRLHF's `WorkerWrap` (so its weight sync keeps working) plus GrowMTP's calls.

Passed as `worker_extension_cls="vllm_patches.worker_ext.GrowMTPWorkerExtension"`; every method is
reachable through `LLM.collective_rpc(name, args=...)`. Tensors travel as `transport` blobs; the capture
config travels as `CaptureConfig.as_dict()`.
"""

from __future__ import annotations

from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap

from . import capture, plugin
from .settings import ASYNC_SCHEDULING, RUNNER_ENV, RUNNER_ENV_VALUE, CaptureConfig, SpecConfigError
from .transport import dump_blob, load_blob

plugin.register()  # the entry point normally did this already; idempotent


class GrowMTPWorkerExtension(WorkerWrap):
    def growmtp_configure_capture(self, config: dict) -> str:
        """Switch record capture per `CaptureConfig.as_dict()`; raise if this worker's runner bypasses the hooks
        or its engine schedules asynchronously (see settings.ASYNC_SCHEDULING)."""
        config = CaptureConfig.from_dict(config)
        runner = self.model_runner
        if config.enabled and bool(self.vllm_config.scheduler_config.async_scheduling) is not ASYNC_SCHEDULING:
            raise SpecConfigError("this engine schedules asynchronously, which records a cycle after a request's "
                                  "end; build it with async_scheduling=False (settings.spec_engine_kwargs does)")
        if config.enabled and not capture.hooks_active(runner):
            raise RuntimeError(
                f"GrowMTP record capture hooks vLLM's V1 model runner, but this worker runs "
                f"{type(runner).__module__}.{type(runner).__qualname__}. Set {RUNNER_ENV}={RUNNER_ENV_VALUE} "
                "(settings.spec_engine_kwargs does) before the engine starts.")
        capture.configure(config)
        return type(runner).__qualname__

    def growmtp_drain_records(self) -> bytes:
        return capture.drain()

    def growmtp_load_head_weights(self, blob: bytes) -> list[str]:
        """Load core-head-named weights into the live draft head (vLLM's layerwise reload protocol).

        The CPU backend repacks weights after loading (the original parameters are left empty), so a
        plain `load_weights` would not reach the kernels; the reload protocol re-runs that processing.
        """
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        weights = load_blob(blob)
        model = self.model_runner.get_draft_model()
        initialize_layerwise_reload(model)
        loaded = model.load_weights(iter(weights.items()))
        finalize_layerwise_reload(model, self.vllm_config.speculative_config.draft_model_config)
        return sorted(loaded)

    def growmtp_load_target_weights(self, blob: bytes) -> int:
        """Load HF-named policy weights into the live target model (vLLM's layerwise reload, which re-runs the
        CPU backend's weight packing), and re-tie a tied lm_head to the new embedding."""
        weights = load_blob(blob)
        self.model_runner.reload_weights(weights_iterator=iter(weights.items()))
        _retie_lm_head(self.model_runner.get_model())
        return len(weights)

    def growmtp_head_state(self) -> bytes:
        """The live draft head's parameters that are readable, under core-head names, as a blob.

        On CPU, vLLM repacks Linear weights into its GEMM backend after loading and leaves the original
        parameters empty; those are skipped (the names list says which were compared).
        """
        model = self.model_runner.get_draft_model()
        state = {name.removeprefix("model."): p.detach().cpu().clone() for name, p in model.named_parameters()
                 if p.numel() > 0 and not any(part in name for part in ("embed_tokens", "lm_head"))}
        return dump_blob(state)


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
