"""Every example script under GROWMTP_DRY_RUN=1: it builds its full command, the training CLI runs every
startup check (ours, then upstream's), and it exits 0 without starting Ray or writing anything.

The models are the scripts' DEFAULT hub ids (`common.sh`), served from a huggingface_hub cache made here with
the hub off (HF_HUB_OFFLINE=1): config-only snapshots of the real families (the checks read only config.json)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from openrlhf_growmtp.core.checkpoint import export_head
from helpers.hub_cache import add_to_hub_cache
from helpers.tiny import make_head, tiny_backbone_config

SCRIPTS = Path(__file__).resolve().parents[2] / "examples" / "scripts"
MODELS = {"QWEN3_4B": "qwen3", "QWEN3_5_4B_BASE": "qwen3_5", "MIMO_7B_SFT": "mimo"}
ABLATIONS = ["ce", "kl", "tv", "no_vgm", "teacher_forcing", "joint", "frozen"]
# (script, args, extra env, flags its command line must carry)
CASES = {
    "qwen3_4b_math": ("qwen3_4b_math.sh", [], {}, ["--growmtp_k 5", "--growmtp_head random",
                                                   "--growmtp_chunk_cycles 4096",
                                                   "--rollout.max_new_tokens 8192", "math_reward.py"]),
    "qwen3_4b_code": ("qwen3_4b_code.sh", [], {}, ["--growmtp_k 5", "code_reward.py"]),
    "qwen3_5_math": ("qwen3_5_4b_base_math.sh", [], {}, ["--growmtp_k 3", "--growmtp_head native",
                                                         "--rollout.max_new_tokens 16384"]),
    "qwen3_5_code": ("qwen3_5_4b_base_code.sh", [], {}, ["--growmtp_k 3", "--growmtp_head native"]),
    "mimo_math": ("mimo_7b_sft_math.sh", [], {}, ["--growmtp_k 5", "--growmtp_head native"]),
    # the smoke's command: short, few steps, the heads compared after every sync, its own run directory
    "mimo_code": ("mimo_7b_sft_code.sh", [], {"GROWMTP_SMOKE": "1"},
                  ["--growmtp_k 5", "--growmtp_check_sync", "--rollout.batch_size 8 --rollout.n_samples_per_prompt 4",
                   "--data.max_samples 24", "--rollout.max_new_tokens 512", "/mimo_7b_sft_code_k5_smoke/ckpt"]),
    "mimo_math_k3": ("mimo_7b_sft_math.sh", [], {"K": "3"}, ["--growmtp_k 3"]),
    "mimo_math_k7": ("mimo_7b_sft_math.sh", [], {"K": "7", "MAX_NUM_SEQS": "64"},
                     ["--growmtp_k 7", "--vllm.max_num_seqs 64"]),
    "ar_qwen3_4b_math": ("baseline_ar.sh", ["qwen3_4b", "math"], {"MAX_NUM_SEQS": "64"},
                         ["--growmtp_k 0", "--vllm.max_num_seqs 64"]),
    # the matched baseline: GrowMTP's runner and scheduling for the autoregressive arm
    "ar_mimo_code": ("baseline_ar.sh", ["mimo_7b_sft", "code"], {"MATCHED_RUNNER": "1"},
                     ["--growmtp_k 0", "--vllm.runner growmtp", "/mimo_7b_sft_code_k0_matched/ckpt"]),
    "frozen_k1_math": ("baseline_frozen_k1.sh", ["math"], {}, ["--growmtp_k 1", "--growmtp_mode frozen"]),
    **{f"ablation_{arm}": ("ablation.sh", [arm], {}, []) for arm in ABLATIONS},
}
ABLATION_FLAGS = {"ce": "--growmtp_loss ce", "kl": "--growmtp_loss kl", "tv": "--growmtp_loss tv",
                  "no_vgm": "--growmtp_no_vgm", "teacher_forcing": "--growmtp_teacher_forcing",
                  "joint": "--growmtp_mode joint", "frozen": "--growmtp_mode frozen"}
# left to `make test-slow`: further K for one script, the ablation arms past the first (each is one flag of the
# same script, and tests/trainer/test_startup.py checks every arm's command in process), the code twins of
# Qwen's math scripts (common.sh builds both; MiMo's code script runs here as the smoke) and the autoregressive
# baseline of Qwen3-4B (baseline_ar.sh runs here as MiMo's matched one)
SLOW_CASES = ("mimo_math_k3", "mimo_math_k7", *(f"ablation_{arm}" for arm in ABLATIONS[1:]), "qwen3_4b_code",
              "qwen3_5_code", "ar_qwen3_4b_math")
# overrides each script refuses by name: variable -> (value, what stderr says)
BAD_OVERRIDES = {"K": ("99", "deeper than this head supports"), "HEAD": ("native", "ships no native MTP layer"),
                 "QWEN3_4B": ("TinyOrg/Not-Cached",
                              "--actor.model_name_or_path TinyOrg/Not-Cached: not a local directory")}


PAPER_GRPO = ["--growmtp_neg_adv_weight 0.5", "--actor.dual_clip 3.0", "--actor.loss_agg_mode token-mean",
              "--algo.kl.use_loss --algo.kl.init_coef 0.01", "--actor.adam.lr 1e-6 --actor.lr_scheduler constant",
              "--actor.eps_clip 0.2", "--rollout.batch_size 64 --rollout.n_samples_per_prompt 8",
              "--rollout.temperature 1.0 --rollout.top_p 1.0", "--train.seed 1"]


def default_model_ids() -> dict[str, str]:
    """The hub id each model variable of common.sh defaults to (`${QWEN3_4B:-Qwen/Qwen3-4B}`)."""
    text = (SCRIPTS / "common.sh").read_text()
    ids = {variable: re.search(r"\$\{" + variable + r":-([^}]+)\}", text) for variable in MODELS}
    assert all(ids.values()), ids
    return {variable: found.group(1) for variable, found in ids.items()}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The scripts' own defaults: no model variable set, every default id in a hub cache, the hub off."""
    cache = tmp_path_factory.mktemp("hub")
    for variable, repo_id in default_model_ids().items():
        raw = tiny_backbone_config(MODELS[variable]).to_dict()
        if MODELS[variable] == "mimo":
            raw["model_type"] = "mimo"
        add_to_hub_cache(cache, repo_id, {"config.json": raw})
    hub_settings = ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", *MODELS)
    base = {key: value for key, value in os.environ.items() if key not in hub_settings}
    return {**base, "PYTHON": sys.executable, "GROWMTP_DRY_RUN": "1", "HF_HUB_CACHE": str(cache),
            "HF_HUB_OFFLINE": "1"}


