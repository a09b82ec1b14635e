"""Check `trainer_step` of the GPU check: the RL step's training side on one device, with no Ray and no vLLM
(`gpu_standins` answers for their names), each DeepSpeed run in a process of its own (`gpu_trainer_run.py`).

1. A policy at Qwen3-4B's widths, at the first of the depths asked (`--trainer-layers`; by default as many
   layers as the device's memory holds under ZeRO-3, `layers_that_fit`), and a random K = 5 head bound to
   it, both bf16.
2. The reference drafter (`gpu_drafter.py`, the rollout loop with a record tap) rolls out
   `trainer_responses` responses with that head on the device, its tau set to the paper's 2.91
   (`gpu_loop.calibrate`, CALIB_CYCLES cycles per probe); its records are validated as the trainer validates
   them. The sequences, records, policy and head are saved under a work directory and leave the device. A further
   depth trains on the same sequences and records, from a policy of its own depth (random, seeded) whose
   log-probs of them are its old policy's (the drafter runs once: it takes most of the check's time).
3. At each depth, each run in a process of its own, from the same saved policy and the same experience (the
   drafted sequences, their log-probs, random advantages), `trainer_steps` RL steps, the last one timed:
   - production (`--trainer-runs production`), as every example script trains: our strategy
     (`get_strategy`: the head in its own parameter group) and `GrowMTPActorTrainer.ppo_train` with the head
     (detached, the paper's schedule), then upstream's DeepSpeed strategy (ZeRO-3, bf16) and
     `ActorPPOTrainer` without it; then the policy's plain forward + backward over the same sequences
     (`bench_common.policy_step`, micro-batches of `micro_batch`, gradient checkpointing on as in the step;
     no optimizer), for the steps' cost per token;
   - strict (`--trainer-runs strict`): the same two steps under torch's deterministic algorithms, strict
     (upstream's `--train.full_determinism_enable`; an operator without a deterministic implementation
     raises), so that nothing but the head could make the policies differ. Should they differ all the
     same, upstream runs a third time, and how far it lands from itself is reported beside.
It shows:
- no run started with memory an earlier one held (`clean_starts`);
- strict: the policy's parameters after the steps bit-identical with and without the head;
- every run with the head: the head moved (every weight matrix differs from where it started);
- the head's share of the step (the step's `growmtp/head_update_s` over the step with it), the step with the
  head over the step without, each per token beside the plain forward + backward, and each run's peak memory.
Every run ends with a verdict, or says why it has none. A run that fails leaves its first traceback in its
JSON and its log (beside the check's JSON, `<json>_trainer_runs/`); the other runs still run.
`--launch-blocking-layers` runs the depths named with CUDA_LAUNCH_BLOCKING=1: a kernel's error is reported at
the call that launched it (slower: those times are not a timing).
DeepSpeed's optimizer is DeepSpeed's fused Adam where `gpu_fused_adam` built it on the device in time, else
torch's AdamW (`torch_adam`; the same update); each run's JSON names the one that ran.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.gpu_check.gpu_fused_adam import FusedAdamBuild, no_build
from benchmarks.gpu_check.gpu_loop import calibrate
from benchmarks.gpu_check.gpu_drafter import Rollouts, draft_rollouts, drafting_loop
from benchmarks.gpu_check.gpu_report import Row
from benchmarks.gpu_check.gpu_sampler import Z_LIMIT  # the drafter's first acceptance, held as check (d) holds its own
from benchmarks.gpu_check.gpu_trainer_run import held
from benchmarks.gpu_check.gpu_world import build_head, flatten_policy_logits_
from growmtp_lab.reference_drafting import acceptance_z

# the drafter's tau bisection: 7 probes of 16 cycles of every response (8 at Qwen3-4B's plan: 128 cycles, the
# measured tau's standard error ~ sqrt(2.5 / 128) = 0.14 at tau 2.91), a few percent of the drafter's cycles
CALIB_CYCLES, CALIB_PROBES = 16, 7
RUN_ARGS = ["-m", "benchmarks.gpu_check.gpu_trainer_run"]  # a run's process: `python -m` from the repository's root
# Bytes per parameter (the policy's and the head's) at the peak of one run's step, measured on a run that
# started clean: on an H100 (2026-11-27, docs/data/gpu/trainer_step_head_update_graph_cycle_cost_2026-11-27.json)
# upstream's step at 13 layers (1.70B parameters) started with 416 MiB allocated and peaked at 36,480 MiB:
# 22.2 bytes per parameter of its own (ours with the head, 1.82B, rose by 21.8). ZeRO-3 in bf16 holds 20 of
# them (bf16 weight and gradient, fp32 master, momentum, variance and gradient partition); the rest is a
# micro-batch's activations and fp32 logits and torch AdamW's temporary at the step, parts that do not grow
# with the depth, so the figure read at 13 layers errs high at deeper ones. (The 37 this replaced was read
# off a run that started with 26 GB of the run before it still held: every run now has a process of its own.)
PEAK_BYTES_PER_PARAM = 22.3
# What the check's own process may hold on the device while a run starts: the experience stays on the host,
# so only what torch keeps for itself (cuBLAS's workspaces at CUBLAS_WORKSPACE_CONFIG ":4096:8", 8 x 4 MiB;
# the generators' states); one decoder layer of Qwen3-4B in bf16 is 192 MiB, a leaked model several GiB.
PARENT_HELD_MIB = 256
# How far the device's memory in use at a run's start may rise over the first run's: two CUDA contexts
# (the check's, the run's own) differ run to run by tens of MiB; a leaked run at 8 layers holds ~19 GB.
ACCUMULATED_MIB = 1024
RUN_MODES = ("production", "strict")


def parameters(config, layers: int, head: bool = True) -> int:
    """The policy's parameters at `layers` decoder layers of `config`'s widths (the embedding tied), and with
    `head` the head's (one decoder layer and its fc of 2H x H)."""
    h = config.hidden_size
    attn = h * config.head_dim * (config.num_attention_heads * 2 + config.num_key_value_heads * 2)
    layer = attn + 3 * h * config.intermediate_size + 2 * h + 2 * config.head_dim  # norms: input, post, q, k
    policy = config.vocab_size * h + layers * layer + h
    return policy + (layer + 2 * h * h if head else 0)


