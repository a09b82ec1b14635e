"""The CPU worlds and their GRPO runs: what `make demo`, `make reproduce` and `make ablations` launch.

Every setting here was chosen before the runs it governs, and is not adjusted toward any result
(docs/ablations.md lists them with their reasons):

- `demo`: the demo's world (`worlds/demo_world.py`): a 2-layer policy on worked additions, a 32-word vocabulary,
  K=3 with the top-16; each RL step's 64 samples train in mini-batches of 16 for 3 epochs (12 policy
  steps per RL step).
- `paper`: the paper's proportions (`worlds/paper_world.py`): an 8-layer policy, a 4,096-token BPE, a
  one-layer head, K=5 with the top-64, responses of about 110 tokens, 8 prompts x 8 samples in one policy
  step per RL step. Its head LR is the demo's scaled by the inverse width (3e-3 x 128/256). Its 40 RL
  steps were set by the time the ablations could take on 2 cores (docs/ablations.md gives the reckoning).
- `reasoning`: the real regime's statistics (`worlds/reasoning_world.py`, docs/from_scratch.md): the demo's task
  with 3-6 digits and a connective fork before each column, a 4,096-word vocabulary, an 8-layer policy of the
  paper world's width; the paper world's recipe (K=5, top-64, one policy step per RL step, head LR 1.5e-3).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from growmtp_lab.worlds.paper_world import build_paper_world
from growmtp_lab.worlds.demo_world import World, build_world
from growmtp_lab.worlds.reasoning_world import build_reasoning_world
from growmtp_lab.worlds.speed_world import build_speed_world

WORLDS_DIR = Path(__file__).resolve().parent / "worlds"


@dataclass(frozen=True)
class Recipe:
    """One world's GRPO run through the training CLI."""

    steps: int  # RL steps
    prompts_per_step: int
    samples_per_prompt: int
    train_batch: int  # samples per policy step: prompts_per_step x samples_per_prompt for one per RL step
    epochs: int
    actor_lr: str
    k: int
    topk: int
    head_lr: str
    head_warmup_steps: int  # RL steps
    max_new_tokens: int
    max_len: int = 128  # --data.max_len: prompt and response together (upstream cuts the prompt to the rest)
    micro_batch: int = 8
    zero_stage: int = 2  # ZeRO-3's gathers cost more than they save at these sizes (tests run both stages)
    max_num_seqs: int | None = None  # --vllm.max_num_seqs, both arms (None: vLLM's default)


@dataclass(frozen=True)
class WorldRecipes:
    build: Callable[..., World]
    reward: Path  # the reward file for `--reward.remote_url`
    recipes: dict[str, Recipe]  # "full" and "quick"


# the paper world's recipes, which the reasoning world takes too (docs/from_scratch.md)
PAPER_RECIPES = {
    "full": Recipe(steps=40, prompts_per_step=8, samples_per_prompt=8, train_batch=64, epochs=1, actor_lr="5e-5", k=5,
                   topk=64, head_lr="1.5e-3", head_warmup_steps=10, max_new_tokens=160, max_len=256),
    "quick": Recipe(steps=3, prompts_per_step=4, samples_per_prompt=4, train_batch=16, epochs=1, actor_lr="5e-5", k=5,
                    topk=64, head_lr="1.5e-3", head_warmup_steps=1, max_new_tokens=160, max_len=256)}

