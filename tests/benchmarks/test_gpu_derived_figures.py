"""The derived GPU figures the docs quote are what their kept inputs give: the kept file is recomputed from the
session's JSONs, and the whole step's figure is the one the GPU check's own formula gives from them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.gpu_check import derived_figures as gpu_derived_figures

ROOT = Path(__file__).resolve().parents[2]

KEPT = ROOT / "docs" / "data" / "gpu" / "derived_2026-11-27.json"


def test_the_kept_derived_figures_follow_from_their_inputs():
    kept = json.loads(KEPT.read_text())
    kept.pop("provenance")
    found = gpu_derived_figures.derive(json.loads(gpu_derived_figures.LOOP.read_text()),
                                       json.loads(gpu_derived_figures.STEP.read_text()))
    assert json.loads(json.dumps(found)) == kept


def test_the_strict_step_per_token_against_the_plain_forward_and_backward():
    kept = json.loads(KEPT.read_text())["training"]
    step = json.loads(gpu_derived_figures.STEP.read_text())
    trainer, fit = step["trainer_step"], step["cycle_cost"]["train_fit"]
    per_token_plain = (fit["a"] + fit["b"] * trainer["layers"]) / step["cycle_cost"]["train_tokens"]
    assert kept["strict_step_over_plain_per_token"] == pytest.approx(
        trainer["step_s_without_head"] / trainer["tokens"] / per_token_plain)
    assert kept["total_scale"] == pytest.approx(kept["token_scale"] * kept["depth_scale"])
