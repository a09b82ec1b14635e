"""The GPU check's world: Qwen3-4B's real config (or a tiny one of the same layout for CPUs), a policy of
random weights, a random K=5 head bound to the policy's tied embedding, and the sizes of each check."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from transformers import Qwen3Config, Qwen3ForCausalLM

from benchmarks.shared.bench_common import qwen3_4b_config
from openrlhf_growmtp.core import MTPHead, init_random_head_, make_head_config
from openrlhf_growmtp.core.families import get_family
from openrlhf_growmtp.core.reconstruction import CHUNK_CYCLES

# The head's logits are given this spread (std over the vocabulary) by its final norm's scale: a random
# head's logits have std ~1 (q nearly uniform over 151,936 ids), a trained model's spread over tens of
# units, and bf16 rounds a logit to within |logit| x 2^-9, so the check runs where rounding matters.
# At std 4, q's top-64 holds ~0.7 of its mass (measured on Gaussian logits at V=151,936).
LOGIT_STD = 4.0
# The policy's final-norm scale where a head must reach the paper's tau: its logits then have std ~0.5 over
# the vocabulary (transformers' init gives ~1). Sum min(p, q) of a head whose q is unrelated to p cannot
# exceed sum min(p, 1/V): 0.62 at std 1, 0.80 at 0.5; the paper's tau of 2.91 at K = 5 needs 0.70 per position.
POLICY_NORM_SCALE = 0.5


@dataclass(frozen=True)
class Plan:
    """The sizes of one run of the check."""

    name: str  # "Qwen3-4B" or "tiny"
    config: Qwen3Config  # the policy's (num_hidden_layers included)
    k: int
    topk: int
    # (a), (b): one response per prompt length (a long prompt puts cycles at long RoPE positions and
    # over a long prefix), `recon_cycles` cycles each, reconstructed in chunks of `recon_chunk` cycles
    # (chunks that cut through a response) and in one chunk
    recon_prompts: tuple[int, ...]
    recon_cycles: int
    recon_chunk: int
    # (c): the head update against the policy's forward + backward over the same responses
    responses: int
    prompt_tokens: int
    response_tokens: int
    tau: float
    micro_batch: int
    repeats: int
    chunk_cycles: int
    budget_s: float  # what (c)'s timed runs may take; fewer responses are timed where they would not fit
    # (d): rejection-sampled chains and trials per chain
    sampler_chains: int
    sampler_trials: int
    # trainer_step: a policy of `trainer_layers` layers at the plan's widths (None: as many as the device's
    # memory holds, `gpu_trainer.layers_that_fit`), `trainer_responses` responses of `trainer_prompt` +
    # `trainer_response_tokens` tokens drafted at tau `tau_target`, `trainer_steps` RL steps per side
    trainer_layers: int | None
    trainer_responses: int
    trainer_prompt: int
    trainer_response_tokens: int
    trainer_steps: int
    tau_target: float
    # cycle_cost: `cycle_batch` sequences at each of `cycle_contexts` cached tokens, policies of
    # `cycle_depths` layers fitted to `real_layers`, medians of `cycle_repeats`; training fwd + bwd over
    # `train_tokens` tokens per depth; rollouts of `rollout_prompt` + `rollout_response` tokens predicted
    cycle_batch: int
    cycle_contexts: tuple[int, ...]
    cycle_depths: tuple[int, ...]
    cycle_repeats: int
    train_tokens: int
    real_layers: int
    rollout_prompt: int
    rollout_response: int

    def trainer_config(self, layers: int) -> Qwen3Config:
        fields = {**self.config.to_dict(), "num_hidden_layers": layers}
        fields.pop("layer_types", None)  # one per layer: derived again for the new depth
        return Qwen3Config.from_dict(fields)


def tiny_config(num_layers: int = 2) -> Qwen3Config:
    """Qwen3-4B's layout (GQA 2:1, qk-norm, tied embedding, RoPE base 1e6) at widths a CPU runs in seconds."""
    return Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       intermediate_size=192, num_hidden_layers=num_layers, vocab_size=2048, tie_word_embeddings=True,
                       initializer_range=0.02, max_position_embeddings=4096, rope_theta=1000000.0, rms_norm_eps=1e-6)


