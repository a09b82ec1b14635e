"""`benchmarks/gpu_check/gpu_check.py --tiny` runs on CPU, every check passes and the JSON holds every field, so the
check a GPU machine runs cannot rot between loans; its statistical sampler check has the power to fail;
`--only` runs a subset and a run cut off (deadline, SIGTERM) leaves its JSON; the pieces of the two newer
checks (the cached forward, the reference drafter's arithmetic and records, the cycle formula) hold on their own."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks import bench_cycle_formula
from benchmarks.gpu_check import gpu_cycle, gpu_drafter, gpu_loop, gpu_rollout_loop, gpu_sampler
from benchmarks.gpu_check.gpu_world import TINY, tiny_config
from benchmarks.shared import cycle_timing
from benchmarks.shared.bench_common import fit_line, qwen3_4b_config
from growmtp_lab import reference_drafting

ROOT = Path(__file__).resolve().parents[2]
CHECK = ["-m", "benchmarks.gpu_check.gpu_check"]

SECTIONS = {"environment", "shapes", "rows", "errors", "complete", "cut_off", "checks", "all_passed", "seconds",
            "reconstruction", "alpha", "rejection_sampler", "head_update_cost", "trainer_step", "cycle_cost",
            "rollout_loop", "head_update_graph"}
COST_FIELDS = {"responses", "responses_asked", "scaled_by_budget", "tokens", "cycles", "tau", "k", "chunk_cycles",
               "micro_batch", "repeats", "median_s", "peak_mb", "hidden_states_mb", "time_ratio",
               "time_ratio_with_own_forward", "memory_ratio"}


def _env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, *CHECK, *args], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def tiny_check(tmp_path_factory):
    """The whole check at tiny shapes, once for the tests below: trainer_step's strict runs only (two processes of
    their own; its production runs and a second depth are the slow test's), and --draft-vocab, which adds the
    subset's rows to the rollout loop, (c) and head_update_graph beside every id's, which stay as they are."""
    out = tmp_path_factory.mktemp("tiny") / "sub" / "gpu_check.json"
    proc = _run("--tiny", "--trainer-runs", "strict", "--draft-vocab", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc, json.loads(out.read_text()), out


def test_tiny_gpu_check_passes_on_cpu_and_writes_every_field(tiny_check):
    proc, result, out = tiny_check
    assert "every check passed" in proc.stdout
    assert SECTIONS <= set(result), SECTIONS - set(result)
    assert result["complete"] and result["all_passed"] and not result["errors"] and result["cut_off"] is None
    assert result["shapes"]["k"] == 5 and result["shapes"]["topk"] == 64 and result["shapes"]["tie_word_embeddings"]
    rows = result["rows"]
    assert {r["check"] for r in rows} == {"a", "b", "c", "d", "trainer_step", "cycle_cost", "rollout_loop",
                                          "head_update_graph"}
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
    _check_trainer_step(result["trainer_step"], out.parent, modes=("strict",))
    _check_cycle_cost(result["cycle_cost"], trainer=result["trainer_step"])
    _check_rollout_loop(result["rollout_loop"])
    _check_head_update_graph(result["head_update_graph"])
    assert result["cycle_cost"]["end_to_end"]["rollout_from"].startswith("rollout_loop")
    assert result["cycle_cost"]["end_to_end"]["rollout_speedup"] == result["rollout_loop"]["rollout"]["speedup"]


def _check_rollout_loop(loop):
    plan = gpu_rollout_loop.LOOP_PLANS["tiny"]
    assert loop["depths"] == [TINY.trainer_layers, TINY.trainer_layers // 2] and loop["real_layers"] == 36
    assert sorted(loop["per_context"], key=int) == [str(c) for c in plan.contexts]
    for c, entry in loop["per_context"].items():
        deep = entry["measured"][str(loop["depths"][0])]
        assert deep["capacity"] >= int(c) and set(deep["taus"]) == {str(t) for t in plan.taus}
        for t in deep["taus"].values():  # tokens per second = tau x batch / cycle seconds, as measured
            assert t["spec_tokens_per_s"] == pytest.approx(t["tau"] * loop["batch"] / t["cycle_s"])
            assert 1.0 <= t["tau"] <= TINY.k + 1
        real = entry["at_real_layers"]
        assert real["break_even_tau"] == pytest.approx(real["cycle_s"] / real["decode_s"])
    # the bisection found scales whose measured tau rises as the target does
    first = loop["per_context"][str(plan.contexts[0])]["measured"][str(loop["depths"][0])]["taus"]
    assert first[str(plan.taus[0])]["tau"] < first[str(plan.taus[-1])]["tau"]
    assert loop["target_as_drafter"]["all_accepted"] == loop["target_as_drafter"]["cycles"] > 0
    assert abs(loop["acceptance"]["z"]) <= 5 and loop["acceptance"]["cycles"] > 1000
    assert "per-layer" in loop["scaling_rule"] and loop["cuda_graphs"] is False


def _check_head_update_graph(graph):
    assert graph["path"].startswith("fixed-shape") and graph["policy_s"] > 0
    numerics = graph["numerics"]
    assert numerics["gradients"]["worst_ratio"] <= 1 and numerics["fp64_grad_rel"] <= numerics["cycles"] * 2**-24
    for entry in graph["per_chunk"].values():
        assert entry["graph_s"] > 0 and entry["eager_s"] > 0 and entry["min_grad_cosine_graph_vs_eager"] > 0.99
        assert entry["kernels"] == {"eager": None, "graph": None}  # the profiler counts kernels on CUDA only


def _check_trainer_step(trainer, out_dir, modes=("production", "strict"), layers=TINY.trainer_layers):
    # the GPU machine's environment, rehearsed: Ray and vLLM were never imported, only stood in for
    assert trainer["standins"] == ["ray", "vllm"]
    assert trainer["optimizer"] == ["torch AdamW through DeepSpeed (torch_adam)"]
    assert trainer["layers"] == layers and trainer["steps"] == TINY.trainer_steps
    assert trainer["optimizer_choice"]["reason"] == "no CUDA"
    # every run in a process of its own, each started with no DeepSpeed engine alive in it or in the check's
    # process, while its own engine was counted (the counter is not blind); its JSON and log kept
    runs = trainer["runs"]
    expected = {"strict": {"strict_without_head", "strict_with_head"},
                "production": {"production_with_head", "production_without_head", "plain"}}
    assert set(runs) == set().union(*(expected[m] for m in modes))
    pids = {run["held_at_start"]["pid"] for run in runs.values()} | {runs[n]["parent_held"]["pid"] for n in runs}
    assert len(pids) == len(runs) + 1
    for name, run in runs.items():
        assert run["ok"] and run["exit_status"] == 0 and run["verdict"] and not run["verdict"].startswith("none")
        assert run["held_at_start"]["deepspeed_engines"] == 0 and run["parent_held"]["deepspeed_engines"] == 0
        assert (run["kind"] == "plain") != (run.get("engines_while_running", 0) >= 1), name
        kept = json.loads((out_dir / trainer["runs_dir"] / f"{layers}_layers_{name}.json").read_text())
        assert kept["ok"] and kept["seconds"] == run["seconds"]
        assert (out_dir / trainer["runs_dir"] / run["log"]).stat().st_size > 0
    clean = [r for r in trainer_rows(out_dir) if r["name"] == "no run started with memory an earlier run held"]
    assert len(clean) == 1 and clean[0]["passed"] and not clean[0]["values"]["problems"]
    if "strict" not in modes:
        return
    assert runs["strict_with_head"]["verdict"].startswith("policy bit-identical")
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
    assert set(drafter["phases"]) == {"prefill", "head", "verify"}
    assert sum(drafter["phases"].values()) == pytest.approx(drafter["seconds"], rel=0.05)
    # the policy's loss and gradient norm are upstream's too (the head's gradients are not in the norm)
    for key in ("policy_loss", "actor_grad_norm"):
        assert status[key] == trainer["status_without_head"][key], key
    if "production" not in modes:
        assert "production" not in trainer
        return
    # the production step: the pair again, not strict, timed per token beside the plain forward + backward
    assert runs["production_with_head"]["head_matrices_moved"] == runs["production_with_head"]["head_matrices"]
    prod = trainer["production"]
    assert prod["deterministic_algorithms"] == "off" and prod["tokens"] == trainer["tokens"]
    assert set(prod["step_s"]) == {"with_head", "without_head"} and all(s > 0 for s in prod["step_s"].values())
    assert all(len(s) == TINY.trainer_steps for s in prod["seconds"].values())
    assert prod["plain_forward_backward_s"] > 0 and 0 < prod["head_share_of_step"] < 1
    for name, seconds in prod["step_s"].items():
        assert prod["per_token_s"][name] == pytest.approx(seconds / prod["tokens"])
        over = prod["step_over_plain_forward_backward"][name]
        assert over == pytest.approx(seconds / prod["plain_forward_backward_s"])
    assert all(r > 0 for r in trainer["strict_over_production"].values())


def trainer_rows(out_dir):
    return [r for r in json.loads((out_dir / "gpu_check.json").read_text())["rows"] if r["check"] == "trainer_step"]


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


def refused(argv: list[str], capsys) -> str:
    """The check's own parser run in this process (as `python -m` runs it, without paying its imports again):
    exit status 2 and what it wrote to stderr."""
    from benchmarks.gpu_check import gpu_check

    with pytest.raises(SystemExit) as stop:
        gpu_check.parse_args(argv)
    assert stop.value.code == 2
    return capsys.readouterr().err


def test_only_refuses_an_unknown_check(capsys):
    assert "--only takes checks among" in refused(["--tiny", "--only", "a,e"], capsys)


def test_only_runs_its_checks_in_its_order_with_their_prerequisites_before_them():
    from benchmarks.gpu_check import gpu_check

    def order(only: str) -> list[str]:
        return gpu_check.parse_args(["--tiny", "--only", only]).only

    # docs/gpu.md's prepared command: the production step first, the captured head update where time is left
    assert order("trainer_step,c,head_update_graph") == ["trainer_step", "c", "head_update_graph"]
    assert order("d") == ["a", "b", "d"]  # (d) reads (a)'s draft logits and (b)'s log p
    assert order("c,b,a") == ["c", "a", "b"]
    assert order("a,c,a") == ["a", "c"]
    # (c) drops (a)'s and (b)'s tensors: the head's math stays one block, where it is first named
    assert order("a,b,c,d,cycle_cost") == ["a", "b", "d", "c", "cycle_cost"]
    assert gpu_check.parse_args(["--tiny"]).only == list(gpu_check.CHECKS)


def test_the_exit_status_tells_a_failed_check_from_one_the_deadline_skipped():
    from benchmarks.gpu_check.gpu_report import Row, exit_status

    passed, measured = Row("a", "x", "", "", True), Row("c", "cost", "", "", None)
    skipped = Row("d", "not run", "-", "-", False, skipped=True)
    failed = Row("b", "y", "", "", False)
    assert [exit_status(rows) for rows in ([passed, measured], [passed, skipped], [failed, skipped])] == [0, 3, 1]


def test_a_run_past_its_deadline_records_what_it_skipped(tmp_path):
    out = tmp_path / "late.json"
    proc = _run("--tiny", "--only", "c,cycle_cost", "--deadline-s", "0", "--json", str(out))
    assert proc.returncode == 3  # nothing failed, but not everything ran: neither 0 nor a failure's 1
    result = json.loads(out.read_text())
    assert not result["complete"] and result["cut_off"]["reason"] == "deadline"
    assert [r["name"].split(":")[0] for r in result["rows"]] == ["not run", "not run"]
    assert [r["check"] for r in result["rows"]] == ["c", "cycle_cost"]  # in --only's order


def test_sigterm_leaves_the_json_of_what_was_done(tmp_path):
    out = tmp_path / "term.json"
    proc = subprocess.Popen([sys.executable, *CHECK, "--tiny", "--only", "a,b,d,c,cycle_cost", "--json", str(out)],
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
def test_real_shapes_refuse_without_cuda_before_any_work(tmp_path, capsys):
    from benchmarks.gpu_check import gpu_check

    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert "CUDA" in err and "--tiny" in err
    assert not out.exists()


def test_bad_arguments_are_refused_by_name(capsys):
    assert "--micro-batch 4 is more than --responses 2" in refused(["--tiny", "--responses", "2", "--micro-batch", "4"],
                                                                   capsys)
    # the tiny vocabulary is 2,048 ids
    assert "--draft-vocab must be in 1..2047" in refused(["--tiny", "--draft-vocab", "2048"], capsys)
    assert "--tau must be in (1, 6]" in refused(["--tiny", "--tau", "1.0"], capsys)


def test_the_loop_times_the_draft_vocabulary_beside_every_id(tiny_check):
    proc, result, _ = tiny_check
    loop = result["rollout_loop"]
    _check_rollout_loop(loop)  # the rows of every id as they are without it
    subset, plan = loop["draft_vocab"], gpu_rollout_loop.LOOP_PLANS["tiny"]
    assert subset["size"] == 512 and not subset["errors"] and subset["scale"]["logit_shift_outside"] > 0
    assert sorted(subset["per_context"], key=int) == [str(c) for c in plan.contexts]
    for entry in subset["per_context"].values():
        assert set(entry["measured"]) == {str(d) for d in loop["depths"]}
        for timed in entry["measured"].values():
            assert timed["cycle_s"] > 0 and 1.0 <= timed["tau"] <= TINY.k + 1
        assert entry["speedup_at_paper_tau"] > 0 and entry["speedup_at_paper_tau_all_ids"] > 0
    assert subset["rollout_speedup_all_ids"] == loop["rollout"]["speedup"] and subset["rollout_speedup"] > 0
    assert abs(subset["acceptance"]["z"]) <= 5 and subset["acceptance"]["cycles"] > 0
    assert "draft over 512 ids" in proc.stdout


def test_the_head_update_checks_time_the_draft_vocabulary_beside_every_id(tiny_check):
    """(c) and head_update_graph with --draft-vocab: the eager update, and the fixed-shape one (captured on CUDA),
    also over 512 ids alone; on a CPU the fixed-shape path runs eagerly over the same rows and its gradients
    point where the eager update's do."""
    _, result, _ = tiny_check
    cost = result["head_update_cost"]
    assert cost["draft_vocab"] == 512 and len(cost["seconds"]["head_subset"]) == cost["repeats"]
    assert cost["subset_over_all"] == pytest.approx(cost["median_s"]["head_subset"] / cost["median_s"]["head"])
    assert any("over 512 ids / over every id" in r["name"] for r in result["rows"])
    graph = result["head_update_graph"]
    _check_head_update_graph(graph)  # every id's entries as they are without it
    for entry in graph["per_chunk"].values():
        sub = entry["draft_vocab"]
        assert sub["size"] == 512 and sub["eager_s"] > 0 and sub["graph_s"] > 0
        assert sub["min_grad_cosine_graph_vs_eager"] > 0.99  # bf16, as over every id


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
    return cycle_timing.policy_caches(model, batch, capacity)


