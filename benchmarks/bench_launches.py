"""Operators one head update dispatches per cycle, and its CPU time.

On CUDA every operator that computes is one kernel launch (a cuBLAS product may be two), and at a chunk of
1,024 cycles the head update is host-bound: the GPU waits for launches (`docs/gpu.md`). torch's profiler
records the same operators on a CPU, so this counts them here.

What is counted. One head update (`bench_common.head_update`: DCA + VGM, gradients into .grad) runs under
`torch.profiler`; of its `aten::` events, those with no `aten::` event inside them (the leaves: a composite
operator such as `aten::linear` or `aten::logsumexp` counts as the kernels it dispatches, not once) and not in
`NO_KERNEL`: views and metadata (`view`, `transpose`, `slice`, ...), allocations (`empty`, ...), and the
casts and copies that were no-ops (`aten::to` or `contiguous` as a leaf did nothing). Backward operators are
counted as well (they run inside `autograd::engine` events). A `.tolist()` or `int(tensor)` is counted: on
CUDA it is a device-to-host copy and a synchronisation. As CUDA plans it, the trainer's checks of the records
(`reconstruction.check_batch`) are left out: the records stay on the host on a GPU too (a chunk's cycles go to
the device when it is reconstructed), so those operators launch no kernel; everything else that reads the
records on the host is counted.

The plan. Some of the update's work is cut into blocks and groups whose size depends on the device
(`BLOCK_SCORES` of the draft attention, `SOFTMAX_BLOCK` and `GROUP_LOGITS` of the lm_head's scoring):
`ops_per_cycle` counts the update as a CUDA device plans it (its constants, on this CPU), in bf16, the head's
dtype on a GPU; `ops_per_cycle_cpu_plan` as the CPU runs it, in fp32. Elementwise recompute
(`recompute.py`) is decided as at Qwen3-4B's MLP width, where a chunk of 1,024 cycles turns it on. The time
is the CPU's own, fp32, median of --repeats.

Shapes. Qwen3-4B's layout where it sets how the work is cut (32 query / 8 key-value heads, vocabulary
151,936, K = 5, top-64, τ ≈ 3, prompts of 256 tokens) and narrow widths where it only sets the arithmetic
(hidden 256, head_dim 8, MLP 768), so that an update runs in seconds. --responses responses of --tokens
tokens each, 4 x 512 = 2,048 cycles by default: two chunks of 1,024.

Chunks. `ops_per_cycle` is counted at the chunk a GPU runs by default (`reconstruction.CHUNK_CYCLES`,
4,096 cycles, over four times --responses: two full chunks, as at 1,024); `ops_per_cycle_at_1024` at 1,024
(the default before, and still the CPU's) over --responses. Most of an update's operators come per chunk, per
sequence and per draft position, not per cycle: a larger chunk spreads them over more cycles.

Before. `RECORDED_BEFORE` is this script's output on the code before issue 47 (commit 9730da4), run with
that tree first on PYTHONPATH; `--before-tree PATH` measures such a tree again (e.g. `mkdir /tmp/before &&
git archive 9730da4 openrlhf_growmtp | tar -x -C /tmp/before`) and reports it beside the current code. The
JSON compares like with like: `ops_per_cycle_before` at the same chunk as `ops_per_cycle`,
`ops_per_cycle_at_1024_before` at 1,024.

Fused kernels. `--compile` counts and times the update again with plain functions of the head's code
compiled by `torch.compile` (`COMPILED`): the RMSNorms' math (`rms_norm.norm_forward`, `norm_backward`), the
largest part of what is left, then the objective as well (`head_loss_per_cycle_at`, forward and backward):
what fusing them would leave. Their kernels are counted as inductor generates them for this CPU (one per norm
each way here); for a GPU it generates Triton kernels, where a backward's two reductions (over a row, over the
rows) may be two or three: the CPU's count is then the lower end. The head's code compiles nothing itself.

    python -m benchmarks.bench_launches [--responses 4] [--tokens 1536] [--repeats 3] [--before-tree PATH]
                                        [--compile] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.shared.bench_common import head_update, qwen3_4b_config, records_at_tau
from openrlhf_growmtp.core import (
    MTPHead,
    chunk_plan,
    draft_attention,
    head_loss,
    init_random_head_,
    make_head_config,
    recompute,
    reconstruction,
    rms_norm,
    topk_logq,
)
from openrlhf_growmtp.core.families import get_family

K, TOPK, TAU, PROMPT, CHUNK = 5, 64, 3.0, 256, 1024
# a GPU's default chunk (a tree from before one default per device is measured at this tree's: --gpu-chunk)
GPU_CHUNK = getattr(reconstruction, "CHUNK_CYCLES", {}).get("cuda")
NARROW = {"hidden_size": 256, "head_dim": 8, "intermediate_size": 768}  # Qwen3-4B's: 2560, 128, 9728

# Leaf operators that launch no kernel: views and metadata, allocations, and (as leaves) no-op casts.
NO_KERNEL = frozenset(f"aten::{name}" for name in (
    "view", "_unsafe_view", "reshape", "flatten", "unflatten", "as_strided", "t", "transpose", "permute",
    "expand", "expand_as", "slice", "select", "unsqueeze", "squeeze", "narrow", "split", "split_with_sizes",
    "chunk", "unbind", "alias", "detach", "detach_", "lift_fresh", "resolve_conj", "resolve_neg", "view_as",
    "numpy_T", "movedim", "swapaxes", "diagonal", "indices", "values", "_reshape_alias", "unfold",
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_", "set_",
    "to", "contiguous", "type_as", "result_type", "is_nonzero", "size", "stride", "dim", "is_same_size",
    "_has_compatible_shallow_copy_type", "requires_grad_", "retain_grad", "output_nr", "_version",
))

INDUCTOR_KERNEL = "cpp_fused_"  # in the name of each kernel inductor generates for a CPU (`compiled`)

# This script's output (its defaults) on the code before issue 47, commit 9730da4, with that tree first on
# PYTHONPATH (`--before-tree`), the record checks left out of the CUDA plan's count as for the current code.
# The CPU time is this project's CPU machine's (2 cores shared with other jobs): compare it only with a run on
# the same machine, or measure the old tree again beside the new.
RECORDED_BEFORE = {"responses": 4, "tokens": 1536, "chunk_cycles": 4096, "ops_per_cycle": 2.5198974609375,
                   "ops_per_cycle_at_1024": 3.91845703125, "ops_per_cycle_cpu_plan": 27.49755859375,
                   "cpu_update_s": 8.557117106000078}


def make_head() -> tuple[MTPHead, object]:
    config = qwen3_4b_config(1)
    for name, value in NARROW.items():
        setattr(config, name, value)
    head_config = make_head_config(config, get_family("qwen3"))
    torch.manual_seed(0)
    embed = torch.nn.Embedding(config.vocab_size, config.hidden_size)
    lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    lm_head.weight = embed.weight  # tied, as Qwen3-4B's
    torch.nn.init.normal_(embed.weight, std=0.02)
    head = init_random_head_(MTPHead(head_config, embed, lm_head), 0)
    return head, config


@contextlib.contextmanager
def planned_as(device_type: str):
    """The device-dependent block and group sizes of `device_type`, whatever device runs (a constant that
    is one number for every device, as some were before issue 47, is left as it is)."""
    tables = [(draft_attention, "BLOCK_SCORES"), (topk_logq, "SOFTMAX_BLOCK"), (topk_logq, "GROUP_LOGITS")]
    saved = [(module, name, getattr(module, name)) for module, name in tables]
    for module, name, table in saved:
        if isinstance(table, dict):
            setattr(module, name, dict(table, cpu=table[device_type]))
    try:
        yield
    finally:
        for module, name, table in saved:
            setattr(module, name, table)


@contextlib.contextmanager
def recompute_as_at_real_widths():
    """Elementwise recompute (`recompute.py`) decided as at Qwen3-4B's MLP width (on there at a chunk of
    1,024 cycles), not at this benchmark's narrow one."""
    saved = recompute.RECOMPUTE_BYTES
    recompute.RECOMPUTE_BYTES = saved * NARROW["intermediate_size"] // qwen3_4b_config(1).intermediate_size
    try:
        yield
    finally:
        recompute.RECOMPUTE_BYTES = saved