def layers_that_fit(config, memory_bytes: int, share: float = 0.8) -> int:
    """Decoder layers of `config`'s widths whose step with the head peaks within `share` of `memory_bytes`
    (the rest: the allocator's slack, the check's own process, and what `PEAK_BYTES_PER_PARAM`, read at one
    depth, may miss at another); at least 1, at most 36."""
    fixed, per_layer = parameters(config, 0), parameters(config, 1) - parameters(config, 0)
    fit = (share * memory_bytes / PEAK_BYTES_PER_PARAM - fixed) // per_layer
    return int(max(1, min(36, fit)))


@dataclass(frozen=True)
class RunSpec:
    """One run at one depth, in a process of its own (`gpu_trainer_run.py`)."""

    name: str
    kind: str  # "step": RL steps; "plain": the policy's forward + backward
    ours: bool = False  # our strategy and trainer, with the head (else upstream's, without it)
    strict: bool = False  # under torch's deterministic algorithms (upstream's full determinism)
    gather_policy: bool = False  # save the policy after the steps, to compare


RUNS = {"production": (RunSpec("production_with_head", "step", ours=True),
                       RunSpec("production_without_head", "step"), RunSpec("plain", "plain")),
        "strict": (RunSpec("strict_without_head", "step", strict=True, gather_policy=True),
                   RunSpec("strict_with_head", "step", ours=True, strict=True, gather_policy=True))}
UPSTREAM_AGAIN = RunSpec("strict_upstream_again", "step", strict=True, gather_policy=True)