def _forward(model, ids, caches, causal=False):
    """Logits of ids [B, T] after the caches' `length` positions, as `policy_times` and `prefill_time` run it."""
    start, new = len(caches[0]), ids.shape[1]
    positions = torch.arange(start, start + new).expand(ids.shape[0], new)
    seen = cycle_timing.visible(positions[:1], start + new) if causal else None
    return model.lm_head(cycle_timing.cached_forward(model, ids, positions, caches, seen))


def test_cached_forward_is_the_models_forward():
    model = _model(2)
    ids = torch.randint(0, model.config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        caches = _caches(model)
        prefix = _forward(model, ids[:, :12], caches, causal=True)
        decode = _forward(model, ids[:, 12:13], caches)
        causal = _forward(model, ids[:, 13:19], caches, causal=True)
        for cache in caches:
            cache.reset(13)
        unmasked = _forward(model, ids[:, 13:19], caches)
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
        _forward(model, ids[:, :13], caches, causal=True)
        causal = _forward(model, ids[:, 13:], caches, causal=True)
        for cache in caches:
            cache.reset(13)
        unmasked = _forward(model, ids[:, 13:], caches)
    torch.testing.assert_close(unmasked[:, -1], causal[:, -1], rtol=1e-5, atol=1e-5)


def test_kv_buffer_writes_in_place_and_refuses_to_overflow():
    buffer = cycle_timing.KVBuffer.empty(1, 1, 4, 2, "cpu", torch.float32)
    keys, _ = buffer.update(torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2))
    assert keys.shape[2] == 3 and keys.data_ptr() == buffer.keys.data_ptr()
    buffer.reset(1)
    keys, _ = buffer.update(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))
    assert keys.shape[2] == 3 and float(keys[0, 0, 0, 0]) == 1.0 and float(keys[0, 0, 1:].abs().sum()) == 0.0
    with pytest.raises(ValueError, match="holds 4 positions"):
        buffer.update(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))