HOST_RANGE = "growmtp: record checks on the host"


@contextlib.contextmanager
def record_checks_marked():
    """The head update's checks of its records in a profiler range of their own (module docstring)."""
    saved = chunk_plan.check_batch

    def marked(*args, **kwargs):
        with torch.profiler.record_function(HOST_RANGE):
            return saved(*args, **kwargs)

    chunk_plan.check_batch = marked
    try:
        yield
    finally:
        chunk_plan.check_batch = saved


def _on_host(event) -> bool:
    while event is not None:
        if event.name == HOST_RANGE:
            return True
        event = event.cpu_parent
    return False


def kernel_ops(events, skip_host: bool) -> Counter:
    """Leaf `aten::` operators that launch a kernel (module docstring), by name; `skip_host`: not those
    under `HOST_RANGE`."""
    counts = Counter()
    for event in events:
        if INDUCTOR_KERNEL in event.name:
            counts[event.name] += 1
            continue
        if not event.name.startswith("aten::") or event.name in NO_KERNEL:
            continue
        if any(child.name.startswith("aten::") for child in event.cpu_children):
            continue
        if skip_host and _on_host(event):
            continue
        counts[event.name] += 1
    return counts


NORMS = [(rms_norm, "norm_forward"), (rms_norm, "norm_backward")]
COMPILED = {"norms": NORMS, "norms_objective": NORMS + [(head_loss, "head_loss_per_cycle_at")]}


