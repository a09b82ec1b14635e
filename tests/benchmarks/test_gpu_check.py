"""`benchmarks/gpu_check.py --tiny` runs on CPU, every check passes and the JSON holds every field, so the
check a lent GPU machine runs cannot rot between loans; its statistical sampler check has the power to fail;
`--only` runs a subset and a run cut off (deadline, SIGTERM) leaves its JSON; the pieces of the two newer
checks (the cached forward, the reference drafter's arithmetic, the cycle formula) hold on their own."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(ROOT / "benchmarks"))  # the benchmarks' modules, as the script itself sees them

import bench_cycle_formula  # noqa: E402
import gpu_cycle  # noqa: E402
import gpu_drafter  # noqa: E402
import gpu_sampler  # noqa: E402
from bench_common import fit_line, qwen3_4b_config  # noqa: E402
from gpu_world import TINY, tiny_config  # noqa: E402

SECTIONS = {"environment", "shapes", "rows", "errors", "complete", "cut_off", "checks", "all_passed", "seconds",
            "reconstruction", "alpha", "rejection_sampler", "head_update_cost", "trainer_step", "cycle_cost"}
COST_FIELDS = {"responses", "responses_asked", "scaled_by_budget", "tokens", "cycles", "tau", "k", "chunk_cycles",
               "micro_batch", "repeats", "median_s", "peak_mb", "hidden_states_mb", "time_ratio",
               "time_ratio_with_own_forward", "memory_ratio"}


def _env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


def test_tiny_gpu_check_passes_on_cpu_and_writes_every_field(tmp_path):
    out = tmp_path / "sub" / "gpu_check.json"
    proc = _run("--tiny", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "every check passed" in proc.stdout
    result = json.loads(out.read_text())
    assert SECTIONS <= set(result), SECTIONS - set(result)
    assert result["complete"] and result["all_passed"] and not result["errors"] and result["cut_off"] is None
    assert result["shapes"]["k"] == 5 and result["shapes"]["topk"] == 64 and result["shapes"]["tie_word_embeddings"]
    rows = result["rows"]
    assert {r["check"] for r in rows} == {"a", "b", "c", "d", "trainer_step", "cycle_cost"}
    judged = [r for r in rows if r["passed"] is not None]
    assert len(judged) >= 13 and all(r["passed"] for r in judged)
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
    _check_trainer_step(result["trainer_step"])
    _check_cycle_cost(result["cycle_cost"], trainer=result["trainer_step"])


def _check_trainer_step(trainer):
    # the GPU machine's environment, rehearsed: Ray and vLLM were never imported, only stood in for
    assert trainer["standins"] == ["ray", "vllm"]
    assert trainer["layers"] == TINY.trainer_layers and trainer["steps"] == TINY.trainer_steps
    assert trainer["policy_tensors_differing"] == [] and trainer["policy_tensors_trained"] > 0
    assert trainer["head_matrices_moved"] == trainer["head_matrices"] and len(trainer["head_matrices"]) == 8
    status = trainer["status_with_head"]
    # the paper's layout: one policy step per RL step, the head reading H_p from the policy's own forward
    assert status["growmtp/head_hidden_from_forward"] == 1.0 and status["growmtp/head_steps"] == 1.0
    assert status["growmtp/head_cycles"] == trainer["cycles"] and status["growmtp/head_finite"] == 1.0
    assert 0 < trainer["head_share_of_step"] < 1 and trainer["step_ratio_with_over_without"] > 0
    assert 1.0 < trainer["tau"] <= TINY.k + 1
    # the drafter's phases account for its loop's time (where a device's seconds go is read from them)
    drafter = trainer["drafter"]
    assert set(drafter["phases"]) == {"prefill", "head", "verify", "sampling", "commit"}
    assert sum(drafter["phases"].values()) == pytest.approx(drafter["seconds"], rel=0.05)
    # the policy's loss and gradient norm are upstream's too (the head's gradients are not in the norm)
    for key in ("policy_loss", "actor_grad_norm"):
        assert status[key] == trainer["status_without_head"][key], key


def _check_cycle_cost(cycle, trainer=None):
    contexts = [str(c) for c in TINY.cycle_contexts]
    assert sorted(cycle["per_context"], key=int) == contexts and cycle["depths"] == list(TINY.cycle_depths)
    for c in contexts:
        p, t = cycle["per_context"][c], cycle["at_real_layers"][c]
        assert p["cycle_s"] > 0 and t["decode_s"] > 0 and t["verify_s"] > 0 and t["draft_s"] > 0
        assert abs(p["break_even_tau"] * t["decode_s"] - p["cycle_s"]) < 1e-9 * p["cycle_s"] + 1e-15
    assert cycle["rollout"]["speedup"] > 0
    # what the CPU check of the formula found missing is said to be missing (bench_cycle_formula.py)
    assert {"the prefill", "a spec batch's cycles: as many as its slowest sequence needs"} <= set(cycle["leaves_out"])
    if trainer is None:
        assert cycle["end_to_end"] is None
    else:
        e2e = cycle["end_to_end"]
        assert e2e["speedup"] > 0 and e2e["speedup_with_paper_ar_split"] > 0 and e2e["train_s"] > 0


def test_only_runs_the_checks_named(tmp_path):
    out = tmp_path / "only.json"
    proc = _run("--tiny", "--only", "cycle_cost", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["checks"] == ["cycle_cost"] and result["complete"]
    assert {r["check"] for r in result["rows"]} == {"cycle_cost"}
    assert "reconstruction" not in result and "trainer_step" not in result
    _check_cycle_cost(result["cycle_cost"])  # without trainer_step: no end-to-end prediction
    assert "not predicted" in proc.stdout


def test_only_refuses_an_unknown_check():
    proc = _run("--tiny", "--only", "a,e", timeout=120)
    assert proc.returncode == 2 and "--only takes checks among" in proc.stderr


def test_a_run_past_its_deadline_records_what_it_skipped(tmp_path):
    out = tmp_path / "late.json"
    proc = _run("--tiny", "--only", "c,cycle_cost", "--deadline-s", "0", "--json", str(out))
    assert proc.returncode == 1
    result = json.loads(out.read_text())
    assert not result["complete"] and result["cut_off"]["reason"] == "deadline"
    assert [r["name"].split(":")[0] for r in result["rows"]] == ["not run", "not run"]


def test_sigterm_leaves_the_json_of_what_was_done(tmp_path):
    out = tmp_path / "term.json"
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--tiny", "--only", "a,b,d,c,cycle_cost", "--json", str(out)],
                            cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not out.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # the JSON is first written once the run has started
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 124, stdout[-3000:] + stderr[-3000:]
    result = json.loads(out.read_text())
    assert not result["complete"] and result["cut_off"]["reason"] == "SIGTERM"
    assert "cut off" in stderr


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


def _model(layers):
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    config = tiny_config(layers)
    config._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(config).eval()


def _caches(model, batch=3, capacity=32):
    return gpu_cycle.policy_caches(model, batch, capacity)


def test_cached_forward_is_the_models_forward():
    model = _model(2)
    ids = torch.randint(0, model.config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        caches = _caches(model)
        prefix = gpu_cycle.cached_forward(model, ids[:, :12], caches, causal=True)
        decode = gpu_cycle.cached_forward(model, ids[:, 12:13], caches)
        causal = gpu_cycle.cached_forward(model, ids[:, 13:19], caches, causal=True)
        for cache in caches:
            cache.reset(13)
        unmasked = gpu_cycle.cached_forward(model, ids[:, 13:19], caches)
    torch.testing.assert_close(torch.cat([prefix, decode, causal], 1), want[:, :19], rtol=1e-5, atol=1e-5)
    # the timed verify (no mask) lets its 6 new tokens see each other: values the check does not use
    assert (unmasked[:, 0] - causal[:, 0]).abs().max() > 1e-3


def test_unmasked_verify_does_the_causal_verifys_work():
    # one layer: the last new token's keys and values come from the embeddings alone, so without the mask it
    # attends to exactly the keys the causal verify gives it, and its logits match
    model = _model(1)
    ids = torch.randint(0, model.config.vocab_size, (3, 19), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        caches = _caches(model)
        gpu_cycle.cached_forward(model, ids[:, :13], caches, causal=True)
        causal = gpu_cycle.cached_forward(model, ids[:, 13:], caches, causal=True)
        for cache in caches:
            cache.reset(13)
        unmasked = gpu_cycle.cached_forward(model, ids[:, 13:], caches)
    torch.testing.assert_close(unmasked[:, -1], causal[:, -1], rtol=1e-5, atol=1e-5)


def test_kv_buffer_writes_in_place_and_refuses_to_overflow():
    buffer = gpu_cycle.KVBuffer(1, 1, 4, 2, "cpu", torch.float32)
    keys, _ = buffer.update(torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2))
    assert keys.shape[2] == 3 and keys.data_ptr() == buffer.keys.data_ptr()
    buffer.reset(1)
    keys, _ = buffer.update(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))
    assert keys.shape[2] == 3 and float(keys[0, 0, 0, 0]) == 1.0 and float(keys[0, 0, 1:].abs().sum()) == 0.0
    with pytest.raises(ValueError, match="holds 4 positions"):
        buffer.update(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))


def test_cycle_formula():
    # at the break-even tau drafting neither gains nor loses; at tau = 1 a cycle can only lose
    p = gpu_cycle.cycle_prediction(decode=2.0, verify=3.0, draft=0.2, k=5, tau=2.91)
    assert p["cycle_s"] == pytest.approx(4.0) and p["break_even_tau"] == pytest.approx(2.0)
    at_break_even = gpu_cycle.cycle_prediction(2.0, 3.0, 0.2, 5, p["break_even_tau"])
    assert at_break_even["speedup"] == pytest.approx(1.0)
    assert gpu_cycle.cycle_prediction(2.0, 3.0, 0.2, 5, 1.0)["speedup"] < 1
    # linear costs in the context: the whole response is the fit at its mean context, once per step
    rollout = gpu_cycle.rollout_prediction([0, 100], [1.0, 2.0], [2.0, 4.0], tau=4.0, prompt=0, response=100)
    assert rollout["ar_s"] == pytest.approx(150.0) and rollout["spec_s"] == pytest.approx(75.0)
    # end to end: only the rollout part speeds up, and the head update adds to the step
    assert gpu_cycle.step_prediction(rollout_ar=60.0, rollout_speedup=2.0, train=40.0, head=0.0) == pytest.approx(100 / 70)
    assert gpu_cycle.step_prediction(60.0, 2.0, 40.0, 10.0) == pytest.approx(100 / 80)


def test_engine_formula_is_the_cycle_formula_plus_what_it_measures():
    # bench_cycle_formula: with no prefill, no engine overhead and a free head, the prefill step gives a request's
    # first token and each later step 1 (AR) or tau (spec): 91 tokens in 91 or 1 + 90 / 3 steps
    engine = bench_cycle_formula.generate_wall
    ar = engine(prefill=0.0, first=0.0, step=2.0, steps=91, overhead=0.0)
    spec = engine(prefill=0.0, first=0.0, step=3.0, steps=1 + 30, overhead=0.0)
    assert ar / spec == pytest.approx(gpu_cycle.cycle_prediction(2.0, 3.0, 0.0, 5, tau=3.0)["speedup"])
    # the overhead is what a wall leaves over the timed parts, per step
    wall = engine(prefill=0.7, first=0.3, step=2.0, steps=31, overhead=0.25)
    assert bench_cycle_formula.step_overhead(wall, prefill=0.7, first=0.3, step=2.0, steps=31) == pytest.approx(0.25)
    # the same cost per step on both sides weighs more on the side with more steps: the speedup moves from the
    # cycle formula's toward the ratio of the step counts
    with_overhead = engine(0.0, 0.0, 2.0, 91, 1.0) / engine(0.0, 0.0, 3.0, 31, 1.0)
    assert ar / spec < with_overhead < 91 / 31


def test_engine_cost_is_read_at_the_target_depth_on_the_line_through_the_shallow_ones():
    assert bench_cycle_formula.at_depth([1, 4], [0.5, -1.0], 8) == pytest.approx(-3.0)
    assert bench_cycle_formula.at_depth([1], [0.5], 8) == 0.5


def test_engine_gemms_compute_what_torch_linear_computes():
    # vLLM's CPU GEMM (oneDNN or sgl-kernel) in place of torch's: both accumulate in fp32 and round to bf16, so
    # an output may differ by one rounding, at most 2^-7 of its magnitude (bf16 keeps 8 significant bits)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96, bias=False), torch.nn.Linear(96, 32)).to(torch.bfloat16)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = [model[0](x)]
        expected.append(model[1](expected[0]))
        bench_cycle_formula.with_engine_gemms(model)
        assert all(hasattr(layer, "cpu_linear") for layer in model)
        got = [model[0](x), model[1](expected[0])]
    for e, g in zip(expected, got):
        e, g = e.float(), g.float()
        assert ((e - g).abs() <= 2 ** -7 * torch.maximum(e.abs(), g.abs()) + 1e-6).all()


def test_fit_line_recovers_a_line_and_reports_residuals():
    fit = fit_line([1, 2, 3, 4], [3.0, 5.0, 7.0, 9.5])
    assert fit.b == pytest.approx(2.15) and fit.at(0) == pytest.approx(0.75)
    assert sum(fit.residuals) == pytest.approx(0.0, abs=1e-12) and max(map(abs, fit.residuals)) > 0.1
    with pytest.raises(ValueError):
        fit_line([2, 2], [1.0, 2.0])
    # a time that falls with the size is noise: the least-squares line would extrapolate it below zero
    falling = [3.0e-3, 2.0e-3, 1.6e-3]
    assert fit_line([1, 2, 3], falling).at(36) < 0 and not fit_line([1, 2, 3], falling).clipped
    flat = fit_line([1, 2, 3], falling, nonnegative_slope=True)
    assert flat.clipped and flat.b == 0 and flat.at(36) == pytest.approx(sum(falling) / 3)
    assert not fit_line([1, 2, 3, 4], [3.0, 5.0, 7.0, 9.5], nonnegative_slope=True).clipped


def test_alpha_for_tau_inverts_the_acceptance_length():
    for tau in (1.0, 2.91, 4.5):
        a = gpu_drafter.alpha_for_tau(tau, 5)
        assert sum(a ** i for i in range(6)) == pytest.approx(tau, abs=1e-9)
    with pytest.raises(ValueError):
        gpu_drafter.alpha_for_tau(6.5, 5)


def test_trainer_layers_follow_the_devices_memory():
    from gpu_trainer import layers_that_fit

    config = qwen3_4b_config(36)
    h100, h200 = layers_that_fit(config, 80 * 10**9), layers_that_fit(config, 141 * 10**9)
    assert 1 <= h100 < h200 <= 36
    assert layers_that_fit(config, 10**12) == 36 and layers_that_fit(config, 10**9) == 1


def test_trainer_step_gives_back_the_determinism_it_switched_on(monkeypatch):
    """Upstream's --train.full_determinism_enable switches deterministic algorithms on for the whole process;
    the checks run after trainer_step must find the process as it was (they are timed)."""
    import random

    import numpy as np
    from gpu_trainer import DETERMINISM_ENV, determinism_restored
    from transformers.trainer_utils import enable_full_determinism

    for name in DETERMINISM_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # what gpu_check sets before any check
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
              torch.backends.cudnn.benchmark)
    rng = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        with determinism_restored():
            enable_full_determinism(1)
            assert torch.are_deterministic_algorithms_enabled() and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    finally:
        random.setstate(rng[0]), np.random.set_state(rng[1]), torch.set_rng_state(rng[2])
    assert (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
            torch.backends.cudnn.benchmark) == before
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert not {"CUDA_LAUNCH_BLOCKING", "FLASH_ATTENTION_DETERMINISTIC"} & set(os.environ)