def _build_policy(config, device, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config.from_dict(config.to_dict())
    config._attn_implementation = "sdpa"
    with torch.device(device):
        policy = Qwen3ForCausalLM(config)
    return flatten_policy_logits_(policy.to(torch.bfloat16).eval())


@dataclass
class Drafted:
    """What every run trains on, saved under the work directory: the drafter's sequences and records (in
    `experience/`), the policy of the first depth and the head; what the checks read back from them."""

    layers: int
    sequences: torch.Tensor
    rollouts: Rollouts
    calibration: dict
    z: float
    initial_head: dict[str, torch.Tensor]


def _draft(plan, config, device: torch.device, work: Path, log) -> Drafted:
    """A policy of `config` and a random head, the head's tau set to the plan's, their rollouts drafted and
    validated; the experience, the policy (with its log-probs of the sequences) and the head saved under
    `work`; both models released from the device."""
    from safetensors.torch import save_file

    from openrlhf_growmtp.core.checkpoint import export_head, load_head
    from openrlhf_growmtp.core.validation import validate_records

    policy = _build_policy(config, device)
    head = build_head(policy, torch.bfloat16)
    g = torch.Generator(device=device).manual_seed(1)
    prompts = torch.randint(0, config.vocab_size, (plan.trainer_responses, plan.trainer_prompt), device=device,
                            generator=g)
    loop = drafting_loop(policy, head, prompts, plan.trainer_response_tokens, plan.k, plan.topk)
    calibration = calibrate(loop, plan.tau_target, min(CALIB_CYCLES, plan.trainer_response_tokens), CALIB_PROBES)
    calibration.pop("base")
    rollouts = draft_rollouts(loop, plan.trainer_response_tokens)
    del loop
    records = rollouts.records
    validate_records(records, depth=plan.k, vocab_size=config.vocab_size, topk=plan.topk)
    log(f"  (trainer_step) drafted {len(records)} x {records[0].token_ids.numel()} tokens, {rollouts.cycles} "
        f"cycles at tau {rollouts.tau:.2f} in {rollouts.seconds:.1f} s")
    sequences = torch.stack([r.token_ids for r in records])
    (work / "experience" / "records").mkdir(parents=True)
    for i, record in enumerate(records):
        (work / "experience" / "records" / f"{i:05d}.rec").write_bytes(record.pack())
    save_file({"sequences": sequences.contiguous()}, str(work / "experience" / "sequences.safetensors"))
    _save_policy(policy, sequences, plan.trainer_prompt, work, config.num_hidden_layers)
    export_head(head, work / "head")
    del policy, head
    _release(device)
    initial_head = {n: p.to(torch.bfloat16).float() for n, p in load_head(work / "head").state_dict().items()}
    return Drafted(config.num_hidden_layers, sequences, rollouts, calibration, acceptance_z(rollouts.counts),
                   initial_head)


def _save_policy(policy, sequences: torch.Tensor, prompt: int, work: Path, layers: int) -> None:
    """The policy (`policy_<layers>/`) and its log-probs of the sequences' response tokens, the old policy's of
    the step (`experience/logp_<layers>.safetensors`)."""
    from safetensors.torch import save_file

    with torch.no_grad():
        logits = policy(input_ids=sequences.to(policy.device)).logits.float()
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, sequences[:, 1:, None].to(policy.device))[..., 0]
    save_file({"logp": logp[:, prompt - 1:].cpu().contiguous()},
              str(work / "experience" / f"logp_{layers}.safetensors"))
    policy.save_pretrained(work / f"policy_{layers}")


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class Runner:
    """Launches the runs of one trainer_step, each in a process of its own, and keeps what they left: a JSON
    and a log per run under `out_dir` (beside the check's JSON), large outputs under `work`."""

    def __init__(self, plan, device: torch.device, work: Path, out_dir: Path, deadline_at: float | None, log,
                 optimizer: dict, optimizer_env: dict):
        self.plan, self.device, self.work, self.out_dir = plan, device, work, out_dir
        self.deadline_at, self.log = deadline_at, log
        self.optimizer, self.optimizer_env = optimizer, optimizer_env  # gpu_fused_adam's outcome, its env
        out_dir.mkdir(parents=True, exist_ok=True)

    def past_deadline(self) -> bool:
        return self.deadline_at is not None and time.perf_counter() > self.deadline_at

    def launch(self, run: RunSpec, layers: int, blocking: bool) -> dict:
        """One run in a process of its own; its result JSON, with what the check's own process held as it
        started (`parent_held`), its exit status and its log's name. Nothing here touches CUDA after the run:
        its log and JSON are on disk whatever happened in it."""
        name = f"{layers}_layers_{run.name}"
        if self.past_deadline():
            self.log(f"  (trainer_step) {name}: not run, past the deadline")
            return {"name": run.name, "ok": False, "skipped": True, "error": None, "stage": "not run"}
        result_path, log_path = self.out_dir / f"{name}.json", self.out_dir / f"{name}.log"
        spec = {"name": run.name, "kind": run.kind, "device": self.device.type, "ours": run.ours, "strict": run.strict,
                "gather_policy": run.gather_policy, "policy_dir": str(self.work / f"policy_{layers}"),
                "head_dir": str(self.work / "head") if run.ours else None, "work_dir": str(self.work / str(layers)),
                "experience_dir": str(self.work / "experience"), "logp_file": f"logp_{layers}.safetensors",
                "outputs": str(self.work / str(layers) / run.name), "result": str(result_path),
                "fused_adam": self.optimizer["fused"],
                "plan": {k: getattr(self.plan, k) for k in ("k", "topk", "chunk_cycles", "micro_batch",
                                                             "trainer_responses", "trainer_prompt", "trainer_steps")}}
        spec_path = self.work / f"{name}.spec.json"
        spec_path.write_text(json.dumps(spec, indent=1))
        result_path.unlink(missing_ok=True)
        env = {**os.environ, **self.optimizer_env}
        if blocking:
            env.update(CUDA_LAUNCH_BLOCKING="1", TORCH_SHOW_CPP_STACKTRACES="1")
        parent_held = self.held_here()
        t0 = time.perf_counter()
        with open(log_path, "wb") as out:
            proc = subprocess.Popen([sys.executable, *RUN_ARGS, str(spec_path)], stdout=out,
                                    stderr=subprocess.STDOUT, env=env, cwd=Path(__file__).resolve().parents[2])
            try:
                code = proc.wait()
            except BaseException:  # cut off: the run goes with the check
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                raise
        result = json.loads(result_path.read_text()) if result_path.exists() else {"name": run.name, "ok": False,
                                                                                   "stage": "never started"}
        if not result["ok"] and not result.get("error"):
            result["error"] = (f"the run's process ended with exit status {code} before it recorded an error "
                               f"(killed, or it died in C: its log has faulthandler's stacks)")
        result.update(exit_status=code, wall_s=time.perf_counter() - t0, log=log_path.name, parent_held=parent_held,
                      launch_blocking=blocking)
        if result["ok"]:
            self.log(f"  (trainer_step) {name}: {', '.join(f'{s:.2f}' for s in result['seconds'])} s")
        else:
            tail = log_path.read_text(errors="replace").splitlines()[-40:]
            self.log(f"  (trainer_step) {name} FAILED (exit {code}); the last lines of {log_path}:\n    "
                     + "\n    ".join(tail))
        return result

    def held_here(self) -> dict:
        """What the check's own process holds as a run starts; on CUDA beyond PARENT_HELD_MIB, its largest
        tensors on the device, named."""
        found = held(self.device)
        if self.device.type == "cuda" and found["cuda_allocated_mib"] > PARENT_HELD_MIB:
            tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.is_cuda]
            tensors.sort(key=lambda t: t.numel() * t.element_size(), reverse=True)
            found["largest"] = [f"{t.dtype} {list(t.shape)} {t.numel() * t.element_size() / 2**20:.0f} MiB"
                                for t in tensors[:5]]
        return found


