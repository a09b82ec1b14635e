"""`python -m openrlhf_growmtp.cli.evaluate`: held-out quality and τ of a policy + draft head, as in the paper.

    python -m openrlhf_growmtp.cli.evaluate --model runs/qwen3_4b_math_k5/final \\
        --head runs/qwen3_4b_math_k5/final/growmtp_head \\
        --math aime24=data/aime24.jsonl --math aime25=data/aime25.jsonl --math amc23=data/amc23.jsonl \\
        --code lcb_atcoder=data/lcb_v6_atcoder.jsonl --code lcb_leetcode=data/lcb_v6_leetcode.jsonl \\
        --out runs/qwen3_4b_math_k5/eval

Benchmarks are prompt files written by `python -m openrlhf_growmtp.cli.prepare_data` (rows `id`, `prompt`,
`label`). Every problem is sampled on the speculative engine with the trained head at the run's depth
(the head directory records it; `--k` overrides), at temperature 1.0 and top-p 0.7, up to 16384 tokens:
- math: Mean@16, the mean accuracy over 16 samples per problem (`rewards.math.score.math_score`, the
  training run's rule: $GROWMTP_MATH_RULE, DAPO's string match by default);
- code: Pass@4, the fraction of problems where one of 4 samples passes every test (6 s per test case,
  in the sandbox of `rewards.code.sandbox`; a LeetCode problem's tests call its function, see
  `rewards.code.label`).
τ per benchmark is the engine's own: vLLM's spec-decode counters (drafts, accepted tokens, accepted per
position) over that benchmark's generate call. The table is printed; `eval.json` and
`generations.jsonl` are written to `--out`. With GROWMTP_DRY_RUN=1 every check runs (flags, the model
and head directories, the trained depth, every benchmark row) and the process exits 0 before the engine
starts or anything is written (`examples/scripts/evaluate.sh` is tested this way).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from openrlhf_growmtp.cli.train_ppo_ray import DRY_RUN_ENV
from openrlhf_growmtp.core.checkpoint import HeadCheckpointError, check_head_dir, resolve_backbone

METRICS = {"math": "Mean@{n}", "code": "Pass@{n}"}
DEFAULT_SAMPLES = {"math": 16, "code": 4}


@dataclass
class BenchmarkResult:
    name: str
    kind: str  # "math" | "code"
    metric: str  # "Mean@16" | "Pass@4"
    quality: float  # in [0, 1]
    problems: int
    samples_per_problem: int
    tau: float
    alpha: list[float]
    cycles: int
    accepted_tokens: int
    generated_tokens: int
    wall_s: float


def parse_benchmarks(specs: list[str], kind: str) -> list[tuple[str, str, Path]]:
    out = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--{kind} takes NAME=PATH, got {spec!r}")
        if not Path(path).is_file():
            raise SystemExit(f"--{kind} {name}: {path} is not a file (write it with "
                             "python -m openrlhf_growmtp.cli.prepare_data)")
        out.append((name, kind, Path(path)))
    return out


def read_rows(path: Path, kind: str) -> list[dict]:
    """The benchmark's rows, every one checked before the engine starts (code labels must parse)."""
    from openrlhf_growmtp.rewards.code.label import parse_label

    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for i, row in enumerate(rows):
        missing = [key for key in ("prompt", "label") if key not in row]
        if missing:
            raise SystemExit(f"{path}: row {i} has no {missing[0]!r} field")
        if kind == "code":
            try:
                parse_label(row["label"])
            except (ValueError, TypeError) as error:
                raise SystemExit(f"{path}: row {i} label: {error}") from None
    return rows


def encode_prompt(tokenizer, prompt) -> list[int]:
    """Chat messages through the tokenizer's chat template (plain text when it has none)."""
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True))
    return tokenizer("\n".join(m["content"] for m in prompt), add_special_tokens=False)["input_ids"]