def test_cycle_formula():
    # at the break-even tau drafting neither gains nor loses; at tau = 1 a cycle can only lose
    p = cycle_timing.cycle_prediction(decode=2.0, verify=3.0, draft=0.2, k=5, tau=2.91)
    assert p["cycle_s"] == pytest.approx(4.0) and p["break_even_tau"] == pytest.approx(2.0)
    at_break_even = cycle_timing.cycle_prediction(2.0, 3.0, 0.2, 5, p["break_even_tau"])
    assert at_break_even["speedup"] == pytest.approx(1.0)
    assert cycle_timing.cycle_prediction(2.0, 3.0, 0.2, 5, 1.0)["speedup"] < 1
    # linear costs in the context: the whole response is the fit at its mean context, once per step
    rollout = cycle_timing.rollout_prediction([0, 100], [1.0, 2.0], [2.0, 4.0], tau=4.0, prompt=0, response=100)
    assert rollout["ar_s"] == pytest.approx(150.0) and rollout["spec_s"] == pytest.approx(75.0)
    # end to end: only the rollout part speeds up, and the head update adds to the step
    assert cycle_timing.step_prediction(rollout_ar=60.0, rollout_speedup=2.0, train=40.0,
                                        head=0.0) == pytest.approx(100 / 70)
    assert cycle_timing.step_prediction(60.0, 2.0, 40.0, 10.0) == pytest.approx(100 / 80)