def check_trainer_step(plan, depths: list[int], device: torch.device, log, out_dir: Path,
                       modes: tuple[str, ...] = RUN_MODES, blocking: tuple[int, ...] = (),
                       strict_at: tuple[int, ...] | None = None, deadline_at: float | None = None, progress=None,
                       fused_adam_s: float = 0.0) -> tuple[list[Row], dict]:
    """`depths`: the policies' layers, the first drafting; `modes`: the runs at each depth, strict only at
    `strict_at` (None: every depth); `progress(details)` is told the details so far after
    each depth (the check's JSON keeps them if a later depth is cut off); `fused_adam_s`: the time box for
    building DeepSpeed's fused Adam (`gpu_fused_adam`; 0: torch's AdamW)."""
    work = Path(tempfile.mkdtemp(prefix="gpu_trainer_"))
    build = None
    try:
        if fused_adam_s > 0 and device.type == "cuda":
            build = FusedAdamBuild(work / "torch_extensions", out_dir, fused_adam_s)  # beside the drafter
        drafted = _draft(plan, plan.trainer_config(depths[0]), device, work, log)
        optimizer = (build.outcome() if build is not None else
                     no_build("not asked (--fused-adam-s)" if device.type == "cuda" else "no CUDA"))
        log(f"  (trainer_step) optimizer: {optimizer['optimizer']}"
            + (f" ({optimizer['reason']})" if optimizer["reason"] else f", built in {optimizer['build_s']:.0f} s"))
        runner = Runner(plan, device, work, out_dir, deadline_at, log, optimizer,
                        build.env() if optimizer["fused"] else {})
        base = {"drafted_at_layers": depths[0], "depths": list(depths), "runs_asked": list(modes),
                "strict_at": list(depths if strict_at is None else strict_at),
                "drafter": _drafter(drafted), "runs_dir": out_dir.name, "optimizer_choice": optimizer}
        rows, by_depth, details = [_drafter_row({**base, "cycles": drafted.rollouts.cycles,
                                                 "tau": drafted.rollouts.tau})], {}, {}
        for layers in depths:
            here = tuple(m for m in modes if m != "strict" or strict_at is None or layers in strict_at)
            found, by_depth[str(layers)] = _depth(plan, layers, drafted, runner, here, layers in blocking)
            rows += found
            # the last depth's figures at the top, where the end-to-end prediction reads them
            details = {**base, **by_depth[str(layers)], "by_depth": by_depth}
            if progress is not None:
                progress(details)
        rows.append(_clean_start_row(by_depth, device))
        return rows, details
    finally:
        if build is not None and build.proc.poll() is None:  # an error before its time box ended
            build.proc.kill()
        shutil.rmtree(work, ignore_errors=True)