def scorer(kind: str, time_limit_s: float):
    if kind == "math":
        from openrlhf_growmtp.rewards.math.score import math_score, rule_from_env

        rule = rule_from_env()
        return lambda response, label: math_score(response, label, rule)
    from openrlhf_growmtp.rewards.code.judge import extract_program
    from openrlhf_growmtp.rewards.code.label import parse_label
    from openrlhf_growmtp.rewards.code.sandbox import SandboxLimits, score_program

    limits = SandboxLimits(time_limit_s=time_limit_s)  # the evaluation's limit, not a label's own

    def code_score(response: str, label: str) -> float:
        parsed = parse_label(label)
        return score_program(extract_program(response), parsed.tests, limits, call=parsed.fn_name)

    return code_score


def quality(kind: str, scores: list[list[float]]) -> float:
    """Mean@n (math): mean over problems of the mean score; Pass@n (code): fraction with any full pass."""
    if kind == "math":
        per_problem = [sum(s) / len(s) for s in scores]
    else:
        per_problem = [float(any(v >= 1.0 for v in s)) for s in scores]
    return sum(per_problem) / max(len(per_problem), 1)


def evaluate(engine, tokenizer, name: str, kind: str, rows: list[dict], samples: int, sampling, time_limit_s: float,
             generations) -> BenchmarkResult:
    prompts = [encode_prompt(tokenizer, row["prompt"]) for row in rows]
    result = engine.generate([p for p in prompts for _ in range(samples)], sampling)
    score = scorer(kind, time_limit_s)
    scores = []
    for i, row in enumerate(rows):
        texts = [tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)
                 for out in result.outputs[i * samples:(i + 1) * samples]]
        row_scores = [float(score(text, row["label"])) for text in texts]
        scores.append(row_scores)
        for text, value in zip(texts, row_scores):
            generations.write(json.dumps({"benchmark": name, "id": row.get("id", i), "response": text,
                                          "score": value}) + "\n")
    acceptance = result.metrics.acceptance
    return BenchmarkResult(name=name, kind=kind, metric=METRICS[kind].format(n=samples),
                           quality=quality(kind, scores), problems=len(rows), samples_per_problem=samples,
                           tau=acceptance.tau, alpha=acceptance.alpha, cycles=acceptance.cycles,
                           accepted_tokens=acceptance.accepted_tokens,
                           generated_tokens=result.metrics.generated_tokens, wall_s=result.metrics.wall_s)


def table(results: list[BenchmarkResult], k: int) -> str:
    lines = [f"{'benchmark':<16}{'metric':>9}{'quality':>9}{'τ':>7}  α_1..α_{k}"]
    for r in results:
        lines.append(f"{r.name:<16}{r.metric:>9}{100 * r.quality:9.2f}{r.tau:7.3f}  "
                     + " ".join(f"{a:.2f}" for a in r.alpha))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m openrlhf_growmtp.cli.evaluate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the policy (an HF directory, e.g. a run's final export)")
    parser.add_argument("--head", required=True, help="the head directory (e.g. <final export>/growmtp_head)")
    parser.add_argument("--k", type=int, help="drafting depth (default: the depth the head was trained at)")
    parser.add_argument("--math", action="append", default=[], metavar="NAME=PATH", help="a math benchmark")
    parser.add_argument("--code", action="append", default=[], metavar="NAME=PATH", help="a code benchmark")
    parser.add_argument("--math-samples", type=int, default=DEFAULT_SAMPLES["math"], help="n of Mean@n")
    parser.add_argument("--code-samples", type=int, default=DEFAULT_SAMPLES["code"], help="n of Pass@n")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=0.7)
    parser.add_argument("--max-tokens", type=int, default=16384)
    parser.add_argument("--time-limit-s", type=float, default=6.0, help="per code test case")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="directory for eval.json and generations.jsonl")
    parser.add_argument("--dtype", default=None, help="engine dtype (default bfloat16; float32 on CPU)")
    parser.add_argument("--max-model-len", type=int, default=None)
    return parser


