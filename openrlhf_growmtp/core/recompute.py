"""Elementwise work recomputed in backward, so that the head update keeps only matrix products' outputs.

At a real model's width most of what the head keeps for backward is elementwise: the gated MLP keeps its
activation and its product next to the two projections' outputs ([slots, 9728] each at Qwen3-4B).
`elementwise_recomputed` wraps, for its duration, the MLP in selective checkpointing that keeps the matrix
products' outputs and recomputes the rest. The backward then redoes elementwise work only: no matrix
product runs twice. (The head's RMSNorms keep only their input and its reciprocal RMS by themselves:
`rms_norm.py`.)

It pays where a chunk's activations are large (`benchmarks/bench_reconstruction.py` measures the peak
memory of a chunk of Qwen3-4B's head with it); for small heads its per-call cost dominates, so
`worth_recomputing` turns it on from `RECOMPUTE_BYTES` of MLP activations per chunk, decided from the
configuration only (under ZeRO-3 the recompute calls the MLP's projections again, which gathers their
weights: every rank must do it alike). The wrapped call still goes through the module's own __call__
(its hooks, e.g. ZeRO-3's parameter gathers, run as before); the recompute runs inside that module's
backward.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .head import MTPHead

# From this many bytes of one MLP activation over a chunk's slots ([slots, intermediate] in the head's
# dtype) on. Qwen3-4B's head at 1,024 cycles is above it: 1024 x K=5 x 9728 x 2 bytes = 100 MB.
RECOMPUTE_BYTES = 2**26

_MATRIX_PRODUCTS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


def _keep_matrix_products(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _MATRIX_PRODUCTS else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed(forward):
    context = functools.partial(create_selective_checkpoint_contexts, _keep_matrix_products)

    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context, **kwargs)

    return run


def worth_recomputing(head: MTPHead, max_slots: int | None) -> bool:
    """Whether chunks of at most `max_slots` slots (None: unbounded) recompute elementwise work."""
    itemsize = next(head.parameters()).element_size()
    return max_slots is None or max_slots * head.config.intermediate_size * itemsize >= RECOMPUTE_BYTES


@contextlib.contextmanager
def elementwise_recomputed(head: MTPHead):
    """Within: the head's MLP keeps for backward only its input and its matrix products' outputs."""
    mlp = head.decoder_layer.mlp
    if "forward" in mlp.__dict__:
        raise RuntimeError(f"{type(mlp).__name__} already has an instance forward; not wrapping it twice")
    mlp.forward = _checkpointed(mlp.forward)
    try:
        yield
    finally:
        del mlp.forward