def _drafter(drafted: Drafted) -> dict:
    r, c = drafted.rollouts, drafted.rollouts.counts
    return {"seconds": r.seconds, "phases": r.phases, "calibration": drafted.calibration, "cycles": r.cycles,
            "tau": r.tau, "first_accept_rate": c["first_accepted"] / c["cycles"],
            "first_alpha": c["alpha_sum"] / c["cycles"], "z": drafted.z}


def _depth(plan, layers: int, drafted: Drafted, runner: Runner, modes, blocking: bool) -> tuple[list[Row], dict]:
    """Every run asked at one depth, then its verdicts and figures."""
    config = plan.trainer_config(layers)
    if not (runner.work / f"policy_{layers}").exists():
        if runner.past_deadline():
            return [Row("trainer_step", f"{layers} layers: not run, past the deadline", "-", "-", False,
                        skipped=True)], {"layers": layers, "runs": {}}
        policy = _build_policy(config, runner.device)
        _save_policy(policy, drafted.sequences, plan.trainer_prompt, runner.work, layers)
        del policy
        _release(runner.device)
    runs = {}
    for mode in modes:
        for run in RUNS[mode]:
            runs[run.name] = runner.launch(run, layers, blocking)
    outputs = runner.work / str(layers)
    strict_ok = runs.get("strict_without_head", {}).get("ok") and runs.get("strict_with_head", {}).get("ok")
    comparison = control = None
    if strict_ok:
        comparison = _differences(outputs / "strict_without_head" / "policy.safetensors",
                                  outputs / "strict_with_head" / "policy.safetensors")
        if comparison["differing"]:  # the head's doing, or the device's?
            runs[UPSTREAM_AGAIN.name] = runner.launch(UPSTREAM_AGAIN, layers, blocking)
            if runs[UPSTREAM_AGAIN.name]["ok"]:
                again = _differences(outputs / "strict_without_head" / "policy.safetensors",
                                     outputs / UPSTREAM_AGAIN.name / "policy.safetensors")
                control = {"differing": len(again["differing"]), "max_abs_diff": again["max_abs_diff"]}
    details = _details(plan, layers, config, drafted, runs, comparison, control, runner.work, blocking)
    shutil.rmtree(outputs, ignore_errors=True)
    shutil.rmtree(runner.work / f"policy_{layers}", ignore_errors=True)
    return _rows(plan, details), details


def _details(plan, layers, config, drafted: Drafted, runs: dict, comparison, control, work: Path,
             blocking: bool) -> dict:
    sequences = drafted.sequences
    d = {"layers": layers, "hidden_size": config.hidden_size, "vocab_size": config.vocab_size,
         "responses": plan.trainer_responses, "prompt_tokens": plan.trainer_prompt,
         "sequence_tokens": int(sequences.shape[1]), "tokens": int(sequences.numel()),
         "cycles": drafted.rollouts.cycles, "tau": drafted.rollouts.tau, "micro_batch": plan.micro_batch,
         "steps": plan.trainer_steps, "launch_blocking": blocking, "runs": runs}
    steps = [r for r in runs.values() if r.get("kind") == "step" and r.get("ok")]
    if steps:
        d.update(optimizer=sorted({r["optimizer"] for r in steps}), standins=steps[0]["standins"])
    for name, run in runs.items():  # the head moved, in every run with the head that ran
        if run.get("ok") and run.get("head_file"):
            matrices, moved = _head_moved(Path(run["head_file"]), drafted.initial_head)
            run.update(head_matrices=matrices, head_matrices_moved=moved)
    without, with_head = runs.get("strict_without_head"), runs.get("strict_with_head")
    if comparison is not None:
        trained = _count_trained(work / f"policy_{layers}", Path(without["policy_file"]))
        step_without, step_with = without["seconds"][-1], with_head["seconds"][-1]
        head_s = with_head["status"].get("growmtp/head_update_s", float("nan"))
        d.update({
            "seconds_without_head": without["seconds"], "seconds_with_head": with_head["seconds"],
            "step_s_without_head": step_without, "step_s_with_head": step_with, "head_update_s": head_s,
            "head_share_of_step": head_s / step_with, "step_ratio_with_over_without": step_with / step_without,
            "policy_tensors": comparison["tensors"], "policy_tensors_differing": comparison["differing"],
            "policy_max_abs_diff": comparison["max_abs_diff"], "policy_tensors_trained": trained,
            "head_matrices": with_head["head_matrices"], "head_matrices_moved": with_head["head_matrices_moved"],
            "status_with_head": with_head["status"], "status_without_head": without["status"],
            "upstream_against_itself": control, "deterministic_algorithms": "strict",
            "memory_mb": {"without_head": without["memory_mb"], "with_head": with_head["memory_mb"]},
            "nondeterministic_ops": sorted(set(without["nondeterministic_ops"] + with_head["nondeterministic_ops"]))})
    production = {n: runs.get(f"production_{n}") for n in ("with_head", "without_head")}
    if all(r and r["ok"] for r in production.values()) and runs.get("plain", {}).get("ok"):
        d["production"] = _production(plan, production, runs["plain"], d["tokens"])
        if comparison is not None:
            d["strict_over_production"] = {n: d[f"step_s_{n}"] / d["production"]["step_s"][n]
                                           for n in ("without_head", "with_head")}
    for run in runs.values():
        run["verdict"] = _verdict(run, d)
    return d


