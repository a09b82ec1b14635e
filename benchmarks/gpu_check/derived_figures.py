"""The GPU figures docs quote, each named measured or derived, from the kept JSONs of one GPU session.

    python -m benchmarks.gpu_check.derived_figures                       # prints; --out keeps the JSON
    python -m benchmarks.gpu_check.derived_figures --out docs/data/gpu/derived_2026-11-27.json

Reads the H100 session of 2026-11-27 (docs/data/gpu/): `rollout_loop` (the CUDA-graph draft-and-verify loop,
timed at 27 and 13 layers) and `trainer_step` + `cycle_cost` (the ZeRO-3 step under strict determinism at 13
layers, eager per-operator times at 2-8 layers). Nothing is timed here: every figure is either a value a check
measured (copied with where it came from) or one computed from such values by the formula beside it
(`gpu_cycle.end_to_end` for the whole step). `tests/benchmarks/test_gpu_derived_figures.py` recomputes the kept
file, so it cannot drift from its inputs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.gpu_check.gpu_cycle import end_to_end
from benchmarks.gpu_check.gpu_world import REAL

ROOT = Path(__file__).resolve().parents[2]

LOOP = ROOT / "docs/data/gpu/rollout_loop_2026-11-27.json"
STEP = ROOT / "docs/data/gpu/trainer_step_head_update_graph_cycle_cost_2026-11-27.json"


def fit_at(fit: dict, x: float) -> float:
    return fit["a"] + fit["b"] * x


def derive(loop_doc: dict, step_doc: dict) -> dict:
    loop, cycle, trainer = loop_doc["rollout_loop"], step_doc["cycle_cost"], step_doc["trainer_step"]
    graph = step_doc["head_update_graph"]
    if step_doc["shapes"]["plan"] != REAL.name:
        raise ValueError(f"the session's plan is {step_doc['shapes']['plan']!r}, not {REAL.name!r}")
    _, e2e = end_to_end(REAL, cycle, trainer, loop)
    layers = trainer["layers"]
    step_per_token = trainer["step_s_without_head"] / trainer["tokens"]
    # cycle_cost's line through the plain forward and backward at 2-8 layers, per token, at the step's depth
    plain_per_token = fit_at(cycle["train_fit"], layers) / cycle["train_tokens"]
    measured_27 = {context: {tau: row["speedup"] for tau, row in found["measured"][str(loop["layers_measured"])]
                             ["taus"].items()} for context, found in loop["per_context"].items()}
    return {
        "inputs": {"rollout_loop": str(LOOP.relative_to(ROOT)), "trainer_step_cycle_cost": str(STEP.relative_to(ROOT))},
        "rollout": {
            "measured_layers": loop["depths"],
            "measured_speedup_at_27_layers": measured_27,  # per context, at each calibrated τ (measured)
            # 36 layers read off the line through the two measured depths, per context (derived)
            "derived_36_layers_at_2_91": {c: found["at_real_layers"]["speedup_at_paper_tau"]
                                          for c, found in loop["per_context"].items()},
            "derived_36_layers_break_even_tau": {c: found["at_real_layers"]["break_even_tau"]
                                                 for c, found in loop["per_context"].items()},
            "derived_speedup_8k_response": loop["rollout"]["speedup"],  # 36 layers and a linear fit in context
        },
        "training": {
            "layers": layers, "tokens": trainer["tokens"], "strict_determinism": True,
            "step_s_per_token": step_per_token,
            "plain_fwd_bwd_s_per_token": plain_per_token,
            "strict_step_over_plain_per_token": step_per_token / plain_per_token,
            "token_scale": e2e["tokens_per_gpu"] / trainer["tokens"],
            "depth_scale": e2e["depth_scale"],
            "total_scale": e2e["tokens_per_gpu"] / trainer["tokens"] * e2e["depth_scale"],
        },
        "head_update": {
            "trainer_s_per_cycle": trainer["head_update_s"] / trainer["cycles"],
            "cycles_scale": e2e["cycles_per_gpu"] / trainer["cycles"],
            "graph_eager_s_per_cycle_4096": graph["per_chunk"]["4096"]["eager_s"] / graph["cycles"],
            "graph_captured_s_per_cycle_4096": graph["per_chunk"]["4096"]["graph_s"] / graph["cycles"],
        },
        # the step with the head started while the run without it still held memory: compare rises, not peaks
        "memory_rise_mb": {arm: found["peak"] - found["at_start"] for arm, found in trainer["memory_mb"].items()},
        "end_to_end": {key: e2e[key] for key in ("rollout_ar_s", "rollout_speedup", "train_s", "head_s", "speedup",
                                                  "speedup_with_paper_ar_split")},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    found = derive(json.loads(LOOP.read_text()), json.loads(STEP.read_text()))
    if args.out:
        from openrlhf_growmtp.measure.provenance import provenance

        found["provenance"] = provenance()
    text = json.dumps(found, indent=1) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