WORLDS = {
    "demo": WorldRecipes(build_world, WORLDS_DIR / "demo_reward.py", {
        "full": Recipe(steps=100, prompts_per_step=16, samples_per_prompt=4, train_batch=16, epochs=3,
                       actor_lr="1e-4", k=3, topk=16, head_lr="3e-3", head_warmup_steps=5, max_new_tokens=64),
        "quick": Recipe(steps=4, prompts_per_step=8, samples_per_prompt=4, train_batch=16, epochs=3,
                        actor_lr="1e-4", k=3, topk=16, head_lr="3e-3", head_warmup_steps=1, max_new_tokens=64)}),
    "speed": WorldRecipes(build_speed_world, WORLDS_DIR / "demo_reward.py", {
        "full": Recipe(steps=50, prompts_per_step=4, samples_per_prompt=4, train_batch=16, epochs=1,
                       actor_lr="5e-5", k=3, topk=16, head_lr="1.5e-3", head_warmup_steps=5, max_new_tokens=64,
                       max_num_seqs=2),
        # the smoke test's and `make reproduce`'s: the same pipeline at its smallest (one micro-batch per rank)
        "quick": Recipe(steps=3, prompts_per_step=2, samples_per_prompt=4, train_batch=8, epochs=1,
                        actor_lr="5e-5", k=3, topk=16, head_lr="1.5e-3", head_warmup_steps=1, max_new_tokens=64,
                        micro_batch=4, max_num_seqs=2)}),
    "paper": WorldRecipes(build_paper_world, WORLDS_DIR / "paper_reward.py", PAPER_RECIPES),
    "reasoning": WorldRecipes(build_reasoning_world, WORLDS_DIR / "reasoning_reward.py", PAPER_RECIPES),
}


def train_command(world: World, arm_dir: Path, recipe: Recipe, k: int, reward: Path, seed: int = 42,
                  one_policy_step: bool = False) -> list[str]:
    """The training CLI's command for one arm (K = 0: the autoregressive arm, upstream's run);
    `one_policy_step`: the RL step's samples in one policy step (`--growmtp_mode joint` needs it)."""
    samples = recipe.prompts_per_step * recipe.samples_per_prompt
    batch, epochs = (samples, 1) if one_policy_step else (min(recipe.train_batch, samples), recipe.epochs)
    cmd = [
        sys.executable, "-m", "openrlhf_growmtp.cli.train_ppo_ray",
        "--actor.model_name_or_path", str(world.policy), "--actor.num_nodes", "1", "--actor.num_gpus_per_node", "2",
        "--ds.zero_stage", str(recipe.zero_stage), "--vllm.num_engines", "1", "--vllm.enforce_eager",
        "--data.prompt_dataset", str(world.prompts), "--data.input_key", "input", "--data.label_key", "label",
        "--data.max_samples", str(recipe.steps * recipe.prompts_per_step),
        "--data.max_len", str(recipe.max_len),
        "--rollout.max_new_tokens", str(recipe.max_new_tokens), "--rollout.batch_size", str(recipe.prompts_per_step),
        "--rollout.n_samples_per_prompt", str(recipe.samples_per_prompt),
        "--rollout.micro_batch_size", str(recipe.micro_batch),
        "--train.batch_size", str(batch), "--train.max_epochs", str(epochs),
        "--train.micro_batch_size", str(recipe.micro_batch), "--train.num_episodes", "1",
        "--train.seed", str(seed), "--algo.advantage.estimator", "group_norm", "--algo.kl.init_coef", "0",
        "--reward.remote_url", str(reward), "--actor.adam.lr", recipe.actor_lr,
        "--actor.lr_scheduler", "constant_with_warmup",
        "--ckpt.path", str(arm_dir / "ckpt"), "--ckpt.output_dir", str(arm_dir / "final"),
        "--logger.tensorboard_dir", str(arm_dir / "tensorboard"),
        "--train.full_determinism_enable",  # reproducible rollouts and data order (trainer/rollout_order.py)
        "--growmtp_k", str(k),
    ]
    if recipe.max_num_seqs is not None:
        cmd += ["--vllm.max_num_seqs", str(recipe.max_num_seqs)]
    if k:
        cmd += ["--growmtp_head", str(world.head), "--growmtp_topk", str(recipe.topk),
                "--growmtp_head_lr", recipe.head_lr, "--growmtp_head_warmup_steps", str(recipe.head_warmup_steps)]
    return cmd