def _verdict(run: dict, d: dict) -> str:
    """What the run showed, or why it shows nothing."""
    if run.get("skipped"):
        return "none: not run, past the deadline"
    if not run.get("ok"):
        return f"none: the run failed ({_last_line(run.get('error'))[:200]}); its log: {run.get('log')}"
    said = []
    if run["name"] == "strict_with_head":
        differing, n = d.get("policy_tensors_differing"), d.get("policy_tensors")
        said.append("policy bit-identical to upstream's (strict_without_head)" if differing == [] else
                    f"policy NOT bit-identical to upstream's: {len(differing)} of {n} tensors differ"
                    if differing else "policy not compared: strict_without_head did not run")
    if run["name"] == "strict_without_head":
        said.append("the reference policy; " + (f"{d['policy_tensors_trained']} of {d['policy_tensors']} tensors "
                                                "trained" if "policy_tensors_trained" in d else "not compared"))
    if run["name"] in ("production_without_head", "strict_upstream_again"):
        said.append("policy not judged: without deterministic algorithms upstream's step differs from itself"
                    if run["name"].startswith("production") else "upstream against itself (the control)")
    if "head_matrices" in run:
        said.append(f"head moved: {len(run['head_matrices_moved'])} of {len(run['head_matrices'])} weight matrices")
    if run["name"] == "plain":
        said.append("timed only (the policy's plain forward + backward: nothing to judge)")
    return "; ".join(said)


def _last_line(error: str | None) -> str:
    """An error's last line (a traceback's: the exception)."""
    lines = (error or "").strip().splitlines()
    return lines[-1] if lines else "no error recorded"


def _production(plan, runs: dict, plain: dict, tokens: int) -> dict:
    """The production steps' times (the last of each run), per token, over the plain forward + backward's."""
    step = {name: run["seconds"][-1] for name, run in runs.items()}
    plain_s = plain["seconds"][-1]
    head_s = runs["with_head"]["status"].get("growmtp/head_update_s", float("nan"))
    return {"deterministic_algorithms": "off", "steps": plan.trainer_steps, "tokens": tokens,
            "seconds": {name: run["seconds"] for name, run in runs.items()},
            "step_s": step, "head_update_s": head_s, "head_share_of_step": head_s / step["with_head"],
            "step_ratio_with_over_without": step["with_head"] / step["without_head"],
            "plain_forward_backward_s": plain_s,
            "per_token_s": {**{name: s / tokens for name, s in step.items()},
                            "plain_forward_backward": plain_s / tokens},
            "step_over_plain_forward_backward": {name: s / plain_s for name, s in step.items()},
            "memory_mb": {name: run["memory_mb"] for name, run in runs.items()},
            "head_matrices_moved": len(runs["with_head"].get("head_matrices_moved", [])),
            "head_matrices": len(runs["with_head"].get("head_matrices", []))}


