"""GROWMTP_REHEARSAL=1: the rehearsal world is true to the real models, the report's verdicts, and one
example script rehearsed end to end (the others: `make rehearse`)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from growmtp_lab.rehearsal import world
from growmtp_lab.rehearsal.report import MARGIN_STANDARD_ERRORS, MeasuredTau, Step, check

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_every_training_script_is_rehearsed():
    text = (EXAMPLES / "rehearse_all.sh").read_text()
    listed = set(re.findall(r'="([a-z0-9_]+\.sh)', text))
    scripts = {p.name for p in (EXAMPLES / "scripts").glob("*.sh")} - {"common.sh", "evaluate.sh"}
    assert listed == scripts
    for arm in ("ce", "kl", "tv", "no_vgm", "teacher_forcing", "joint", "frozen"):
        assert f'"ablation.sh {arm}"' in text


def test_rehearse_all_fails_on_a_refused_command_and_lists_an_unrehearsable_preset(tmp_path):
    """Exit 2 is both a preset this machine cannot rehearse and a refused command (argparse, an invalid
    configuration): only the first is not a failure."""
    shutil.copy(EXAMPLES / "rehearse_all.sh", tmp_path)
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "qwen3_4b_math.sh").write_text(
        "echo 'error: invalid GrowMTP configuration: --growmtp_k -1' >&2; exit 2\n")
    (tmp_path / "scripts" / "qwen3_4b_code.sh").write_text(
        "echo 'the qwen3_4b preset cannot be rehearsed on this machine: no room' >&2; exit 2\n")
    env = {**os.environ, "GROWMTP_REHEARSAL_DIR": str(tmp_path / "runs")}
    for names, code in ((["qwen3_4b_code"], 0), (["qwen3_4b_math", "qwen3_4b_code"], 1)):
        result = subprocess.run(["bash", str(tmp_path / "rehearse_all.sh"), *names], env=env, capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == code, result.stdout + result.stderr
    assert "qwen3_4b_math" in result.stdout and "FAILED (exit 2" in result.stdout
    assert "not rehearsable here: no room" in result.stdout


def test_the_evaluation_script_refuses_a_rehearsal_before_preparing_anything(tmp_path):
    env = {**os.environ, "GROWMTP_REHEARSAL": "1", "DATA_ROOT": str(tmp_path / "data")}
    result = subprocess.run(["bash", str(EXAMPLES / "scripts" / "evaluate.sh"), str(tmp_path / "run")], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "evaluate.sh has no rehearsal" in result.stderr
    assert not (tmp_path / "data").exists()


def test_qwen3_world_has_the_real_vocabulary_tokens_and_dtype(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    world.build(tmp_path, "qwen3_4b")
    model_dir = tmp_path / "qwen3_4b"
    config = AutoConfig.from_pretrained(model_dir)
    # Qwen/Qwen3-4B: 151,936 embedding rows, tied output embedding, <|endoftext|> bos, <|im_end|> eos
    assert (config.model_type, config.vocab_size, config.tie_word_embeddings) == ("qwen3", 151936, True)
    assert (config.bos_token_id, config.eos_token_id) == (151643, 151645)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert len(tokenizer) == 151669  # the real tokenizer's length (the embedding is padded beyond it)
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [151643, 151644, 151645]
    assert tokenizer.eos_token_id == 151645 and tokenizer.pad_token_id == 151643
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is $17 + 25$?"}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == 151644 and 151645 in ids and tokenizer.decode(ids) == text
    assert tokenizer.decode([151000]) == "<placeholder_151000>"  # every id below the length decodes
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
        assert "lm_head.weight" not in names  # tied: stored once, as in the real checkpoint
        assert {str(f.get_tensor(n).dtype) for n in names} == {"torch.bfloat16"}
    rows = [json.loads(line) for line in (tmp_path / "dapo-math.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and rows[0]["reward_model"]["style"] == "rule-lm"  # 3 steps of 2 prompts


def test_qwen3_5_preset_is_the_text_model_with_its_native_head_at_the_real_vocabulary():
    """The preset's fields (building its world distills the native head at V=248,320 for minutes: the
    rehearsal scripts do that, `make rehearse`; the engine serves this config in tests/vllm/test_qwen3_5.py)."""
    spec = world.preset("qwen3_5_4b_base")
    config = spec.config
    # Qwen/Qwen3.5-4B-Base's language model: 248,320 embedding rows, tied, Gated DeltaNet layers then full
    # attention (full_attention_interval 4), one MTP layer; the text-only model (no vision tower)
    assert (config.model_type, config.vocab_size, config.tie_word_embeddings) == ("qwen3_5_text", 248320, True)
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"] and config.mtp_num_hidden_layers == 1
    assert config.architectures == ["Qwen3_5ForCausalLM"] and getattr(config, "vision_config", None) is None
    assert spec.native_head and (spec.special_base, spec.tokenizer_len) == (248044, 248070)
    assert config.eos_token_id == 248044


def test_unknown_preset_is_refused_before_anything_is_written(tmp_path):
    result = subprocess.run([sys.executable, "-m", "growmtp_lab.rehearse", "world",
                             str(tmp_path / "w"), "qwen4_base"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "unknown model preset 'qwen4_base'" in result.stderr
    assert not (tmp_path / "w").exists()


def steps(*taus: float, **extra) -> list[Step]:
    return [Step(i + 1, {"growmtp/tau": tau, "growmtp/cycles": 100.0, "growmtp/head_finite": 1.0,
                         "rollout/reward_mean": 0.0, **extra}) for i, tau in enumerate(taus)]


def test_native_head_step_fails_below_the_builds_tau_by_more_than_its_margin():
    # Qwen3.5's stand-in at K=3: per-cycle accepted variance 1.2, cycles of a response 3x as alike as
    # independent ones, 1,000 cycles at the build. A step of 250 cycles: standard error of the difference
    # sqrt(1.2 * 3 * (1/250 + 1/1000)) = 0.134, margin 4 of them = 0.537, floor 1.900 - 0.537 = 1.363.
    measured = MeasuredTau(k=3, tau=1.9, cycles=1000, accepted_variance=1.2, design_effect=3.0)
    margin = measured.margin(250)
    assert margin == pytest.approx(MARGIN_STANDARD_ERRORS * math.sqrt(1.2 * 3.0 * (1 / 250 + 1 / 1000)))
    assert margin == pytest.approx(0.537, abs=1e-3)

    def verdict(*taus):
        return check(steps(*taus, **{"growmtp/cycles": 250.0}), 3, 3, True, False, measured=measured)

    assert verdict(1.9, 1.7, 1.37) == []  # within the margin at every step, though below the build's tau
    assert verdict(2.4, 2.6, 2.9) == []  # a head that improves on its build
    failed = verdict(1.9, 1.35, 1.9)  # one step just below the floor fails, the others stand
    assert len(failed) == 1 and failed[0].startswith("step 2: tau 1.350 is below 1.363")
    assert len(verdict(1.0, 1.0, 1.05)) == 3  # a native head that stopped drafting, whatever the last step
    # the margin narrows with the step's cycles (to the build's own error): 1.6 passes at 250 cycles, fails at
    # 20,000 (margin 4 * sqrt(3.6 * (1/20000 + 1/1000)) = 0.246, floor 1.654)
    assert verdict(1.6, 1.6, 1.6) == []
    many = [Step(s.step, {**s.values, "growmtp/cycles": 20000.0}) for s in steps(1.6, 1.6, 1.6)]
    assert len(check(many, 3, 3, True, False, measured=measured)) == 3
    # a random head is not held to the build's tau (it has none)
    assert check(steps(1.0, 1.0, 1.0), 3, 3, True, random_head=True, measured=measured) == []


def test_report_verdicts():
    assert check(steps(1.0, 1.1, 1.2), 3, k=5, trains_head=True, random_head=False) == []
    # a native head at a K its world measured nothing at, that never gets a draft accepted: broken drafting
    assert "no draft was ever accepted" in " ".join(check(steps(1.2, 1.1, 1.0), 3, 5, True, False))
    # a random head at the autoregressive floor is expected this early
    assert check(steps(1.0, 1.0, 1.0), 3, 5, True, random_head=True) == []
    assert "expected 1..3" in " ".join(check(steps(1.1, 1.2), 3, 5, True, False))
    assert "non-finite" in " ".join(check(steps(1.1, 1.1, 1.1, **{"growmtp/head_loss": math.nan}), 3, 5, True, False))
    assert "head update was skipped" in " ".join(check(steps(1.1, 1.1, 1.1, **{"growmtp/head_finite": 0.0}),
                                                       3, 5, True, False))
    frozen = [Step(s.step, {k: v for k, v in s.values.items() if k != "growmtp/head_finite"})
              for s in steps(1.2, 1.2, 1.2)]
    assert check(frozen, 3, 1, trains_head=False, random_head=False) == []
    assert "head update was skipped" in " ".join(check(frozen, 3, 1, trains_head=True, random_head=False))
    ar = [Step(i, {"rollout/reward_mean": 0.5}) for i in (1, 2, 3)]
    assert check(ar, 3, k=0, trains_head=False, random_head=False) == []
    assert "no reward" in " ".join(check([Step(i, {}) for i in (1, 2, 3)], 3, 0, False, False))


# about 2 min (a compiled engine at V=151,936) with native bf16 (AVX-512), 894 s on an AVX2-only machine (bf16 on
# torch's reference path): its hang guard is 30 min. `make test-slow`
@pytest.mark.slow
def test_qwen3_4b_math_rehearses_with_the_scripts_own_flags(tmp_path):
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay under 108 bytes
    env = {**os.environ, "PYTHON": sys.executable, "GROWMTP_REHEARSAL": "1",
           "GROWMTP_REHEARSAL_DIR": str(tmp_path), "GROWMTP_RAY_TMP": ray_tmp}
    try:
        result = subprocess.run(["bash", str(EXAMPLES / "scripts" / "qwen3_4b_math.sh")], capture_output=True,
                                text=True, env=env, cwd=tmp_path, timeout=1800)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-6000:]
    command = next(line for line in result.stdout.splitlines() if line.startswith("+ "))
    for flag in ("--actor.gradient_checkpointing_enable", "--train.colocate_actor_ref", "--algo.kl.use_loss",
                 "--actor.dual_clip 3.0", "--growmtp_neg_adv_weight 0.5", "--ds.param_dtype bf16",
                 "--growmtp_k 5", "--growmtp_head random", "math_reward.py", "--rollout.max_new_tokens 64"):
        assert flag in command, flag
    table = [line for line in result.stdout.splitlines() if re.match(r"step \d: tau", line)]
    assert len(table) == 3 and "rehearsal passed: 3 steps" in result.stdout
    assert not (tmp_path / "ckpt").exists()  # nothing written outside the run directory


def test_tau_statistics_design_effect_is_one_for_independent_cycles_and_grows_with_shared_loops():
    from growmtp_lab.rehearsal.native_head import tau_statistics

    generator = torch.Generator().manual_seed(0)
    # 40 responses of 30 cycles, accepted counts drawn independently from 0..3: the design effect estimates 1
    # with a relative spread of sqrt(2 / 39) = 0.23, so it lands in [1, 1.7] (at 3 spreads; it is floored at 1)
    independent = [torch.randint(0, 4, (30,), generator=generator) for _ in range(40)]
    stats = tau_statistics(independent)
    assert stats["cycles"] == 1200 and stats["tau"] == pytest.approx(1 + torch.cat(independent).double().mean().item())
    assert stats["accepted_variance"] == pytest.approx(1.25, rel=0.1)  # a uniform count on 0..3: (4^2 - 1) / 12
    assert 1.0 <= stats["design_effect"] < 1.7
    # every response loops (all its cycles accept 3) or never drafts (all 0): a response's 30 cycles are one
    # draw, so the design effect is 30 (times 40 / 39 from the R - 1, to the variance's own n - 1 correction)
    looped = [torch.full((30,), 3 * (i % 2)) for i in range(40)]
    assert tau_statistics(looped)["design_effect"] == pytest.approx(30 * 40 / 39, rel=1e-3)


# about 2 min with native bf16, 621 s on an AVX2-only machine; its hang guard is 30 min. `make test-slow`
@pytest.mark.slow
def test_the_smoke_switch_runs_the_matched_autoregressive_baseline_on_cpu_with_a_verdict(tmp_path):
    """GROWMTP_SMOKE=1 without CUDA is the rehearsal's CPU run with the smoke's verdict; the autoregressive arm
    on GrowMTP's runner logs the step metrics a GrowMTP run logs (the GrowMTP arm: by hand, docs/guide.md)."""
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    env = {**os.environ, "PYTHON": sys.executable, "GROWMTP_SMOKE": "1", "MATCHED_RUNNER": "1",
           "GROWMTP_REHEARSAL_DIR": str(tmp_path), "GROWMTP_RAY_TMP": ray_tmp}
    env.pop("GROWMTP_REHEARSAL", None)
    if torch.cuda.is_available():  # the switch would run on the GPUs: ask for the CPU explicitly
        env["GROWMTP_REHEARSAL"] = "1"
    try:
        result = subprocess.run(["bash", str(EXAMPLES / "scripts" / "baseline_ar.sh"), "qwen3_4b", "math"],
                                capture_output=True, text=True, env=env, cwd=tmp_path, timeout=1800)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-6000:]
    assert torch.cuda.is_available() or "the smoke runs on this CPU, as a rehearsal" in result.stdout
    assert "[taken] vLLM's V1 model runner, forced" in result.stdout  # --vllm.runner growmtp at K = 0
    assert "SMOKE PASSED" in result.stdout and "[FAIL]" not in result.stdout
    rows = [json.loads(line) for line in (tmp_path / "runs" / "qwen3_4b_math_k0_matched_smoke" / "ckpt"
                                          / "growmtp_metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:  # the rollout and step metrics the GrowMTP arm logs, measured
        assert row["growmtp/rollout_s"] > 0 and row["growmtp/step_s"] > row["growmtp/rollout_s"]
        assert row["growmtp/mem_trainer_peak_gib"] > 0 and row["growmtp/mem_engine_peak_gib"] > 0


def test_native_heads_speculative_sampling_commits_its_cycles_and_accepts_as_sum_min_p_q(monkeypatch):
    """The native head's tau measurement (`native_head.accepted_counts`) on a tiny Qwen3 stand-in: every response
    commits its cycles' accepted drafts plus one token until NEW_TOKENS, and the first drafts pass as often as
    sum min(p_1, q_1) of the rows it verified with predicts (`reference_drafting.acceptance_z`, within 5 sigma)."""
    from transformers import Qwen3ForCausalLM

    from helpers.tiny import make_head, tiny_backbone_config
    from growmtp_lab import reference_drafting
    from growmtp_lab.rehearsal import native_head

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(tiny_backbone_config("qwen3")).eval()
    head = make_head("qwen3", std=0.05)
    counts = {"cycles": 0, "first_accepted": 0.0, "alpha_sum": 0.0, "alpha_var": 0.0}

    def recording(p, q, drafts, generator):
        accepted, token = reference_drafting.rejection_step(p, q, drafts, generator)
        alpha = float(torch.minimum(p[0, 0], q[0, 0]).sum())
        counts["cycles"] += 1
        counts["first_accepted"] += float(accepted[0] >= 1)
        counts["alpha_sum"] += alpha
        counts["alpha_var"] += alpha * (1 - alpha)
        return accepted, token

    monkeypatch.setattr(native_head, "rejection_step", recording)
    per_response = native_head.accepted_counts(model, head, [[1, 5, 9], [2, 7]], rows=4, k=2, seed=0)
    assert len(per_response) == 8
    for accepted in per_response:  # x_P from the prefill, then accepted + 1 per cycle; the last one crosses
        made = 1 + int((accepted + 1).sum())
        assert made >= native_head.NEW_TOKENS and made - int(accepted[-1] + 1) < native_head.NEW_TOKENS
    assert counts["cycles"] == sum(len(a) for a in per_response)
    # power: a few hundred cycles put 5 sigma near 0.1, while a rule that accepted every draft, or none, would miss
    # sum min(p_1, q_1) by its whole distance to 1 or 0
    alpha = counts["alpha_sum"] / counts["cycles"]
    assert 0.05 < alpha < 0.95 and 5 * counts["alpha_var"] ** 0.5 / counts["cycles"] < 0.2
    assert abs(reference_drafting.acceptance_z(counts)) <= 5.0
