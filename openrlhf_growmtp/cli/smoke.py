"""`python -m openrlhf_growmtp.cli.smoke`: the two halves of `GROWMTP_SMOKE=1` (examples/scripts/common.sh).

    smoke paths -- LAUNCHER FLAGS...    before the run: the paths of a GrowMTP run that have never run on a GPU,
                                        whether this command takes each, and the fallback for each
    smoke verdict CKPT_PATH --steps N --k K [--frozen]
                                        after the run: read <CKPT_PATH>/growmtp_metrics.jsonl and print the
                                        verdict; exit 1 on any failed check

The verdict's checks, every logged step (K > 0): records were checked against vLLM's own per-request counters
(every record, none without; a record that differs stops the run, so a finished run has none), the engines'
head equals the trainer's after the sync (`--growmtp_check_sync`: max difference 0 over a nonzero count), τ
finite within 1..K+1, the head loss finite and its update not skipped. Every run: the steps 1..N logged, the
memory per device (trainer and engines) and the seconds per phase, printed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

METRICS_FILE = "growmtp_metrics.jsonl"  # trainer/ppo_trainer.METRICS_FILE (not imported: no Ray, no openrlhf)
# seconds per phase: metric -> what it times. `timing/*` are upstream's; make_experience + ppo_train + broadcast
# is the training step (growmtp/train_step_s), of which the head update is part of ppo_train.
PHASES = (("growmtp/rollout_s", "rollout (vLLM generate)"),
          ("timing/make_experience", "experience (rewards, reference, advantages)"),
          ("timing/ppo_train", "policy (and head) training"),
          ("growmtp/head_update_s", "  of which the head update"),
          ("timing/broadcast", "weight sync to the engines"),
          ("growmtp/step_s", "the whole RL step"))
MEMORY = (("growmtp/mem_trainer_peak_gib", "trainer, peak allocated by the policy's process"),
          ("growmtp/mem_trainer_used_gib", "trainer, device in use (every process on it)"),
          ("growmtp/mem_engine_peak_gib", "engine, peak allocated by vLLM's worker"),
          ("growmtp/mem_engine_used_gib", "engine, device in use (every process on it)"))


@dataclass(frozen=True)
class UntriedPath:
    """A path of a GrowMTP run that no GPU has run yet, the fallback that avoids it and what the fallback costs."""

    name: str
    taken: bool
    fallback: str
    cost: str


def installed_torch() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return None


def untried_paths(argv: list[str], torch_version: str | None = None) -> list[UntriedPath]:
    """The untried paths of the launcher command `argv` (its flags; the last occurrence of a flag counts), with
    the torch it runs on (default: the installed one)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--growmtp_k", "--growmtp.k", dest="k", type=int, default=0)
    parser.add_argument("--growmtp_mode", "--growmtp.mode", dest="mode", default="detached")
    parser.add_argument("--vllm.runner", dest="runner", default=None)
    parser.add_argument("--vllm.sync_backend", dest="sync", default="nccl")
    parser.add_argument("--vllm.enforce_eager", dest="eager", action="store_true")
    parser.add_argument("--vllm.tensor_parallel_size", dest="tp", type=int, default=1)
    parser.add_argument("--vllm.enable_sleep", dest="sleep", action="store_true")
    parser.add_argument("--ds.attn_implementation", dest="attn", default="flash_attention_2")  # upstream's default
    parser.add_argument("--ds.packing_samples", dest="packing", action="store_true")
    parser.add_argument("--ds.adam_offload", dest="offload", action="store_true")
    parser.add_argument("--train.full_determinism_enable", dest="strict", action="store_true")
    parser.add_argument("--actor.num_nodes", dest="actor_nodes", type=int, default=1)
    parser.add_argument("--ref.num_nodes", dest="ref_nodes", type=int, default=1)
    a, _ = parser.parse_known_args(argv)
    torch_version = installed_torch() if torch_version is None else torch_version
    v1 = a.k > 0 or a.runner == "growmtp"
    trains_head = a.k > 0 and a.mode != "frozen"
    unmeasured = "not measured on a GPU"
    return [
        UntriedPath("vLLM's V1 model runner, forced (record capture hooks it)", v1,
                    "none for K > 0; a K = 0 run on vLLM's default runner (no --vllm.runner growmtp) avoids it",
                    f"no head at all; the runner's own cost is {unmeasured} (the two baselines measure it)"),
        UntriedPath("synchronous scheduling (records need it)", v1,
                    "none for K > 0; a K = 0 run on vLLM's defaults schedules asynchronously",
                    f"no head at all; what synchronous scheduling costs is {unmeasured}"),
        UntriedPath("the policy's NCCL weight sync with the head hidden from it", a.k > 0 and a.sync == "nccl",
                    "--vllm.sync_backend ray: the policy's weights through Ray's object store, as every CPU run sends "
                    "them (tested on CPU only)",
                    f"a full bf16 copy of the policy in host memory on the first rank; the sync's time {unmeasured}"),
        UntriedPath("CUDA graphs with record capture", a.k > 0 and not a.eager,
                    "--vllm.enforce_eager (the capture hooks unchanged)",
                    f"slower decoding without CUDA graphs, by how much in vLLM {unmeasured}"),
        UntriedPath("tensor-parallel engines over Ray", a.tp > 1,
                    "--vllm.tensor_parallel_size 1 (VLLM_TP=1; a CPU run's TP engines use vLLM's multiprocess "
                    "executor, not Ray's)",
                    "each engine's model and KV cache on one GPU (every preset's model fits one)"),
        UntriedPath("vLLM's sleep mode", a.sleep, "leave --vllm.enable_sleep off (the example scripts do)",
                    "the engines keep their GPU memory while the policy trains (the scripts give them their own GPUs)"),
        UntriedPath("flash_attention_2 in the trainer (every GPU check ran sdpa, and a pure-torch stand-in of "
                    "flash_attn's padding helpers)", a.attn.startswith("flash_attention") or a.packing,
                    "--ds.attn_implementation sdpa, without --ds.packing_samples (upstream sets flash_attention_2 "
                    "whenever it packs)",
                    "no sample packing: padded micro-batches; speed and memory against flash_attention_2 "
                    f"{unmeasured}"),
        UntriedPath("DeepSpeed's FusedAdam with the head's parameter group (every GPU check stepped torch's Adam)",
                    trains_head and not a.offload,
                    "none tested: --ds.adam_offload swaps in DeepSpeed's CPU Adam, which has not stepped the head's "
                    "group either (CPU runs step torch's AdamW); not with --growmtp_mode joint; the GPU check's "
                    "--fused-adam-s builds and steps the fused one on a card",
                    "with --ds.adam_offload: Adam's state in host memory and its step on the CPU, slower by an amount "
                    f"{unmeasured}"),
        UntriedPath("torch 2.13 on CUDA (the GPU checks ran torch 2.11)",
                    (torch_version or "").startswith("2.13"),
                    "none within the pins (vLLM 0.29.0's wheel pins torch 2.13.0): `make gpu-check` (step 2 of "
                    "docs/guide.md) runs the head's math and the trainer's step on it before any run",
                    "the check's budget: 480 s of one GPU by default"),
        UntriedPath("more than one node", a.actor_nodes > 1 or a.ref_nodes > 1,
                    "ACTOR_NODES=1 and as many engines as the node has GPUs left (Ray places engines on any node "
                    "with free GPUs, so with more engines than that they land on other nodes)",
                    "one node's GPUs: fewer training ranks or engines, longer steps"),
        UntriedPath("the production trainer step with the head (without strict determinism; on an H200 it hit a "
                    "CUDA device-side assert at 18 layers, not yet explained)", trains_head and not a.strict,
                    "--train.full_determinism_enable: upstream's strict mode, the trainer step the GPU check ran "
                    "with the head (13 and 27 layers)",
                    "that strict step ran 4.5x the plain forward and backward per token (13 layers, H100; "
                    "docs/gpu_results.md)"),
    ]