def _drafter_row(d: dict) -> Row:
    z, drafter = d["drafter"]["z"], d["drafter"]
    return Row("trainer_step", f"reference drafter: first-draft acceptance vs sum min(p, q), {d['cycles']} cycles "
               f"({d['drafted_at_layers']} layers)",
               f"z {z:.2f} ({drafter['first_accept_rate']:.3f} vs {drafter['first_alpha']:.3f}); tau {d['tau']:.2f}",
               f"|z| <= {Z_LIMIT:g}", abs(z) <= Z_LIMIT, {"z": z, "tau": d["tau"]})


def _rows(plan, d: dict) -> list[Row]:
    layers, runs, rows = d["layers"], d["runs"], []
    for name, run in runs.items():
        if run.get("skipped"):
            rows.append(Row("trainer_step", f"{layers} layers, {name}: not run, past the deadline", "-", "-", False,
                            skipped=True))
        elif not run.get("ok"):
            rows.append(Row("trainer_step", f"{layers} layers, {name}: FAILED (log {run['log']})",
                            _last_line(run.get("error"))[:100], "runs to its end", False))
    if "policy_tensors_differing" in d:
        n, differing, control = d["policy_tensors"], d["policy_tensors_differing"], d["upstream_against_itself"]
        rows.append(Row(
            "trainer_step", f"policy after {plan.trainer_steps} ZeRO-3 bf16 steps (strict), {layers} layers: ours "
            "with the head vs upstream without", f"{n - len(differing)} of {n} tensors identical"
            + (f", max|d| {d['policy_max_abs_diff']:.1e}" if differing else "")
            + (f"; upstream vs itself: {n - control['differing']} identical, max|d| {control['max_abs_diff']:.1e}"
               if control else ""), f"bit-identical; {d['policy_tensors_trained']} of {n} trained",
            not differing and d["policy_tensors_trained"] > 0
            and d["status_with_head"].get("growmtp/head_finite") == 1.0,
            {"differing": len(differing), "max_abs_diff": d["policy_max_abs_diff"]}))
        head_s, step_with, step_without = d["head_update_s"], d["step_s_with_head"], d["step_s_without_head"]
        rows += [Row("trainer_step", f"strict, {layers} layers: head update / whole step with it, {d['tokens']} "
                     f"tokens, {d['cycles']} cycles", f"{head_s / step_with:.3f}",
                     f"{head_s:.2f} s / {step_with:.2f} s (last of {plan.trainer_steps} steps)", None,
                     {"ratio": head_s / step_with}),
                 Row("trainer_step", f"strict, {layers} layers: step with the head / step without (upstream)",
                     f"{step_with / step_without:.3f}", f"{step_with:.2f} s / {step_without:.2f} s", None,
                     {"ratio": step_with / step_without})]
    for name, run in runs.items():
        if "head_matrices" in run:
            moved, matrices = run["head_matrices_moved"], run["head_matrices"]
            rows.append(Row("trainer_step", f"{layers} layers, {name}: head's weight matrices moved",
                            f"{len(moved)} of {len(matrices)}", "all", bool(matrices) and len(moved) == len(matrices),
                            {"moved": len(moved)}))
    if "production" in d:
        rows += _production_rows(d)
    peaks = {n: r["memory_mb"]["peak"] for n, r in runs.items() if r.get("ok") and r.get("memory_mb")}
    if peaks:
        rows.append(Row("trainer_step", f"{layers} layers: peak memory allocated per run, MiB",
                        ", ".join(f"{n} {p:,.0f}" for n, p in peaks.items()), "each run in a process of its own",
                        None, peaks))
    return rows


def _production_rows(d: dict) -> list[Row]:
    prod, layers = d["production"], d["layers"]
    per_token, over = prod["per_token_s"], prod["step_over_plain_forward_backward"]
    note = " (CUDA_LAUNCH_BLOCKING: not a timing)" if d["launch_blocking"] else ""
    strict = (f"; strict / production {d['strict_over_production']['with_head']:.2f}x with the head, "
              f"{d['strict_over_production']['without_head']:.2f}x without" if "strict_over_production" in d else "")
    return [
        Row("trainer_step", f"production step (not strict), {layers} layers, {prod['tokens']} tokens: per token "
            f"with the head / without / plain fwd+bwd{note}", f"{per_token['with_head'] * 1e6:.1f} / "
            f"{per_token['without_head'] * 1e6:.1f} / {per_token['plain_forward_backward'] * 1e6:.1f} us",
            f"over plain fwd+bwd: {over['with_head']:.2f}x with, {over['without_head']:.2f}x without{strict}", None,
            {"with_head": over["with_head"], "without_head": over["without_head"]}),
        Row("trainer_step", f"production step (not strict), {layers} layers: with the head / without; head "
            f"update / step{note}", f"{prod['step_ratio_with_over_without']:.3f}; {prod['head_share_of_step']:.3f}",
            f"{prod['step_s']['with_head']:.2f} s / {prod['step_s']['without_head']:.2f} s", None,
            {"ratio": prod["step_ratio_with_over_without"], "head_share": prod["head_share_of_step"]}),
    ]