def run_script(script: str, args: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPTS / script), *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=300)


def run_many(jobs: dict) -> dict[str, subprocess.CompletedProcess]:
    """`run_script(*job)` for each named job, two at a time: each is mostly upstream's imports."""
    with ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(run_script, *job) for name, job in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


def run_cases(names, env: dict, cwd: Path) -> dict[str, subprocess.CompletedProcess]:
    return run_many({name: (CASES[name][0], CASES[name][1], {**env, **CASES[name][2]}, cwd) for name in names})


@pytest.fixture(scope="module")
def results(env, qwen3_4b_full_size, tmp_path_factory):
    """Every case outside SLOW_CASES, with the bad overrides' runs ("bad_<VARIABLE>", their own directory) and the
    full-size Qwen3-4B's ("memory", its own directory) in the same pool: one queue of script runs keeps both cores
    busy to its end."""
    cwd, elsewhere = tmp_path_factory.mktemp("cwd"), tmp_path_factory.mktemp("elsewhere")
    jobs = {name: (CASES[name][0], CASES[name][1], {**env, **CASES[name][2]}, cwd)
            for name in CASES if name not in SLOW_CASES}
    jobs.update({f"bad_{name}": ("qwen3_4b_math.sh", [], {**env, name: value}, elsewhere)
                 for name, (value, _) in BAD_OVERRIDES.items()})
    jobs["memory"] = ("qwen3_4b_math.sh", [], {**env, "QWEN3_4B": str(qwen3_4b_full_size)}, elsewhere)
    return run_many(jobs), cwd


