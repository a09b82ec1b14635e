"""growmtp-make-head: write a head directory for a backbone (a local directory or a hub id), once, before training.

    growmtp-make-head --backbone /models/Qwen3-4B --out /heads/qwen3-4b-random            # from scratch, seed 0
    growmtp-make-head --backbone /models/MiMo-7B-SFT --native --out /heads/mimo-native   # the shipped head
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from openrlhf_growmtp.core.checkpoint import (HeadCheckpointError, export_head, load_native_head,
                                              materialize_random_head)
from openrlhf_growmtp.hub import local_dir

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="growmtp-make-head", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backbone", required=True,
                        help="model directory or hub id (its config.json, and its weights for --native)")
    parser.add_argument("--out", required=True, help="head directory to write: new, or empty")
    parser.add_argument("--seed", type=int, default=0, help="seed of the from-scratch init (default 0)")
    parser.add_argument("--native", action="store_true", help="extract the model's own MTP head instead")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    args = parser.parse_args(argv)
    out_dir = Path(args.out)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        # a head's files have a model's names (config.json, model.safetensors): never write over a directory
        print(f"growmtp-make-head: --out {out_dir} exists and is not an empty directory; it writes a new one "
              "(remove it, or choose another --out)", file=sys.stderr)
        return 2
    try:
        backbone = local_dir(args.backbone, weights=args.native)
        if args.native:
            out = export_head(load_native_head(backbone, dtype=DTYPES[args.dtype]), args.out)
        else:
            out = materialize_random_head(backbone, args.out, seed=args.seed, dtype=DTYPES[args.dtype])
    except (HeadCheckpointError, ValueError) as err:
        print(f"growmtp-make-head: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