def clean_starts(by_depth: dict, device: torch.device) -> list[str]:
    """What any run started with that an earlier one held, named (empty: every run started clean): a DeepSpeed
    engine alive in its process or the check's, CUDA memory allocated in its process, more than PARENT_HELD_MIB
    held by the check's own process, or the device's memory in use above the first run's by ACCUMULATED_MIB."""
    problems, first_used = [], None
    for layers, depth in by_depth.items():
        for name, run in depth["runs"].items():
            mine, parent = run.get("held_at_start"), run.get("parent_held")
            if mine is None:
                continue
            where = f"{layers} layers, {name}"
            if mine["deepspeed_engines"] or parent["deepspeed_engines"]:
                problems.append(f"{where}: {mine['deepspeed_engines']} DeepSpeed engine(s) alive in its process and "
                                f"{parent['deepspeed_engines']} in the check's as it started")
            if device.type != "cuda":
                continue
            if mine["cuda_allocated_mib"] > 0:
                problems.append(f"{where}: {mine['cuda_allocated_mib']:.0f} MiB allocated in its process as it started")
            if parent["cuda_allocated_mib"] > PARENT_HELD_MIB:
                problems.append(f"{where}: the check's own process held {parent['cuda_allocated_mib']:,.0f} MiB on the "
                                f"device (largest: {'; '.join(parent.get('largest', []))})")
            first_used = mine["device_used_mib"] if first_used is None else first_used
            if mine["device_used_mib"] > first_used + ACCUMULATED_MIB:
                problems.append(f"{where}: the device had {mine['device_used_mib']:,.0f} MiB in use as it started, "
                                f"{mine['device_used_mib'] - first_used:,.0f} MiB more than at the first run's start")
    return problems


def _clean_start_row(by_depth: dict, device: torch.device) -> Row:
    runs = [r for d in by_depth.values() for r in d["runs"].values() if r.get("held_at_start")]
    problems = clean_starts(by_depth, device)
    used = [r["held_at_start"].get("device_used_mib") for r in runs if device.type == "cuda"]
    measured = (f"{len(runs)} runs, none with an engine alive" + (f"; device in use at their starts "
                f"{min(used):,.0f}-{max(used):,.0f} MiB" if used else "")) if not problems else "; ".join(problems)
    return Row("trainer_step", "no run started with memory an earlier run held", measured,
               f"0 engines; on CUDA the check's own process <= {PARENT_HELD_MIB} MiB and no rise over the first run "
               f"> {ACCUMULATED_MIB} MiB", bool(runs) and not problems, {"problems": problems})


def _differences(file_a: Path, file_b: Path) -> dict:
    """The tensors of two saved policies that differ, and the largest absolute difference among them."""
    from safetensors import safe_open

    differing, largest = [], 0.0
    with safe_open(str(file_a), "pt") as a, safe_open(str(file_b), "pt") as b:
        names = sorted(a.keys())
        for name in names:
            x, y = a.get_tensor(name), b.get_tensor(name)
            if not torch.equal(x, y):
                differing.append(name)
                largest = max(largest, float((x.float() - y.float()).abs().max()))
    return {"tensors": len(names), "differing": differing, "max_abs_diff": largest}


def _count_trained(policy_dir: Path, after: Path) -> int:
    """How many of the tensors saved in `after` differ from the saved policy's tensors of the same name."""
    from safetensors import safe_open

    changed = 0
    with safe_open(str(after), "pt") as trained:
        names = set(trained.keys())
        for path in sorted(policy_dir.glob("*.safetensors")):
            with safe_open(str(path), "pt") as f:
                for name in f.keys():
                    if name in names:
                        changed += not torch.equal(trained.get_tensor(name).float(), f.get_tensor(name).float())
    return changed


def _head_moved(head_file: Path, initial: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """The head's weight matrices, and those that differ from where they started."""
    from safetensors.torch import load_file

    after = {n: p.float() for n, p in load_file(str(head_file)).items()}
    matrices = [n for n, p in after.items() if p.ndim == 2]
    return matrices, [n for n in matrices if n in initial and not torch.equal(after[n], initial[n])]