def test_engine_formula_is_the_cycle_formula_plus_what_it_measures():
    # bench_cycle_formula: with no prefill, no engine overhead and a free head, the prefill step gives a request's
    # first token and each later step 1 (AR) or tau (spec): 91 tokens in 91 or 1 + 90 / 3 steps
    engine = bench_cycle_formula.generate_wall
    ar = engine(prefill=0.0, first=0.0, step=2.0, steps=91, overhead=0.0)
    spec = engine(prefill=0.0, first=0.0, step=3.0, steps=1 + 30, overhead=0.0)
    assert ar / spec == pytest.approx(cycle_timing.cycle_prediction(2.0, 3.0, 0.0, 5, tau=3.0)["speedup"])
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


def test_trainer_layers_follow_the_devices_memory():
    from benchmarks.gpu_check.gpu_trainer import layers_that_fit

    config = qwen3_4b_config(36)
    h100, h200 = layers_that_fit(config, 80 * 10**9), layers_that_fit(config, 141 * 10**9)
    assert 1 <= h100 < h200 <= 36
    assert layers_that_fit(config, 10**12) == 36 and layers_that_fit(config, 10**9) == 1


def test_trainer_depth_follows_a_clean_runs_own_peak():
    # PEAK_BYTES_PER_PARAM is read off the kept H100 run whose first DeepSpeed run started clean (416 MiB
    # allocated by the check before it): its own rise over its parameters, with and without the head, must not
    # exceed it, and it must not sit far above it (the 37 it replaced was read off a run that started with an
    # earlier run's 26 GB still held)
    from benchmarks.gpu_check.gpu_trainer import PEAK_BYTES_PER_PARAM, parameters

    kept = json.loads((ROOT / "docs/data/gpu/trainer_step_head_update_graph_cycle_cost_2026-11-27.json").read_text())
    trainer, config = kept["trainer_step"], qwen3_4b_config(36)
    assert trainer["memory_mb"]["without_head"]["at_start"] < 1024  # the first run: nothing of another run held
    own = {side: (m["peak"] - m["at_start"]) * 2**20 / parameters(config, trainer["layers"], head=side == "with_head")
           for side, m in trainer["memory_mb"].items()}
    assert max(own.values()) <= PEAK_BYTES_PER_PARAM <= 1.05 * max(own.values()), own
    assert parameters(config, 36, head=False) == pytest.approx(4.02e9, rel=0.01)  # Qwen3-4B's 4.02 B


def test_clean_starts_name_what_a_run_started_with():
    from benchmarks.gpu_check.gpu_trainer import ACCUMULATED_MIB, PARENT_HELD_MIB, clean_starts

    def run(engines=0, allocated=0.0, used=1000.0, parent_engines=0, parent_allocated=10.0):
        return {"held_at_start": {"deepspeed_engines": engines, "cuda_allocated_mib": allocated,
                                  "device_used_mib": used, "pid": 2},
                "parent_held": {"deepspeed_engines": parent_engines, "cuda_allocated_mib": parent_allocated,
                                "largest": ["torch.bfloat16 [151936, 2560] 742 MiB"], "pid": 1}}

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    clean = {"8": {"runs": {"a": run(), "b": run(used=1000.0 + ACCUMULATED_MIB), "skipped": {"skipped": True}}}}
    assert clean_starts(clean, cuda) == [] and clean_starts(clean, cpu) == []
    for bad, said in ((run(engines=1), "1 DeepSpeed engine(s) alive in its process"),
                      (run(parent_engines=3), "and 3 in the check's"),
                      (run(allocated=5.0), "5 MiB allocated in its process"),
                      (run(parent_allocated=PARENT_HELD_MIB + 800), "[151936, 2560]"),
                      (run(used=1001.0 + ACCUMULATED_MIB), "more than at the first run's start")):
        problems = clean_starts({"8": {"runs": {"first": run(), "second": bad}}}, cuda)
        assert len(problems) == 1 and problems[0].startswith("8 layers, second") and said in problems[0], problems
    # without CUDA only the engines are counted: an engine alive is named there too
    assert clean_starts({"2": {"runs": {"first": run(engines=2, allocated=5.0)}}}, cpu)[0].startswith("2 layers, first")


