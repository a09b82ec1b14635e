"""make serve-check: serve a demo run's export with vLLM's server, send the run's own prompts, and compare the
acceptance vLLM's /metrics counters report with the τ the run measured in its last steps.

    python -m openrlhf_growmtp.cli.serve_check [--run runs/demo] [--prompts 256] [--port 8000]

The prompts come from the run's prompt set (`--data.prompt_dataset` in its command.txt), from its end (the
run trained on its first `--data.max_samples` rows), sampled as the rollouts were (its temperature and
max_new_tokens). τ from the counters is vLLM's mean acceptance length, 1 + accepted / drafts; α_k is the
share of drafts whose first k tokens were accepted, i.e. accepted-per-position[k-1] / drafts. The served
policy and head are the run's final ones, one update after the rollouts of its last step; so the same
prompts also go through the run's own kind of engine (`SpecEngine`, as the rollouts drafted) on those same
final weights, the like-for-like reference. Writes <run>/growmtp/serve_check.json and exits 1 when the
server accepted no draft at all.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import sys
import urllib.request
from pathlib import Path

from openrlhf_growmtp.core.model_export import RUN_HEAD_DIR, ExportError, read_serve_config

from .serve import (ARM, CPU_ENV, FINAL, SERVED_MODEL_NAME, PortInUseError, check_port_free, cpu_only, export_run,
                    newest_run, start_server, stop_server, wait_ready)

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total")
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
_SAMPLE = re.compile(r'^(?P<name>[^\s{]+)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)$')


def spec_decode_counters(exposition: str) -> dict:
    """vLLM's spec-decode counters from a /metrics page (Prometheus text format), summed over engines:
    {"drafts", "draft_tokens", "accepted_tokens": float, "accepted_per_position": [float, ...]}."""
    totals = dict.fromkeys(SPEC_COUNTERS, 0.0)
    per_position: dict[int, float] = {}
    for line in exposition.splitlines():
        match = _SAMPLE.match(line.strip())
        if not match or line.startswith("#"):
            continue
        name, value = match["name"], float(match["value"])
        if name in totals:
            totals[name] += value
        elif name == PER_POSITION:
            position = int(dict(re.findall(r'(\w+)="([^"]*)"', match["labels"] or ""))["position"])
            per_position[position] = per_position.get(position, 0.0) + value
    drafts, tokens, accepted = (totals[name] for name in SPEC_COUNTERS)
    return {"drafts": drafts, "draft_tokens": tokens, "accepted_tokens": accepted,
            "accepted_per_position": [per_position[p] for p in sorted(per_position)]}


def acceptance(before: dict, after: dict) -> dict:
    """τ, α_k and a standard error of τ from two counter snapshots.

    accepted a per draft is in 0..K with P(a >= k) = α_k, so E[a] = Σ α_k and E[a²] = Σ (2k - 1) α_k; the
    standard error treats drafts as independent (those of one request are not quite), a rough guide only.
    """
    drafts = after["drafts"] - before["drafts"]
    accepted = after["accepted_tokens"] - before["accepted_tokens"]
    per_position = [a - b for a, b in zip(after["accepted_per_position"], before["accepted_per_position"])]
    if drafts <= 0:
        return {"drafts": 0, "accepted_tokens": accepted, "tau": 1.0, "alpha": [0.0] * len(per_position),
                "tau_standard_error": float("nan")}
    alpha = [count / drafts for count in per_position]
    mean = sum(alpha)
    second = sum((2 * k + 1) * a for k, a in enumerate(alpha))
    return {"drafts": drafts, "accepted_tokens": accepted, "tau": 1.0 + accepted / drafts, "alpha": alpha,
            "tau_standard_error": math.sqrt(max(second - mean * mean, 0.0) / drafts)}


def run_settings(run: Path) -> dict:
    """The prompt set and sampling of the run's rollouts, from the training command it wrote."""
    argv = shlex.split((run / ARM / "command.txt").read_text())

    def flag(name: str, default=None):
        return argv[argv.index(name) + 1] if name in argv else default

    return {"prompts": Path(flag("--data.prompt_dataset")), "input_key": flag("--data.input_key", "input"),
            "max_tokens": int(flag("--rollout.max_new_tokens", 1024)),
            "temperature": float(flag("--rollout.temperature", 1.0)), "top_p": float(flag("--rollout.top_p", 1.0))}


