"""The vLLM engine settings this launcher adds to upstream's `--vllm.*` group, and their checks.

- `--vllm.max_num_seqs N`: vLLM's `max_num_seqs` for every engine (the requests it decodes at once); the
  old name `--growmtp_max_num_seqs` (and `--growmtp.max_num_seqs`) is kept as an alias.
- `--vllm.runner {default,growmtp}`: which model runner and scheduling the engines get. A GrowMTP run
  (K > 0) always runs `growmtp`: vLLM's V1 model runner with synchronous scheduling, which record capture
  needs. A K = 0 run gets vLLM's defaults (on a GPU: the V2 runner, asynchronous scheduling) unless asked for
  `growmtp`: an autoregressive baseline on the same runner and scheduling as GrowMTP's engines.

Both apply with `--growmtp_k 0` too, so that the two arms of a comparison can decode alike.
"""

from __future__ import annotations

import argparse

RUNNERS = ("default", "growmtp")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Register the flags on upstream's parser (idempotent)."""
    if any(action.dest == "vllm.max_num_seqs" for action in parser._actions):
        return
    group = parser.add_argument_group("vLLM engine settings added by GrowMTP (apply with --growmtp_k 0 too)")
    group.add_argument("--vllm.max_num_seqs", "--growmtp_max_num_seqs", "--growmtp.max_num_seqs",
                       dest="vllm.max_num_seqs", type=int, default=None, metavar="N",
                       help="vLLM's max_num_seqs for every engine: the requests it decodes at once (default: "
                            "vLLM's); set it alike for a run and its baseline")
    group.add_argument("--vllm.runner", dest="vllm.runner", type=str, default=None, choices=RUNNERS,
                       help="growmtp: vLLM's V1 model runner with synchronous scheduling, as every GrowMTP engine "
                            "runs; default: vLLM's own choice (on a GPU the V2 runner, asynchronous scheduling). "
                            "Unset: growmtp with --growmtp_k > 0, default with --growmtp_k 0")


def runner(flat: dict) -> str:
    """The runner this run's engines get (`--vllm.runner`, or what K implies)."""
    chosen = flat.get("vllm.runner")
    return chosen if chosen is not None else ("growmtp" if flat.get("growmtp.k", 0) > 0 else "default")


def engine_kwargs(flat: dict) -> dict:
    """vLLM engine arguments of ours for every rollout actor (upstream's `create_vllm_engines` fixes its own)."""
    seqs = flat.get("vllm.max_num_seqs")
    return {} if seqs is None else {"max_num_seqs": seqs}


def check_engine_args(flat: dict) -> list[str]:
    errors = []
    seqs = flat.get("vllm.max_num_seqs")
    if seqs is not None and seqs < 1:
        errors.append(f"--vllm.max_num_seqs must be >= 1, got {seqs}")
    if flat.get("growmtp.k", 0) > 0 and flat.get("vllm.runner") == "default":
        errors.append("--vllm.runner default: a GrowMTP run (--growmtp_k > 0) captures records, which needs vLLM's "
                      "V1 model runner with synchronous scheduling (--vllm.runner growmtp, its default)")
    return errors