# The paper's step is 512 responses of up to 8,192 tokens on 8 GPUs (64 per GPU). 64 responses of 4,096
# tokens are one GPU's share at half the cap; `budget_s` keeps (c) inside a 10-minute command.
# trainer_step and cycle_cost: the paper's K = 5 at its tau of 2.91; rollouts of its 8,192-token cap after a
# 256-token prompt (the paper truncates prompts at 1,024 and gives no mean).
REAL = Plan(name="Qwen3-4B", config=qwen3_4b_config(36), k=5, topk=64, recon_prompts=(48, 2048), recon_cycles=64,
            recon_chunk=48, responses=64, prompt_tokens=256, response_tokens=4096, tau=3.0, micro_batch=2,
            repeats=3, chunk_cycles=CHUNK_CYCLES["cuda"], budget_s=150.0, sampler_chains=4, sampler_trials=2**20,
            trainer_layers=None, trainer_responses=8, trainer_prompt=256, trainer_response_tokens=1024,
            trainer_steps=2, tau_target=2.91, cycle_batch=64, cycle_contexts=(1024, 4096, 8192),
            cycle_depths=(2, 4, 6, 8), cycle_repeats=10, train_tokens=8192, real_layers=36, rollout_prompt=256,
            rollout_response=8192)
TINY = Plan(name="tiny", config=tiny_config(), k=5, topk=64, recon_prompts=(12, 160), recon_cycles=24, recon_chunk=20,
            responses=4, prompt_tokens=16, response_tokens=96, tau=3.0, micro_batch=2, repeats=2, chunk_cycles=64,
            budget_s=60.0, sampler_chains=2, sampler_trials=2**16, trainer_layers=2, trainer_responses=4,
            trainer_prompt=8, trainer_response_tokens=24, trainer_steps=2, tau_target=2.91, cycle_batch=4,
            cycle_contexts=(32, 64, 128), cycle_depths=(1, 2, 3), cycle_repeats=3, train_tokens=64, real_layers=36,
            rollout_prompt=16, rollout_response=256)


def build_policy(config: Qwen3Config, device: torch.device, dtype: torch.dtype) -> Qwen3ForCausalLM:
    """A causal LM of random weights (transformers' own init), in training mode with gradient checkpointing,
    as the example scripts train it (`--actor.gradient_checkpointing_enable`)."""
    torch.manual_seed(0)
    config = Qwen3Config.from_dict(config.to_dict())
    config._attn_implementation = "sdpa"
    config.use_cache = False
    with torch.device(device):
        policy = Qwen3ForCausalLM(config)
    policy = policy.to(dtype)
    policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if config.tie_word_embeddings and policy.lm_head.weight is not policy.model.embed_tokens.weight:
        raise RuntimeError("the policy's lm_head is not tied to its embedding, as Qwen3-4B's is")
    return policy.train()


def flatten_policy_logits_(policy: Qwen3ForCausalLM) -> Qwen3ForCausalLM:
    """Scale the policy's final norm to POLICY_NORM_SCALE, so that a head unrelated to it can reach tau 2.91
    (the rollout loop and the trainer step's drafter). Costs nothing: only the norm's weight changes."""
    with torch.no_grad():
        policy.model.norm.weight.fill_(POLICY_NORM_SCALE)
    return policy


def build_head(policy: Qwen3ForCausalLM, dtype: torch.dtype, seed: int = 0) -> MTPHead:
    """The random head (`init_random_head_`), its final norm scaled to LOGIT_STD, bound to the policy's
    embedding and lm_head and cast to `dtype` the way `load_head(dtype=...)` casts it."""
    config = policy.config
    head = init_random_head_(MTPHead(make_head_config(config, get_family("qwen3"))), seed)
    # logit = sum over H of w_e * (norm weight x unit-RMS state): std = init_range * sqrt(H) * norm weight
    scale = LOGIT_STD / (config.initializer_range * math.sqrt(config.hidden_size))
    with torch.no_grad():
        getattr(head, head.family.final_norm_name).weight.fill_(scale)
    head.bind(policy.model.embed_tokens, policy.lm_head)
    return head.to(device=policy.device, dtype=dtype)


def head_copy(head: MTPHead, dtype: torch.dtype) -> MTPHead:
    """The same head in `dtype`: its weights upcast (or kept) from `head`'s values exactly, bound to a
    `dtype` copy of its (tied) embedding, so that copies differ only in arithmetic (the RoPE tables are
    fp32 in every head)."""
    copy = MTPHead(head.config)
    copy.load_state_dict(head.state_dict())
    copy = copy.to(device=head.embed_tokens.weight.device, dtype=dtype)
    weight = head.embed_tokens.weight.detach().to(dtype).clone()
    embed = nn.Embedding(*weight.shape, device=weight.device, dtype=dtype)
    lm_head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=dtype)
    embed.weight = lm_head.weight = nn.Parameter(weight)
    copy.bind(embed, lm_head)
    return copy