@contextlib.contextmanager
def compiled(functions):
    """The (module, name) functions compiled by `torch.compile` (inductor), where the head's code calls them.
    Each generated kernel is a profiler event of its own (`cpp.enable_kernel_profile`)."""
    from torch._inductor import config as inductor_config

    saved = [(module, name, getattr(module, name)) for module, name in functions]
    settings = inductor_config.cpp.enable_kernel_profile, torch._dynamo.config.recompile_limit
    inductor_config.cpp.enable_kernel_profile = True
    torch._dynamo.config.recompile_limit = 64  # one graph per dtype, flags and input strides
    for module, name, function in saved:
        setattr(module, name, torch.compile(function, dynamic=True))
    try:
        yield
    finally:
        for module, name, function in saved:
            setattr(module, name, function)
        inductor_config.cpp.enable_kernel_profile, torch._dynamo.config.recompile_limit = settings


def run_update(head, records, dtype, chunk=CHUNK):
    for module in (head, head.embed_tokens, head.lm_head):  # the backbone's modules are not the head's
        module.to(dtype)
    hiddens = [rec.hidden.to(dtype) for rec in records]
    for p in head.parameters():
        p.grad = None
    return head_update(head, records, hiddens, chunk)


def count(head, records, dtype, device_type, chunk=CHUNK) -> Counter:
    with planned_as(device_type), recompute_as_at_real_widths(), record_checks_marked():
        run_update(head, records, dtype, chunk)  # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run_update(head, records, dtype, chunk)
    return kernel_ops(prof.events(), skip_host=device_type == "cuda")


def cpu_seconds(head, records, repeats: int) -> list[float]:
    """The CPU's own update times (fp32, chunks of 1,024), after a warm-up."""
    seconds = []
    with recompute_as_at_real_widths():
        run_update(head, records, torch.float32)  # warm-up
        for _ in range(repeats):
            t0 = time.perf_counter()
            run_update(head, records, torch.float32)
            seconds.append(time.perf_counter() - t0)
    return seconds


