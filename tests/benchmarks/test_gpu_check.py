"""`benchmarks/gpu_check.py --tiny` runs on CPU, every check passes and the JSON holds every field, so the
check a lent GPU machine runs cannot rot between loans; its statistical sampler check has the power to fail."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(ROOT / "benchmarks"))  # the benchmarks' modules, as the script itself sees them

import gpu_sampler  # noqa: E402

SECTIONS = {"environment", "shapes", "rows", "errors", "complete", "all_passed", "seconds", "reconstruction",
            "alpha", "rejection_sampler", "head_update_cost"}
COST_FIELDS = {"responses", "responses_asked", "scaled_by_budget", "tokens", "cycles", "tau", "k", "chunk_cycles",
               "micro_batch", "repeats", "median_s", "peak_mb", "hidden_states_mb", "time_ratio",
               "time_ratio_with_own_forward", "memory_ratio"}


def _run(*args, timeout=300):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_tiny_gpu_check_passes_on_cpu_and_writes_every_field(tmp_path):
    out = tmp_path / "sub" / "gpu_check.json"
    proc = _run("--tiny", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "every check passed" in proc.stdout
    result = json.loads(out.read_text())
    assert SECTIONS <= set(result), SECTIONS - set(result)
    assert result["complete"] and result["all_passed"] and not result["errors"]
    assert result["shapes"]["k"] == 5 and result["shapes"]["topk"] == 64 and result["shapes"]["tie_word_embeddings"]
    rows = result["rows"]
    assert {r["check"] for r in rows} == {"a", "b", "c", "d"}
    judged = [r for r in rows if r["passed"] is not None]
    assert len(judged) >= 10 and all(r["passed"] for r in judged)
    for row in rows:  # the table printed what the JSON holds
        assert row["name"] in proc.stdout and row["measured"] in proc.stdout
    # the bounds are not vacuous: a wrong key or position would move log q by far more than they allow
    recon = result["reconstruction"]
    for dtype in ("bfloat16", "float32"):
        assert recon[dtype]["log_q"]["tolerance"] < 0.1 * recon["depth_to_depth_max_abs_dlogq"]
        assert recon[dtype]["gradients"]["min_cosine_vs_fp64"] > 0.99
    # nor is fp32's wider factor: a path that slipped into bf16 would fail it. bf16 rounds 2^16 x as much as
    # fp32, the bound sits 2^6.5 above fp32's rounding, so ~2^9.5 below bf16's; 0.1 leaves 2^6 for the statistics
    fp32, bf16 = recon["float32"], recon["bfloat16"]
    assert fp32["log_q"]["tolerance"] < 0.1 * bf16["log_q"]["eps"]
    for name, tensor in fp32["gradients"]["tensors"].items():
        assert tensor["tolerance"] < 0.1 * bf16["gradients"]["tensors"][name]["eps_l2"], name
    assert 0.0 < result["alpha"]["mean_outside_mass"] < 0.5  # the top-64 truncates, and keeps most mass
    cost = result["head_update_cost"]
    assert COST_FIELDS <= set(cost), COST_FIELDS - set(cost)
    assert cost["time_ratio"] > 0 and cost["memory_ratio"] is None  # peak memory is read on CUDA only


@pytest.mark.skipif(torch.cuda.is_available(), reason="refusal is what a machine without CUDA shows")
def test_real_shapes_refuse_without_cuda_before_any_work(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = _run("--json", str(out), timeout=120)
    assert proc.returncode == 2
    assert "CUDA" in proc.stderr and "--tiny" in proc.stderr
    assert not out.exists()


def test_bad_arguments_are_refused_by_name():
    proc = _run("--tiny", "--responses", "2", "--micro-batch", "4", timeout=120)
    assert proc.returncode == 2 and "--micro-batch 4 is more than --responses 2" in proc.stderr


def _pair(vocab=400, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(3, vocab, generator=g, dtype=torch.float64) * 2).softmax(-1)
    p = (torch.randn(4, vocab, generator=g, dtype=torch.float64) * 2).softmax(-1)
    p[:3] = (0.5 * p[:3] + 0.5 * q)  # overlapping, as a partly trained head's are
    return p, q


def test_sampler_statistics_hold_for_rejection_sampling():
    p, q = _pair()
    accepted, emitted = gpu_sampler.rejection_sample(p, q, 2**16, torch.Generator().manual_seed(1))
    stats = gpu_sampler.sampler_statistics(p, q, accepted, emitted)
    assert abs(stats["z_first"]) <= gpu_sampler.Z_LIMIT and abs(stats["z_mean"]) <= gpu_sampler.Z_LIMIT
    assert all(pos["p_value"] >= gpu_sampler.P_MIN for pos in stats["positions"])
    assert 0.3 < stats["alpha"][0] < 0.95  # neither side of min() always wins


def test_sampler_statistics_catch_a_sampler_that_recovers_from_p_instead_of_the_residual():
    p, q = _pair()
    g = torch.Generator().manual_seed(1)
    accepted, emitted = gpu_sampler.rejection_sample(p, q, 2**16, g)
    wrong = emitted.clone()
    stopped = accepted == 0  # rejected at the first position: a wrong sampler draws the replacement from p
    wrong[stopped, 0] = torch.multinomial(p[0], int(stopped.sum()), replacement=True, generator=g)
    stats = gpu_sampler.sampler_statistics(p, q, accepted, wrong)
    assert stats["positions"][0]["p_value"] < gpu_sampler.P_MIN


def test_sampler_statistics_catch_a_sampler_with_target_and_draft_swapped():
    p, q = _pair()
    g = torch.Generator().manual_seed(2)
    swapped_p, swapped_q = torch.cat([q, p[3:]]), p[:3]  # drafts from p, accepted with min(1, q/p)
    accepted, emitted = gpu_sampler.rejection_sample(swapped_p, swapped_q, 2**16, g)
    stats = gpu_sampler.sampler_statistics(p, q, accepted, emitted)
    assert abs(stats["z_first"]) <= gpu_sampler.Z_LIMIT  # sum min(p, q) is symmetric: acceptance cannot tell
    assert stats["positions"][0]["p_value"] < gpu_sampler.P_MIN  # what it emits can