def test_a_failed_run_leaves_its_error_and_log_and_a_verdict_that_says_so(tmp_path, monkeypatch):
    # the runs' process stood in for by scripts: one that fails as a run fails (its JSON with the traceback),
    # one that dies before recording anything (as a device-side assert or a kill ends a process)
    from benchmarks.gpu_check import gpu_trainer

    failing = tmp_path / "failing.py"
    failing.write_text("import json, sys\nspec = json.load(open(sys.argv[1]))\n"
                       "print('the kernel said: Assertion `dstIndex < dstAddDimSize` failed.')\n"
                       "json.dump({'name': spec['name'], 'ok': False, 'stage': 'failed', "
                       "'error': 'Traceback (most recent call last):\\nRuntimeError: CUDA error: device-side assert "
                       "triggered'}, open(spec['result'], 'w'))\nsys.exit(1)\n")
    dying = tmp_path / "dying.py"
    dying.write_text("import os\nprint('started')\nos._exit(134)\n")
    said = []
    runner = gpu_trainer.Runner(TINY, torch.device("cpu"), tmp_path / "work", tmp_path / "runs", None, said.append,
                                {"fused": False}, {})
    (tmp_path / "work").mkdir()
    results = {}
    for script, run in ((failing, gpu_trainer.RUNS["production"][0]), (dying, gpu_trainer.RUNS["production"][1])):
        monkeypatch.setattr(gpu_trainer, "RUN_ARGS", [str(script)])
        results[run.name] = runner.launch(run, 2, blocking=False)
    failed, died = results["production_with_head"], results["production_without_head"]
    assert not failed["ok"] and failed["exit_status"] == 1 and "device-side assert" in failed["error"]
    assert "dstIndex < dstAddDimSize" in (tmp_path / "runs" / failed["log"]).read_text()
    assert any("dstIndex < dstAddDimSize" in line for line in said)  # the log's tail is printed too
    assert not died["ok"] and died["exit_status"] == 134 and "before it recorded an error" in died["error"]
    details = {"layers": 2, "runs": results, "launch_blocking": False}
    for run in results.values():
        run["verdict"] = gpu_trainer._verdict(run, details)
    assert failed["verdict"].startswith("none: the run failed (RuntimeError: CUDA error: device-side assert")
    rows = gpu_trainer._rows(TINY, details)
    assert [r.passed for r in rows if "FAILED" in r.name] == [False, False]
    # past the deadline a run is not started, and says so
    late = gpu_trainer.Runner(TINY, torch.device("cpu"), tmp_path / "work", tmp_path / "runs", 0.0, said.append,
                              {"fused": False}, {})
    skipped = late.launch(gpu_trainer.RUNS["strict"][0], 2, blocking=False)
    assert skipped["skipped"] and gpu_trainer._verdict(skipped, details) == "none: not run, past the deadline"


def test_a_run_with_a_bad_spec_records_its_traceback_before_any_model_work(tmp_path):
    from benchmarks.gpu_check import gpu_trainer_run

    result, log = tmp_path / "run.json", tmp_path / "run.log"
    spec = {"name": "strict_with_head", "kind": "step", "device": "cpu", "ours": True, "strict": True,
            "gather_policy": True, "fused_adam": False, "policy_dir": str(tmp_path / "policy"),
            "head_dir": str(tmp_path / "head"), "work_dir": str(tmp_path), "experience_dir": str(tmp_path / "none"),
            "logp_file": "logp_2.safetensors", "outputs": str(tmp_path / "out"), "result": str(result),
            "plan": {"k": 5, "topk": 64, "chunk_cycles": 64, "micro_batch": 2, "trainer_responses": 4,
                     "trainer_prompt": 8, "trainer_steps": 2}}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    with open(log, "wb") as out:
        code = subprocess.run([sys.executable, "-m", gpu_trainer_run.__name__, str(tmp_path / "spec.json")],
                              stdout=out, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT, timeout=120).returncode
    recorded = json.loads(result.read_text())
    assert code == 1 and not recorded["ok"] and recorded["stage"] == "failed"
    assert "sequences.safetensors" in recorded["error"] and recorded["error"] in log.read_text()
    assert recorded["held_at_start"]["deepspeed_engines"] == 0
    assert "deepspeed" not in log.read_text().lower()  # it failed on the spec, before importing DeepSpeed


def test_a_checks_error_is_saved_before_any_cuda_call_and_a_cuda_error_stops_the_rest(tmp_path, monkeypatch, capsys):
    from benchmarks.gpu_check import gpu_check

    args = gpu_check.parse_args(["--tiny", "--only", "cycle_cost,c", "--json", str(tmp_path / "gpu_check.json")])
    run = gpu_check.Run(args, torch.device("cpu"))
    run.device = torch.device("cuda")  # as on a GPU, where an error must not be followed by a CUDA call
    calls = []

    def cuda_call(*a, **kw):  # what torch.cuda.empty_cache does after a device-side assert: raise again
        errors = json.loads(args.json.read_text())["errors"] if args.json.exists() else {}
        if errors:
            calls.append(errors)
            raise RuntimeError("CUDA error: device-side assert triggered (again)")

    def first_error(self):
        raise RuntimeError("CUDA error: device-side assert triggered\nthe first one")

    monkeypatch.setattr(torch.cuda, "empty_cache", cuda_call)
    monkeypatch.setattr(gpu_check.Run, "cycle", first_error)
    run.all_checks()
    saved = json.loads(args.json.read_text())
    assert "the first one" in saved["errors"]["cycle_cost"] and "Traceback" in saved["errors"]["cycle_cost"]
    assert calls == []  # no CUDA call after the error: not even releasing the models at the end
    assert "the first one" in capsys.readouterr().err  # the traceback in the log too
    rows = {r.check: r for r in run.rows}
    assert not rows["c"].passed and "left the device unusable" in rows["c"].name