def measure(args) -> dict:
    torch.manual_seed(0)
    head, config = make_head()

    def responses(n: int) -> list:
        return [records_at_tau(args.tokens, PROMPT, TAU, K, TOPK, config.vocab_size, config.hidden_size, seed=i)
                for i in range(n)]

    records = responses(args.responses)
    cycles = sum(rec.num_cycles for rec in records)
    cuda_plan = count(head, records, torch.bfloat16, "cuda")
    cpu_plan = count(head, records, torch.float32, "cpu")
    seconds = cpu_seconds(head, records, args.repeats)
    fused = {}
    if args.compile:
        fused = {"ops_per_cycle_at_1024_compiled": {}, "cpu_update_s_compiled": {}}
        for variant, functions in COMPILED.items():
            with compiled(functions):
                ops = sum(count(head, records, torch.bfloat16, "cuda").values())
                fused["ops_per_cycle_at_1024_compiled"][variant] = ops / cycles
                fused["cpu_update_s_compiled"][variant] = statistics.median(cpu_seconds(head, records, args.repeats))
    # at the GPU's default chunk: as many responses per chunk as at 1,024 (two chunks' worth)
    gpu_records = responses(args.responses * args.gpu_chunk // CHUNK)
    gpu_cycles = sum(rec.num_cycles for rec in gpu_records)
    gpu_plan = count(head, gpu_records, torch.bfloat16, "cuda", args.gpu_chunk)
    del gpu_records
    tau = 1.0 + float(torch.cat([rec.accepted for rec in records]).float().mean())
    return {"cycles": cycles, "chunk_cycles": args.gpu_chunk, "tau": tau, "k": K, "topk": TOPK,
            "responses": args.responses, "tokens": args.tokens, "ops_per_cycle": sum(gpu_plan.values()) / gpu_cycles,
            "ops": sum(gpu_plan.values()), "cycles_at_chunk": gpu_cycles,
            "ops_at_1024": sum(cuda_plan.values()), "ops_per_cycle_at_1024": sum(cuda_plan.values()) / cycles,
            "ops_cpu_plan": sum(cpu_plan.values()), "ops_per_cycle_cpu_plan": sum(cpu_plan.values()) / cycles,
            "cpu_update_s": statistics.median(seconds), "cpu_update_s_repeats": seconds,
            "top_ops": dict(gpu_plan.most_common(args.top)), **fused}


def measure_tree(tree: str, argv: list[str]) -> dict:
    """This script's measurement on another checkout of the package (its tree first on PYTHONPATH, then this
    checkout's root for the benchmarks' own modules; the script itself run by its path)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, here, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, __file__, *argv, "--json", "--no-before"], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--responses", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1536, help="response length (512 cycles at τ = 3)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--top", type=int, default=12, help="operators listed by count")
    parser.add_argument("--before-tree", help="a checkout of the code before, measured again instead of recorded")
    parser.add_argument("--no-before", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--gpu-chunk", type=int, default=GPU_CHUNK, help=argparse.SUPPRESS)
    parser.add_argument("--compile", action="store_true",
                        help="also count and time the update with the norms, then the objective, compiled")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    now = measure(args)
    import openrlhf_growmtp
    now["package"] = os.path.dirname(openrlhf_growmtp.__file__)
    before = None
    if args.before_tree:
        before = measure_tree(args.before_tree, [f"--responses={args.responses}", f"--tokens={args.tokens}",
                                                 f"--repeats={args.repeats}", f"--top={args.top}",
                                                 f"--gpu-chunk={args.gpu_chunk}"])
        before["source"] = f"measured: {args.before_tree}"
    elif not args.no_before and (args.responses, args.tokens, args.gpu_chunk) == (
            RECORDED_BEFORE["responses"], RECORDED_BEFORE["tokens"], RECORDED_BEFORE["chunk_cycles"]):
        before = dict(RECORDED_BEFORE, source="recorded at 9730da4")  # recorded at these settings only

    print(f"head update, {now['responses']} responses of {now['tokens']} tokens, {now['cycles']} cycles "
          f"(τ={now['tau']:.2f}, K={K}, top-{TOPK}); package {now['package']}")
    print(f"  operators dispatched at the GPU's default chunk of {args.gpu_chunk} cycles, as CUDA plans them (bf16, "
          f"{now['cycles_at_chunk']} cycles): {now['ops']:7d} = {now['ops_per_cycle']:.2f} per cycle")
    print(f"  at chunks of {CHUNK} cycles, as CUDA plans them (bf16): {now['ops_at_1024']:7d} = "
          f"{now['ops_per_cycle_at_1024']:.2f} per cycle")
    print(f"  at chunks of {CHUNK} cycles, as the CPU runs them (fp32): {now['ops_cpu_plan']:7d} = "
          f"{now['ops_per_cycle_cpu_plan']:.2f} per cycle")
    print(f"  CPU update time (fp32, chunks of {CHUNK}, median of {args.repeats}): {now['cpu_update_s']:.2f} s")
    for variant, ops in now.get("ops_per_cycle_at_1024_compiled", {}).items():
        print(f"  compiled by torch.compile, {variant.replace('_', ' + ')} (inductor's kernels for this CPU): "
              f"{ops:.2f} per cycle at {CHUNK} (CUDA plan), CPU update {now['cpu_update_s_compiled'][variant]:.2f} s")
    if before:
        print(f"  before ({before['source']}): at {args.gpu_chunk} {before['ops_per_cycle']:.2f} per cycle; at "
              f"{CHUNK} {before['ops_per_cycle_at_1024']:.2f} (CUDA plan), {before['ops_per_cycle_cpu_plan']:.2f} "
              f"(CPU plan), CPU update {before['cpu_update_s']:.2f} s")
    print(f"  most dispatched (CUDA plan, chunk {args.gpu_chunk}): " +
          ", ".join(f"{k[6:]} {v}" for k, v in now["top_ops"].items()))
    if args.json:
        row = dict(now)
        if before:
            row |= {"ops_per_cycle_before": before["ops_per_cycle"],
                    "ops_per_cycle_at_1024_before": before["ops_per_cycle_at_1024"],
                    "ops_per_cycle_cpu_plan_before": before["ops_per_cycle_cpu_plan"],
                    "cpu_update_s_before": before["cpu_update_s"], "before_source": before["source"]}
        print(json.dumps(row))


if __name__ == "__main__":
    main()