def main(argv: list[str] | None = None, engine_factory=None) -> int:
    """Run the evaluation; `engine_factory(model, head, k, **kwargs)` replaces SpecEngine (tests pass one that
    keeps a handle on the engine)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    benchmarks = parse_benchmarks(args.math, "math") + parse_benchmarks(args.code, "code")
    if not benchmarks:
        parser.error("give at least one --math or --code benchmark")
    for flag, value in (("--math-samples", args.math_samples), ("--code-samples", args.code_samples),
                        ("--max-tokens", args.max_tokens)):
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    if not 0 < args.top_p <= 1:
        parser.error(f"--top-p must be in (0, 1], got {args.top_p}")
    if not (math.isfinite(args.time_limit_s) and args.time_limit_s > 0):
        parser.error(f"--time-limit-s must be a finite number of seconds > 0, got {args.time_limit_s}")
    if any(kind == "math" for _, kind, _ in benchmarks):
        from openrlhf_growmtp.rewards.math.score import rule_from_env

        try:  # the scorer reads it after the engine has generated: an unknown rule would lose the whole run
            rule_from_env()
        except (ValueError, ImportError) as err:
            parser.error(str(err))
    model = Path(args.model)
    if model.exists() and not (model / "config.json").is_file():
        parser.error(f"--model {args.model}: not a model directory (no config.json)")
    policy = None
    if model.is_dir():
        try:
            family, text, _ = resolve_backbone(model)
        except (KeyError, ValueError) as err:
            parser.error(f"--model {args.model}: {err}")
        policy = (family, text, str(model))
    try:  # the head checked whole, and against the policy where the policy is a local directory
        head_config = check_head_dir(args.head, policy)
    except (HeadCheckpointError, ValueError) as err:
        parser.error(f"--head: {err}")
    k = args.k if args.k is not None else getattr(head_config, "growmtp_trained_k", None)
    if not k or k < 1:
        parser.error(f"{args.head} does not record the depth it was trained at: pass --k")
    max_depth = getattr(head_config, "max_draft_depth", None)
    if max_depth is not None and k > max_depth:
        parser.error(f"--k {k} is deeper than the head at {args.head} drafts (max_draft_depth {max_depth})")
    if not (math.isfinite(args.temperature) and args.temperature > 0):
        parser.error("speculative decoding here verifies by rejection sampling: --temperature must be > 0")
    rows = {name: read_rows(path, kind) for name, kind, path in benchmarks}
    if os.environ.get(DRY_RUN_ENV) == "1":
        print(f"{DRY_RUN_ENV}=1: K={k}, " + ", ".join(f"{name} ({len(rows[name])} {kind} problems)"
                                                    for name, kind, _ in benchmarks)
              + ": passed every startup check; not starting the engine.")
        return 0

    import torch
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from openrlhf_growmtp import cpu_support

    if engine_factory is None:
        from vllm_patches.engine import SpecEngine as engine_factory
    cpu = cpu_support.needed()
    engine_kwargs = {"dtype": args.dtype or ("float32" if cpu else "bfloat16"), "seed": args.seed}
    if args.max_model_len:
        engine_kwargs["max_model_len"] = args.max_model_len
    if cpu:
        engine_kwargs["enforce_eager"] = True
    # capture=False: top-p truncation is fine for drafting and verification; τ comes from vLLM's counters
    engine = engine_factory(args.model, args.head, k, capture=False, **engine_kwargs)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                              seed=None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    results = []
    partial = out / "generations.jsonl.partial"  # renamed once whole: a run cut short leaves an earlier pair whole
    with partial.open("w") as generations:
        for name, kind, _ in benchmarks:
            samples = args.math_samples if kind == "math" else args.code_samples
            results.append(evaluate(engine, tokenizer, name, kind, rows[name], samples, sampling, args.time_limit_s,
                                    generations))
    (out / "eval.json").unlink(missing_ok=True)
    partial.replace(out / "generations.jsonl")
    report = {"model": args.model, "head": args.head, "k": k, "temperature": args.temperature, "top_p": args.top_p,
              "max_tokens": args.max_tokens, "wall_s": time.perf_counter() - began, "torch": torch.__version__,
              "benchmarks": [asdict(r) for r in results]}
    (out / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    print(table(results, k))
    print(f"wrote {out / 'eval.json'} and {out / 'generations.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