def describe_paths(argv: list[str], on_gpu: bool) -> str:
    lines = ["Paths of this run that have never run on a GPU (the fallback for each, and its cost):"]
    for path in untried_paths(argv):
        lines.append(f"  [{'taken' if path.taken else 'not taken'}] {path.name}\n      fallback: {path.fallback}"
                     f"\n      its cost: {path.cost}")
    if not on_gpu:
        lines.append("  (this smoke run is on the CPU, with vLLM's CPU build: none of them runs here)")
    return "\n".join(lines)


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str


def read_rows(ckpt_path: str | Path) -> list[dict]:
    path = Path(ckpt_path) / METRICS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def checks(rows: list[dict], steps: int, k: int, trains_head: bool) -> list[Check]:
    """The verdict's checks over the logged rows (module docstring)."""
    logged = [int(row["step"]) for row in rows]
    out = [Check("RL steps logged", logged == list(range(1, steps + 1)), f"{logged}, expected 1..{steps}")]

    def every(name: str, ok, detail) -> None:
        bad = [int(row["step"]) for row in rows if not ok(row)]
        out.append(Check(name, bool(rows) and not bad, f"{detail}; failed at steps {bad}" if bad else detail))

    if k:
        every("records equal vLLM's own counters", lambda r: r.get("growmtp/records", 0) > 0
              and r.get("growmtp/records_checked") == r.get("growmtp/records"),
                    "records checked / records per step: " + ", ".join(
                  f"{r.get('growmtp/records_checked', 0):.0f}/{r.get('growmtp/records', 0):.0f}" for r in rows))
        every("tau finite, within 1..K+1", lambda r: _finite(r.get("growmtp/tau")) and 1 <= r["growmtp/tau"] <= k + 1,
                    "tau per step: " + ", ".join(f"{r.get('growmtp/tau', math.nan):.3f}" for r in rows))
    if k and trains_head:
        every("the engines' head equals the trainer's after the sync",
              lambda r: r.get("growmtp/head_sync_max_diff") == 0 and r.get("growmtp/head_sync_params", 0) > 0,
                    "max difference / parameters compared per step: " + ", ".join(
                  f"{r.get('growmtp/head_sync_max_diff', math.nan):g}/{r.get('growmtp/head_sync_params', 0):.0f}"
                  for r in rows))
        every("head loss finite, the head update never skipped",
              lambda r: _finite(r.get("growmtp/head_loss")) and r.get("growmtp/head_finite") == 1,
                    "head loss per step: " + ", ".join(f"{r.get('growmtp/head_loss', math.nan):.4f}" for r in rows))
    every("memory per device logged", lambda r: all(_finite(r.get(key)) for key, _ in MEMORY),
          "trainer and engine, peak and in use")
    every("seconds per phase logged", lambda r: all(_finite(r.get(key)) for key, _ in PHASES
                                                     if k and trains_head or key != "growmtp/head_update_s"),
          "rollout, experience, training, sync")
    return out


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def summary(rows: list[dict]) -> str:
    """Memory per device (the most over the steps) and seconds per phase (per step, and their mean after the
    first step, whose times include warm-up)."""
    lines = ["memory per device, GiB (the most over the steps):"]
    total = max((r.get("growmtp/mem_engine_total_gib", 0.0) for r in rows), default=0.0)
    for key, what in MEMORY:
        values = [r[key] for r in rows if _finite(r.get(key))]
        if values:
            share = f" ({max(values) / total:.0%} of the device's {total:.1f})" if total else ""
            lines.append(f"  {max(values):8.2f}  {what}{share}")
    if not total:
        lines.append("  (no CUDA: the process's resident host memory stands in for the device's)")
    lines.append("seconds per phase: per step; mean of steps 2.. (step 1 includes warm-up)")
    for key, what in PHASES:
        values = [r[key] for r in rows if _finite(r.get(key))]
        if values:
            later = values[1:] or values
            per_step = " ".join(f"{v:.2f}" for v in values)
            lines.append(f"  {sum(later) / len(later):8.2f}  {what}  [{per_step}]")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="smoke", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    paths = commands.add_parser("paths")
    paths.add_argument("--cpu", action="store_true", help="the smoke run is on the CPU")
    paths.add_argument("flags", nargs=argparse.REMAINDER)
    verdict = commands.add_parser("verdict")
    verdict.add_argument("ckpt_path")
    verdict.add_argument("--steps", type=int, required=True)
    verdict.add_argument("--k", type=int, required=True)
    verdict.add_argument("--frozen", action="store_true", help="the head is never updated")
    args = parser.parse_args(argv)
    if args.command == "paths":
        print(describe_paths([f for f in args.flags if f != "--"], on_gpu=not args.cpu))
        return 0
    rows = read_rows(args.ckpt_path)
    results = checks(rows, args.steps, args.k, trains_head=not args.frozen)
    print(summary(rows))
    print("verdict:")
    for check in results:
        print(f"  [{'PASS' if check.passed else 'FAIL'}] {check.name}: {check.detail}")
    passed = all(check.passed for check in results)
    print(f"SMOKE {'PASSED' if passed else 'FAILED'}: {sum(c.passed for c in results)} of {len(results)} checks")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