def test_fused_adam_not_built_within_its_time_box_leaves_torch_adam_and_says_why(tmp_path):
    # 0.2 s: the build's process is still importing torch when its time box ends, and is stopped
    from benchmarks.gpu_check.gpu_fused_adam import TORCH_ADAM, FusedAdamBuild

    build = FusedAdamBuild(tmp_path / "extensions", tmp_path / "runs", budget_s=0.2)
    outcome = build.outcome()
    assert outcome == {"optimizer": TORCH_ADAM, "fused": False, "build_s": None,
                       "reason": "not built within 0.2 s (log: fused_adam_build.log)"}
    assert build.proc.poll() is not None and (tmp_path / "runs" / "fused_adam_build.log").exists()
    assert build.env()["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "extensions")


def test_the_commit_recorded_is_the_hosts_where_given(monkeypatch):
    from benchmarks.gpu_check import gpu_check

    monkeypatch.delenv("GPU_HOST_COMMIT", raising=False)
    here = gpu_check.commits()
    assert here["git_commit"] == here["git_commit_of_this_copy"] and not here["git_commit_disagrees"]
    monkeypatch.setenv("GPU_HOST_COMMIT", "0123456789abcdef0123456789abcdef01234567")
    host = gpu_check.commits()
    assert host["git_commit"] == "0123456789abcdef0123456789abcdef01234567"
    assert host["git_commit_from"] == "GPU_HOST_COMMIT"
    assert host["git_commit_disagrees"] == (here["git_commit_of_this_copy"] is not None)
    monkeypatch.setenv("GPU_HOST_COMMIT", (here["git_commit_of_this_copy"] or "x")[:7])  # a short form agrees
    assert not gpu_check.commits()["git_commit_disagrees"]


def test_trainer_arguments_are_refused_by_name(capsys):
    from benchmarks.gpu_check import gpu_check

    for argv, said in ((["--trainer-layers", "8,0"], "--trainer-layers must be in 1..36 or auto, got 0"),
                       (["--trainer-layers", "eight"], "--trainer-layers must be in 1..36 or auto, got eight"),
                       (["--launch-blocking-layers", "40"], "--launch-blocking-layers must be in 1..36 or auto"),
                       (["--trainer-runs", "strict,fast"], "--trainer-runs takes runs among production,strict")):
        with pytest.raises(SystemExit):
            gpu_check.parse_args(["--tiny", *argv])
        assert said in capsys.readouterr().err
    args = gpu_check.parse_args(["--trainer-layers", "8,auto", "--launch-blocking-layers", "8"])
    assert args.trainer_layers == [8, "auto"] and args.launch_blocking_layers == [8]
    assert args.trainer_runs == ("production", "strict")


@pytest.mark.slow
def test_trainer_step_at_two_depths_runs_production_and_strict_each_in_a_process_of_its_own(tmp_path):
    # about 70 s on 2 cores: 2 depths x 5 runs, each a Python process importing DeepSpeed and OpenRLHF
    out = tmp_path / "gpu_check.json"
    proc = _run("--tiny", "--only", "trainer_step", "--trainer-layers", "1,2", "--launch-blocking-layers", "1",
                "--json", str(out), timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    trainer = json.loads(out.read_text())["trainer_step"]
    assert trainer["depths"] == [1, 2] and trainer["drafted_at_layers"] == 1 and set(trainer["by_depth"]) == {"1", "2"}
    _check_trainer_step(trainer, tmp_path)  # the last depth's, at the top
    first = trainer["by_depth"]["1"]
    _check_trainer_step({**trainer, **first}, tmp_path, layers=1)
    assert first["launch_blocking"] and all(r["launch_blocking"] for r in first["runs"].values())
    assert not trainer["launch_blocking"] and "CUDA_LAUNCH_BLOCKING" in " ".join(
        r["name"] for r in trainer_rows(tmp_path) if "1 layers" in r["name"] and "per token" in r["name"])
    # the second depth trained on the first's records, from a policy of its own
    assert first["tokens"] == trainer["tokens"] and first["cycles"] == trainer["cycles"]
    assert first["policy_tensors"] < trainer["policy_tensors"]


def _loop_world(batch=64, context=24, cycles=30, dtype=torch.float32):
    from benchmarks.gpu_check.gpu_world import build_head, build_policy

    config = TINY.trainer_config(2)
    policy = build_policy(config, torch.device("cpu"), dtype).eval()
    policy.gradient_checkpointing_disable()
    capacity = gpu_rollout_loop.round_up(context + (cycles + 1) * (TINY.k + 1) + 1)
    g = torch.Generator().manual_seed(5)
    caches = [cycle_timing.KVBuffer.empty(batch, config.num_key_value_heads, capacity, config.head_dim, "cpu", dtype)
              for _ in range(3)]
    for cache in caches:
        cache.fill_random(context, g)
    return policy, build_head(policy, dtype), caches, capacity


def test_forward_writing_at_positions_into_a_static_cache_is_the_models_forward():
    policy, _, caches, capacity = _loop_world(batch=3, context=0)
    ids = torch.randint(0, policy.config.vocab_size, (3, 14), generator=torch.Generator().manual_seed(1))
    views = [c.view(capacity) for c in caches[:2]]

    def forward(ids, positions):  # as the loop runs it: every slot given back, masked by position
        for view in views:
            view.positions = positions
        return cycle_timing.cached_forward(policy, ids, positions, views, cycle_timing.visible(positions, capacity))

    with torch.no_grad():
        want = policy.model(input_ids=ids).last_hidden_state
        positions = torch.arange(14).expand(3, -1)
        # eight tokens at once, then one at a time, at shifted positions per sequence as in a lockstep batch
        got = [forward(ids[:, :8], positions[:, :8])]
        got += [forward(ids[:, t:t + 1], positions[:, t:t + 1]) for t in range(8, 14)]
    torch.testing.assert_close(torch.cat(got, 1), want, rtol=1e-5, atol=1e-5)


def test_target_as_its_own_drafter_has_every_draft_accepted():
    same = gpu_rollout_loop.target_drafts_are_all_accepted(TINY, gpu_rollout_loop.LOOP_PLANS["tiny"], _fp64_policy,
                                                           torch.device("cpu"))
    assert same["cycles"] > 0 and same["all_accepted"] == same["cycles"] and same["tau"] == TINY.k + 1


def _fp64_policy(layers, dtype):
    from benchmarks.gpu_check.gpu_world import build_policy

    policy = build_policy(TINY.trainer_config(layers), torch.device("cpu"), dtype)
    policy.gradient_checkpointing_disable()
    return policy.eval()


def test_loop_first_acceptance_matches_sum_min_p_q():
    policy, head, caches, capacity = _loop_world()
    with torch.no_grad():  # a flatter q than the random head's: acceptance near one half, where a bias shows most
        getattr(head, head.family.final_norm_name).weight.mul_(2.0 ** -3)
    loop = gpu_loop.Loop(policy, 2, head, caches[:2], caches[2], 24, capacity, TINY.k, seed=7)
    counts = loop.timed("cycle", 30)[1]
    alpha = counts["alpha_sum"] / counts["cycles"]
    assert 0.2 < alpha < 0.9 and counts["cycles"] == 64 * 30
    assert abs(reference_drafting.acceptance_z(counts)) <= gpu_sampler.Z_LIMIT
    # the same trials held to another expectation 0.05 away would fail: 5 sigma is ~0.05 at these trials
    sigma = counts["alpha_var"] ** 0.5 / counts["cycles"]
    assert 5 * sigma < 0.06


def test_rejection_step_over_draft_ids_is_the_step_over_q_scattered_to_every_id():
    """q kept over N ids alone gives the very draws and results of q zero at every other id."""
    g = torch.Generator().manual_seed(11)
    batch, k, vocab = 256, TINY.k, 300
    ids = torch.sort(torch.randperm(vocab, generator=g)[:70]).values
    p = torch.randn(batch, k + 1, vocab, generator=g).softmax(-1)
    q = torch.randn(batch, k, ids.numel(), generator=g).softmax(-1)
    places = torch.randint(0, ids.numel(), (batch, k), generator=g)
    scattered = torch.zeros(batch, k, vocab).index_copy_(2, ids, q)
    got = reference_drafting.rejection_step(p, q, places, torch.Generator().manual_seed(4), ids)
    want = reference_drafting.rejection_step(p, scattered, ids[places], torch.Generator().manual_seed(4))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert 0 < int((got[0] < k).sum()) < batch  # rejections and recoveries were exercised
    # a step that forgot the ids (q's columns read as ids 0..N-1) gives other results
    unplaced = torch.zeros(batch, k, vocab).index_copy_(2, torch.arange(ids.numel()), q)
    wrong = reference_drafting.rejection_step(p, unplaced, places, torch.Generator().manual_seed(4))
    assert not torch.equal(wrong[0], want[0])


def test_loop_over_draft_ids_drafts_inside_them_and_accepts_as_sum_min_p_q():
    from benchmarks.gpu_check import gpu_draft_vocab

    policy, head, caches, capacity = _loop_world()
    ids = gpu_draft_vocab.draft_vocab_ids(policy.config.vocab_size, 512, torch.device("cpu"))
    with torch.no_grad():  # a flatter q: acceptance near one half, where a bias shows most
        getattr(head, head.family.final_norm_name).weight.mul_(2.0 ** -3)
    with gpu_draft_vocab.shifted_outside(policy, ids):
        loop = gpu_loop.Loop(policy, 2, head, caches[:2], caches[2], 24, capacity, TINY.k, seed=7, draft_ids=ids)
        assert loop.q.shape[-1] == ids.numel()  # q over the ids alone: zero at every other id
        counts = loop.timed("cycle", 30)[1]
        assert torch.isin(loop.drafts, ids).all() and torch.equal(ids[loop.places], loop.drafts)
    assert policy.lm_head.bias is None  # the shift is gone with the block
    alpha = counts["alpha_sum"] / counts["cycles"]
    assert 0.2 < alpha < 0.9 and counts["cycles"] == 64 * 30
    assert abs(reference_drafting.acceptance_z(counts)) <= gpu_sampler.Z_LIMIT
    assert 5 * counts["alpha_var"] ** 0.5 / counts["cycles"] < 0.06


def test_the_outside_shift_leaves_the_mass_asked_for_outside_the_ids():
    from benchmarks.gpu_check import gpu_draft_vocab

    vocab, size = 151936, 32768
    d = gpu_draft_vocab.outside_shift(vocab, size)
    outside = (vocab - size) * math.exp(-d)
    assert outside / (size + outside) == pytest.approx(gpu_draft_vocab.OUTSIDE_MASS)


def test_batched_rejection_step_passes_the_samplers_statistics_and_a_swapped_one_does_not():
    p, q = _pair()
    trials = 2**15
    g = torch.Generator().manual_seed(3)

    def run(target, draft):
        drafts = torch.stack([reference_drafting.sample(draft[j].expand(trials, -1), g)
                              for j in range(draft.shape[0])], 1)
        accepted, token = reference_drafting.rejection_step(target.expand(trials, -1, -1),
                                                            draft.expand(trials, -1, -1), drafts, g)
        emitted = torch.full((trials, draft.shape[0] + 1), -1, dtype=torch.long)
        keep = torch.arange(draft.shape[0])[None, :] < accepted[:, None]
        emitted[:, :-1] = torch.where(keep, drafts, emitted[:, :-1])
        emitted.scatter_(1, accepted[:, None], token[:, None])
        return gpu_sampler.sampler_statistics(p, q, accepted, emitted)

    stats = run(p, q)
    assert abs(stats["z_first"]) <= gpu_sampler.Z_LIMIT and abs(stats["z_mean"]) <= gpu_sampler.Z_LIMIT
    assert all(pos["p_value"] >= gpu_sampler.P_MIN for pos in stats["positions"] if pos["p_value"] is not None)
    swapped = run(torch.cat([q, p[3:]]), p[:3])  # drafts from p, accepted with min(1, q/p): emits q's law
    assert swapped["positions"][0]["p_value"] < gpu_sampler.P_MIN


def test_the_drafters_records_hold_the_policys_own_log_probs_on_the_committed_path():
    # the drafter's verify runs over static caches written at positions, each sequence at its own, masked by
    # position; on the committed path (draft positions 1..accepted + 1) its top-k log-probs must be those of a
    # plain forward over the committed tokens.
    # fp32 on CPU: the two forwards differ by rounding in other reduction orders, ~1e-6 on log-probs of magnitude
    # ~log V = 7.6; 1e-4 leaves room, and a wrong slot or position moves them by the logits' spread (~1)
    from benchmarks.gpu_check.gpu_world import build_head, build_policy
    from openrlhf_growmtp.core.validation import validate_records

    policy = build_policy(TINY.trainer_config(2), torch.device("cpu"), torch.float32).eval()
    policy.gradient_checkpointing_disable()
    head = build_head(policy, torch.float32)
    prompts = torch.randint(0, TINY.config.vocab_size, (4, 6), generator=torch.Generator().manual_seed(4))
    loop = gpu_drafter.drafting_loop(policy, head, prompts, 24, TINY.k, 16, seed=2)
    gpu_loop.calibrate(loop, 2.5, 8, 5)
    rollouts = gpu_drafter.draft_rollouts(loop, 24)
    # the records are what the trainer accepts: the accepted drafts are the committed tokens, each cycle in place
    validate_records(rollouts.records, depth=TINY.k, vocab_size=TINY.config.vocab_size, topk=16)
    # every cycle run (a cycle commits at most K + 1 tokens), not only the kept ones, is a trial of the first
    # draft's acceptance, held to sum min(p_1, q_1)
    assert rollouts.counts["cycles"] >= 4 * 24 / (TINY.k + 1) and rollouts.cycles <= rollouts.counts["cycles"]
    assert abs(reference_drafting.acceptance_z(rollouts.counts)) <= gpu_sampler.Z_LIMIT
    with torch.no_grad():
        checked = 0
        for rec in rollouts.records:
            logp = torch.log_softmax(policy(input_ids=rec.token_ids[None]).logits[0].float(), dim=-1)
            for r in range(rec.num_cycles):
                s, a = int(rec.start[r]), int(rec.accepted[r])
                for j in range(min(a + 1, TINY.k)):  # draft position j + 1 reads tokens[:s + j + 2]
                    want = logp[s + j + 1].topk(16)
                    torch.testing.assert_close(rec.topk_logprobs[r, j], want.values, rtol=0, atol=1e-4)
                    checked += 1
    assert checked > 50 and 1.5 < rollouts.tau < TINY.k + 1


def test_fixed_shape_head_update_is_head_loss_backward():
    from benchmarks.gpu_check import gpu_head_graph
    from benchmarks.gpu_check.gpu_world import build_head, build_policy
    from growmtp_lab.worlds.toy import synthetic_record

    policy = build_policy(TINY.config, torch.device("cpu"), torch.float64)
    head = build_head(policy, torch.float64)
    g = torch.Generator().manual_seed(0)
    records = [synthetic_record(prompt_len=prompt, accepted=torch.randint(0, TINY.k + 1, (n,), generator=g)
                                .tolist(), depth=TINY.k, topk=8, vocab_size=256, hidden_size=64, seed=i)
               for i, (prompt, n) in enumerate([(6, 20), (30, 9)])]
    hiddens = [r.hidden.double() for r in records]
    # rows of 8 cycles, 2 rows a chunk: chunks cut through both responses, padded rows and cycles included
    got = gpu_head_graph.eager_and_fixed(head, records, hiddens, cycles_per_row=8, rows=2)
    cycles = sum(r.num_cycles for r in records)
    tolerance = cycles * 2.0**-24  # both score log q in fp32 (TopKLogQ), in other groups
    assert abs(got["fixed_loss"] - got["eager_loss"]) <= tolerance * abs(got["eager_loss"])
    for name, want in got["eager"].items():
        assert (got["fixed"][name] - want).norm() <= tolerance * want.norm(), name
    # not vacuous: one draft token changed (one that a chain reads: its cycle accepted it) moves the gradients
    # by far more than the tolerance
    cycle = int((records[0].accepted >= 1).nonzero()[0])
    records[0].drafts[cycle, 0] = (records[0].drafts[cycle, 0] + 1) % 256
    moved = gpu_head_graph.eager_and_fixed(head, records, hiddens, cycles_per_row=8, rows=2)
    assert max((moved["fixed"][n] - g2).norm() / g2.norm() for n, g2 in got["eager"].items()) > 100 * tolerance


def test_end_to_end_reads_the_loops_rollout_where_it_ran():
    cycle = {"train_fit": {"a": 1.0, "b": 1.0}, "tau": 2.91, "real_layers": 36,
             "rollout": {"ar_s": 100.0, "speedup": 1.5}}
    trainer = {"step_s_without_head": 10.0, "layers": 12, "tokens": 1000, "head_update_s": 1.0, "cycles": 100,
               "step_s_with_head": 11.0}
    loop = {"rollout": {"ar_s": 80.0, "speedup": 2.0}}
    _, eager = gpu_cycle.end_to_end(TINY, cycle, trainer)
    rows, measured = gpu_cycle.end_to_end(TINY, cycle, trainer, loop)
    assert eager["rollout_speedup"] == 1.5 and measured["rollout_speedup"] == 2.0
    train, head = eager["train_s"], eager["head_s"]
    assert measured["speedup"] == pytest.approx((80.0 + train) / (80.0 / 2.0 + train + head))
    assert measured["eager_rollout_speedup"] == 1.5 and any("loop (graphs)" in r.name for r in rows)
    assert eager["train_from"] == "strict" and eager["head_s"] == pytest.approx(1.0 * eager["cycles_per_gpu"] / 100)
    # a production step where it ran (what a run pays): its times, not the strict step's
    production = {**trainer, "production": {"step_s": {"without_head": 5.0, "with_head": 5.2}, "head_update_s": 0.2}}
    _, fast = gpu_cycle.end_to_end(TINY, cycle, production)
    assert fast["train_from"] == "production" and fast["train_s"] == pytest.approx(eager["train_s"] / 2)
    assert fast["head_s"] == pytest.approx(eager["head_s"] / 5)
    rows, none = gpu_cycle.end_to_end(TINY, cycle, {**production, "launch_blocking": True})
    assert none is None and "CUDA_LAUNCH_BLOCKING" in rows[0].bound