def run_tau(run: Path) -> dict:
    """The run's own τ: each of its last steps (summary.json's final window) and their mean."""
    summary = json.loads((run / "summary.json").read_text())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [row for row in rows if row["arm"] == ARM][-summary["final_window"]:]
    return {"tau_final": summary["tau_final"], "steps": [row["step"] for row in steps],
            "tau_steps": [row["tau"] for row in steps], "alpha_final": summary["alpha_final"]}


def engine_acceptance(run: Path, prompts: list[str], settings: dict, k: int) -> dict:
    """τ and α of the same prompts through a `SpecEngine` (the rollouts' engine) on the run's final weights."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from vllm_patches.engine import SpecEngine

    if cpu_only():
        for name, value in CPU_ENV.items():
            os.environ.setdefault(name, value)
    final = run / ARM / FINAL
    tokenizer = AutoTokenizer.from_pretrained(str(final))
    engine = SpecEngine(final, final / RUN_HEAD_DIR, k, capture=False, dtype="float32", enforce_eager=True)
    try:
        params = SamplingParams(temperature=settings["temperature"], top_p=settings["top_p"],
                                max_tokens=settings["max_tokens"])
        summary = engine.generate([tokenizer.encode(p) for p in prompts], params).metrics.acceptance
    finally:
        engine.close()
    return {"drafts": summary.cycles, "tau": summary.tau, "alpha": summary.alpha}


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=60) as response:
        return response.read().decode()


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=1800) as response:
        return json.loads(response.read())


def check(run: Path, num_prompts: int, host: str, port: int) -> dict:
    settings = run_settings(run)
    rows = [json.loads(line) for line in settings["prompts"].read_text().splitlines() if line.strip()]
    prompts = [row[settings["input_key"]] for row in rows[-num_prompts:]]
    check_port_free(host, port)
    export_dir = export_run(run)
    base_url = f"http://{host}:{port}"
    with (run / ARM / "serve_check.log").open("w") as log:
        process = start_server(export_dir, host, port, cpu_only(), log=log)
        try:
            wait_ready(process, base_url)
            before = spec_decode_counters(_get(base_url + "/metrics"))
            response = _post(base_url + "/v1/completions", {
                "model": SERVED_MODEL_NAME, "prompt": prompts, "max_tokens": settings["max_tokens"],
                "temperature": settings["temperature"], "top_p": settings["top_p"]})
            after = spec_decode_counters(_get(base_url + "/metrics"))
        finally:
            stop_server(process)
    k = read_serve_config(export_dir)["k"]
    return {"run": str(run), "export": str(export_dir), "k": k,
            "prompts": len(prompts), "completion_tokens": response["usage"]["completion_tokens"],
            "first_completion": {"prompt": prompts[0], "text": response["choices"][0]["text"]},
            "served": acceptance(before, after), "engine": engine_acceptance(run, prompts, settings, k),
            "run_tau": run_tau(run)}


def report(result: dict) -> str:
    served, engine, ran = result["served"], result["engine"], result["run_tau"]
    steps = ", ".join(f"step {s}: {t:.3f}" for s, t in zip(ran["steps"], ran["tau_steps"]))
    return "\n".join([
        f"{result['run']}: served at K={result['k']}, {result['prompts']} of the run's prompts, "
        f"{result['completion_tokens']} completion tokens, {served['drafts']:.0f} drafts",
        f"  served τ (vLLM /metrics) {served['tau']:.3f} ± {served['tau_standard_error']:.3f}, "
        f"α = [{' '.join(f'{a:.3f}' for a in served['alpha'])}]",
        f"  SpecEngine, same prompts and weights: τ {engine['tau']:.3f} ({engine['drafts']} drafts), "
        f"α = [{' '.join(f'{a:.3f}' for a in engine['alpha'])}]",
        f"  the run's τ, last steps: {ran['tau_final']:.3f} ({steps}), "
        f"α = [{' '.join(f'{a:.3f}' for a in ran['alpha_final'])}]",
        f"  served - run: {served['tau'] - ran['tau_final']:+.3f}",
        f"  e.g. {result['first_completion']['prompt']!r} -> {result['first_completion']['text']!r}",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="growmtp-serve-check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs-dir", default="runs")
    parser.add_argument("--run", default=None, help="a demo run directory (default: the newest demo run)")
    parser.add_argument("--prompts", type=int, default=256, help="how many of the run's prompts to send")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    try:
        run = Path(args.run) if args.run else newest_run(Path(args.runs_dir))
        result = check(run, args.prompts, args.host, args.port)
    except (ExportError, PortInUseError) as err:
        print(f"growmtp-serve-check: {err}", file=sys.stderr)
        return 2
    print(report(result))
    (run / ARM / "serve_check.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["served"]["accepted_tokens"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