@pytest.fixture(scope="module")
def slow_results(env, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("cwd_slow")
    return run_cases(SLOW_CASES, env, cwd), cwd


def test_every_script_is_covered():
    covered = {script for script, *_ in CASES.values()} | {"evaluate.sh"}  # evaluate.sh: tests at the end
    assert covered == {p.name for p in SCRIPTS.glob("*.sh")} - {"common.sh"}


@pytest.mark.parametrize("name", [name for name in CASES if name not in SLOW_CASES])
def test_dry_run_passes_every_check_and_starts_nothing(results, name):
    check_dry_run(*results, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW_CASES)
def test_dry_run_of_further_k_ablation_arms_code_twins_and_the_ar_baseline(slow_results, name):
    check_dry_run(*slow_results, name)


def check_dry_run(out: dict, cwd: Path, name: str) -> None:
    result = out[name]
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "passed every startup check; not starting Ray" in result.stdout
    command = next(line for line in result.stdout.splitlines() if line.startswith("+ "))
    expected = CASES[name][3] + ([ABLATION_FLAGS[name.removeprefix("ablation_")]]
                                 if name.startswith("ablation") else [])
    for flag in expected + PAPER_GRPO:
        assert flag in command, (flag, command)
    assert "Started a local Ray instance" not in result.stdout + result.stderr
    assert not list(cwd.iterdir())  # no data prepared, no run directory, no head materialised
    assert f"--actor.model_name_or_path {default_model_ids()[model_variable(name)]} " in command  # its default id
    assert f"--ckpt.path {cwd}/runs/" in command  # an absolute output root, the working directory's by default
    smoke = CASES[name][2].get("GROWMTP_SMOKE") == "1"
    assert ("Paths of this run that have never run on a GPU" in result.stdout) == smoke
    if smoke:  # each untried path with the fallback for it, before the run
        assert "[taken] the policy's NCCL weight sync" in result.stdout and "--vllm.sync_backend ray" in result.stdout
        assert "[not taken] tensor-parallel engines over Ray" in result.stdout


def model_variable(case: str) -> str:
    if case.startswith(("qwen3_4b", "ar_qwen3_4b")):
        return "QWEN3_4B"
    if case.startswith("qwen3_5"):
        return "QWEN3_5_4B_BASE"
    return "MIMO_7B_SFT"  # MiMo's scripts, its baselines and the ablations (MiMo's native head)


@pytest.mark.parametrize("variable", BAD_OVERRIDES)
def test_dry_run_reports_a_bad_override(results, variable):
    result = results[0][f"bad_{variable}"]
    assert result.returncode == 2 and BAD_OVERRIDES[variable][1] in result.stderr


def test_unknown_ablation_arm_is_refused(env, tmp_path):
    result = run_script("ablation.sh", ["dropout"], env, tmp_path)
    assert result.returncode == 2 and "unknown ablation arm 'dropout'" in result.stderr


# ----------------------------------------------------------------------------- evaluate.sh

EVAL_FLAGS = ["--math-samples 16", "--code-samples 4", "--temperature 1.0 --top-p 0.7", "--max-tokens 16384",
              "--time-limit-s 6"]


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A run directory as training leaves it (a config-only final export, its head trained at K=5) and
    prepared benchmark files, named through the script's environment variables."""
    run = tmp_path_factory.mktemp("run")
    (run / "final").mkdir()
    (run / "final" / "config.json").write_text(json.dumps(tiny_backbone_config("qwen3").to_dict()))
    head = make_head("qwen3")
    head.config.growmtp_trained_k = 5
    export_head(head, run / "final" / "growmtp_head")
    prompt = [{"role": "user", "content": "2 + 5?"}]
    math = [{"id": str(i), "prompt": prompt, "label": "7"} for i in range(3)]
    stdin = {"id": "a", "prompt": prompt, "label": json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]})}
    call = {"id": "l", "prompt": prompt, "label": json.dumps({"fn_name": "f", "inputs": ["[1]\n2"], "outputs": ["3"]})}
    data = {"AIME24_DATA": write_jsonl(run / "aime24.jsonl", math),
            "AIME25_DATA": write_jsonl(run / "aime25.jsonl", math),
            "AMC23_DATA": write_jsonl(run / "amc23.jsonl", math[:2]),
            "LCB_ATCODER_DATA": write_jsonl(run / "atcoder.jsonl", [stdin]),
            "LCB_LEETCODE_DATA": write_jsonl(run / "leetcode.jsonl", [call, call])}
    return run, data


