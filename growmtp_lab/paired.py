"""The paired rollout measurement at a run's checkpoints (`make demo`, `make speed-study`).

Both arms of a run save an HF checkpoint every `every` RL steps (`--ckpt.save_steps`, `--ckpt.save_hf`;
the autoregressive arm too, so that both pay the same saves); `measure_run` measures a GrowMTP arm's
checkpoints with `growmtp-paired-rollout`, `PROCESSES` fresh measurement processes per checkpoint (the figure:
the mean of their medians with its interval over processes). The prompt set is fixed before any run: the
world's last `PROMPTS` prompts (the runs train on its first ones), each sampled `SAMPLES` times as a GRPO group
is, at the recipe's response length and its engines' concurrency. A checkpoint whose result is there already
is not measured again (a study resumes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

HF_CHECKPOINT = "global_step{step}_hf"  # upstream's name for a --ckpt.save_hf checkpoint under --ckpt.path
PROMPTS, SAMPLES = 4, 4  # one RL step's rollout of the speed world's recipe: 16 requests
PROCESSES = 3  # measurement processes per checkpoint: the fewest whose t interval over processes is finite
# what a run's summary keeps of a checkpoint's result (the per-generate rows stay in paired/step<N>.json)
KEPT = ("speedup", "speedup_per_process", "speedup_per_pair", "ar_s_per_token", "ar_s_per_token_per_process",
        "spec_s_per_token", "spec_s_per_token_per_process", "tau", "tau_per_process", "cycles", "depth", "pairs",
        "processes", "requests", "ar_tokens_per_generate", "spec_tokens_per_generate", "engines")


@dataclass(frozen=True)
class PairedPlan:
    steps: tuple[int, ...]  # the checkpoints to measure (the last one: the run's final export)
    pairs: int  # per measurement process
    every: int | None  # both arms save every `every` RL steps (None: only the final export is measured)
    processes: int = PROCESSES


def checkpoint_flags(every: int | None) -> list[str]:
    """The training CLI flags that save an HF checkpoint (policy and growmtp_head/) every `every` RL steps,
    without DeepSpeed's optimizer state (nothing here resumes from them); none for `every` None."""
    return [] if every is None else ["--ckpt.save_steps", str(every), "--ckpt.save_hf", "--ckpt.disable_ds"]


def checkpoint_dir(arm_dir: Path, step: int, steps: int) -> Path:
    """Where the arm's checkpoint after `step` lives: its final export after the last step."""
    return arm_dir / "final" if step == steps else arm_dir / "ckpt" / HF_CHECKPOINT.format(step=step)


def depth_at(rows: list[dict], step: int, k: int) -> int:
    """The depth a run drafts at with its checkpoint after `step`: the next step's logged depth (auto), else
    the step's own, else K (a fixed-depth arm logs none)."""
    by_step = {row["step"]: row for row in rows}
    for candidate in (step + 1, step):
        if "depth" in by_step.get(candidate, {}):
            return int(by_step[candidate]["depth"])
    return k


def command(checkpoint: Path, depth: int, prompts: Path, recipe, pairs: int, out: Path,
            regimes: str | None = None, processes: int = PROCESSES) -> list[str]:
    """`growmtp-paired-rollout` for one checkpoint at the recipe's engine settings (in process, as the runs'
    engines under full determinism; the context length with the drafts' headroom)."""
    cmd = [sys.executable, "-m", "openrlhf_growmtp.cli.paired_rollout", "--model", str(checkpoint),
           "--depth", str(depth), "--prompts", str(prompts), "--prompt-count", str(PROMPTS), "--from-end",
           "--samples", str(SAMPLES), "--max-tokens", str(recipe.max_new_tokens), "--pairs", str(pairs),
           "--processes", str(processes),
           "--max-model-len", str(recipe.max_len + 2 * recipe.k), "--engine-in-process", "--out", str(out)]
    if recipe.max_num_seqs is not None:
        cmd += ["--max-num-seqs", str(recipe.max_num_seqs)]
    return cmd + (["--regimes", regimes] if regimes else [])


def measure_run(arm_dir: Path, rows: list[dict], prompts: Path, recipe, plan: PairedPlan, k: int,
                regimes: str | None = None, log=print) -> list[dict]:
    """The paired measurement at each of `plan.steps` (results also under arm_dir/paired/step<N>.json); at the
    last one also each decoding at its best concurrency, where `regimes` gives the levels to scan."""
    results = []
    (arm_dir / "paired").mkdir(exist_ok=True)
    for step in plan.steps:
        out = arm_dir / "paired" / f"step{step}.json"
        last = step == plan.steps[-1]
        if not out.exists():
            checkpoint = checkpoint_dir(arm_dir, step, recipe.steps)
            if not (checkpoint / "config.json").is_file():
                raise FileNotFoundError(f"no checkpoint after step {step} at {checkpoint}")
            cmd = command(checkpoint, depth_at(rows, step, k), prompts, recipe, plan.pairs, out,
                          regimes if last else None, plan.processes)
            done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            (arm_dir / "paired" / f"step{step}.log").write_text(done.stdout + done.stderr)
            if done.returncode != 0:
                tail = "\n".join((done.stdout + done.stderr).splitlines()[-30:])
                out.unlink(missing_ok=True)
                raise RuntimeError(f"the paired measurement after step {step} failed (exit {done.returncode}):\n{tail}")
        result = json.loads(out.read_text())
        results.append({"step": step, **{key: result[key] for key in KEPT if key in result},
                        **({"regimes": {key: value for key, value in result["regimes"].items()
                                        if key not in ("rows", "per_process")}} if "regimes" in result else {})})
        s = result["speedup"]
        log(f"  after step {step}: paired speedup {s['estimate']:.2f}x [{s['low']:.2f}, {s['high']:.2f}] over "
            f"{result.get('processes', 1)} processes, τ {result['tau']:.2f} at depth {result['depth']}")
    return results