def test_evaluate_script_dry_run_checks_the_run_and_every_benchmark(env, finished_run, tmp_path):
    run, data = finished_run
    result = run_script("evaluate.sh", [str(run)], {**env, **data}, tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    command = next(line for line in result.stdout.splitlines() if line.startswith("+ "))
    for flag in EVAL_FLAGS + [f"--model {run}/final", f"--head {run}/final/growmtp_head"]:
        assert flag in command, (flag, command)
    assert ("K=5, aime24 (3 math problems), aime25 (3 math problems), amc23 (2 math problems), lcb_atcoder "
            "(1 code problems), lcb_leetcode (2 code problems): passed every startup check") in result.stdout
    assert not list(tmp_path.iterdir()) and not (run / "eval").exists()  # nothing prepared, nothing written

    math_only = run_script("evaluate.sh", [str(run), "math"], {**env, **data}, tmp_path)
    assert math_only.returncode == 0 and "--code " not in math_only.stdout and "amc23 (2 math" in math_only.stdout
    assert "lcb_" not in math_only.stdout


def test_evaluate_script_refuses_a_bad_benchmark_or_head(env, finished_run, tmp_path):
    run, data = finished_run
    broken = write_jsonl(tmp_path / "broken.jsonl", [{"prompt": "p", "label": json.dumps(
        {"fn_name": "f", "inputs": ["[1,"], "outputs": ["3"]})}])
    data_env = {**env, **data}
    out = run_many({"label": ("evaluate.sh", [str(run), "code"], {**data_env, "LCB_LEETCODE_DATA": broken}, tmp_path),
                    "head": ("evaluate.sh", [str(tmp_path / "no_run"), "math"], data_env, tmp_path),
                    "domain": ("evaluate.sh", [str(run), "vision"], data_env, tmp_path)})
    assert out["label"].returncode != 0 and "row 0 label: call-based test 0: not JSON" in out["label"].stderr
    assert out["head"].returncode != 0 and "not a head directory" in out["head"].stderr
    assert out["domain"].returncode == 2 and "unknown domain 'vision'" in out["domain"].stderr


def test_evaluate_script_refuses_a_missing_livecodebench_file_before_preparing_anything(env, finished_run, tmp_path):
    """LiveCodeBench's file is one the user downloads: without it (nor its prepared slices) the script stops
    first, naming LCB_SOURCE, where it used to stop after preparing the three math benchmarks."""
    run, data = finished_run
    root = tmp_path / "data"
    root.mkdir()
    math = {name: data[name] for name in ("AIME24_DATA", "AIME25_DATA", "AMC23_DATA")}
    result = run_script("evaluate.sh", [str(run)], {**env, **math, "DATA_ROOT": str(root)}, tmp_path)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    assert f"LiveCodeBench: {root}/livecodebench/test6.jsonl does not exist (LCB_SOURCE)" in result.stderr
    assert "+ " not in result.stdout and not list(root.iterdir())
    math_only = run_script("evaluate.sh", [str(run), "math"], {**env, **math, "DATA_ROOT": str(root)}, tmp_path)
    assert math_only.returncode == 0, math_only.stderr[-3000:]


def test_evaluate_script_reads_its_benchmarks_under_data_root(env, finished_run, tmp_path):
    """Without AIME24_DATA and the like, the prepared files are DATA_ROOT's, as for the training scripts."""
    run, data = finished_run
    root = tmp_path / "shared" / "data"
    root.mkdir(parents=True)
    names = {"AIME24_DATA": "aime24", "AIME25_DATA": "aime25", "AMC23_DATA": "amc23",
             "LCB_ATCODER_DATA": "lcb_v6_atcoder", "LCB_LEETCODE_DATA": "lcb_v6_leetcode"}
    for variable, name in names.items():
        (root / f"{name}.jsonl").write_text(Path(data[variable]).read_text())
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    result = run_script("evaluate.sh", [str(run)], {**env, "DATA_ROOT": str(root)}, cwd)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    command = next(line for line in result.stdout.splitlines() if line.startswith("+ "))
    for name in names.values():
        assert f"={root}/{name}.jsonl" in command, (name, command)
    assert "lcb_v6_leetcode (2 code problems)" in result.stdout or "lcb_leetcode (2 code problems)" in result.stdout
    assert not list(cwd.iterdir())  # nothing under the working directory's data/


# ----------------------------------------------------------------------------- memory per training GPU

@pytest.fixture(scope="module")
def qwen3_4b_full_size(tmp_path_factory):
    """Qwen3-4B's released config fields, config only: the dry run counts its parameters on the meta device."""
    from transformers import Qwen3Config

    model = tmp_path_factory.mktemp("qwen3_4b")
    Qwen3Config(hidden_size=2560, num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=9728,
                num_hidden_layers=36, vocab_size=151936, tie_word_embeddings=True,
                max_position_embeddings=40960).save_pretrained(model)
    return model


def test_the_dry_run_estimates_memory_and_warns_when_a_run_exceeds_the_card(results, monkeypatch):
    """The script's dry run prints the estimate for its preset; the same command line, parsed here with one flag or
    the card changed, gets the warning (or the refusal) from the function the dry run prints (one script run, not
    four: each costs upstream's imports)."""
    from benchmarks import envelope  # the same arithmetic, tabulated for the presets (docs/guide.md, the envelope)
    from openrlhf_growmtp import cpu_support
    from openrlhf_growmtp.cli.train_ppo_ray import memory_lines
    from openrlhf_growmtp.memory_estimate import CARD_ENV
    from openrlhf_growmtp.trainer.args import parse_train_args

    def estimate(argv: list[str]) -> str:  # the lines the dry run prints, from upstream's grouped namespace
        from openrlhf.utils.config import hierarchize

        return "\n".join(memory_lines(hierarchize(parse_train_args(argv))))

    preset = envelope.recipe_training_gpu(envelope.RECIPES[0])["estimate_gib"]
    result = results[0]["memory"]  # the script's run on the full-size config (in the pool of script runs)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    fits = result.stdout
    assert f"memory per training GPU, by arithmetic (docs/guide.md, the envelope): {preset:.1f} GiB" in fits
    assert "of a 80 GiB card (the default; $GROWMTP_CARD_GIB sets it: the dry run sees no GPU)" in fits
    assert "WARNING" not in fits

    cpu_support.activate()  # upstream's parser imports openrlhf.models: the flash_attn shim first, as the CLI does
    command = shlex.split(next(line for line in fits.splitlines() if line.startswith("+ "))[2:])
    argv = command[command.index("openrlhf_growmtp.cli.train_ppo_ray") + 1:]
    assert estimate(argv) in fits  # what the script printed, reproduced here

    monkeypatch.setenv(CARD_ENV, "100")
    micro8 = estimate([*argv, "--train.micro_batch_size", "8"])
    assert "micro-batch logits 83.5" in micro8  # 8 x 9,216 tokens x 151,936 ids x 8 bytes (the fp32 logits and grad)
    assert "exceeds the 90 GiB it allows of a 100 GiB card" in micro8
    monkeypatch.setenv(CARD_ENV, "40")
    small_card = estimate(argv)
    assert f"this run's estimate, {preset:.1f} GiB per training GPU, exceeds the 36 GiB" in small_card
    monkeypatch.setenv(CARD_ENV, "80GB")
    with pytest.raises(SystemExit, match=r"\$GROWMTP_CARD_GIB='80GB': not a number of GiB"):
        estimate(argv)


def test_each_presets_micro_batches_are_the_envelopes(results):
    """The scripts' command lines carry the micro-batches the envelope's arithmetic chose (tests/benchmarks/
    test_envelope.py holds those to the card), and the checkpoint interval its expectations read."""
    from benchmarks import envelope

    out, _ = results
    for case, recipe in zip(("qwen3_4b_math", "qwen3_5_math", "mimo_math"), envelope.RECIPES):
        command = next(line for line in out[case].stdout.splitlines() if line.startswith("+ "))
        assert (f"--train.micro_batch_size {recipe.micro_batch} "
                f"--rollout.micro_batch_size {recipe.rollout_micro_batch} ") in command, (case, command)
        assert f"--ckpt.save_steps {envelope.SAVE_STEPS} " in command
