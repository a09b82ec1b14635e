"""The demo's local world, built once and cached: tokenizer, a briefly pretrained tiny Qwen3 policy, the
random MTP head (seed 0) and the GRPO prompt set. Nothing is downloaded.

The policy is pretrained on worked additions (`task.py`) only until it solves about half of them when
sampled at temperature 1: a policy that always succeeds gives GRPO no signal, one that never does gives
it no reward. The success probability is measured exactly and cheaply: with teacher forcing, the
probability that sampling at temperature 1 reproduces the worked solution is exp(sum of its token
log-probs), so one batched forward over held-out problems gives the expected accuracy.

The pieces take the world's spec, so that a world of the same task at other sizes, with a larger vocabulary
or with connectives before the columns' steps (`reasoning_world.py`), is this code under another spec. With
connectives, a sample is a worked solution whichever connectives it writes: the held-out solutions' connectives
are drawn uniformly and each of their log-probs is counted as log(n p), n connectives (the importance weight of
the drawn connective), which keeps exp(sum) an unbiased estimate of the probability of sampling a worked solution.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import asdict, dataclass
from math import log
from pathlib import Path
from typing import ClassVar

import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from openrlhf_growmtp.core.checkpoint import materialize_random_head
from growmtp_lab.worlds import task

WORLD_VERSION = 1  # bump when anything below changes what a cached world holds


@dataclass(frozen=True)
class WorldSpec:
    """The demo world's settings; `key()` names its cache directory <prefix>-<key>."""

    name: ClassVar[str] = "demo"
    prefix: ClassVar[str] = "world"
    min_digits: int = 2
    max_digits: int = 4
    hidden_size: int = 128
    num_layers: int = 2
    head_dim: int = 32  # vLLM's CPU attention needs at least 32
    seed: int = 0
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 20
    max_steps: int = 600
    target_accuracy: float = 0.5  # stop pretraining once expected sampled accuracy reaches this
    eval_every: int = 10
    eval_problems: int = 256
    num_prompts: int = 4096

    def key(self) -> str:
        blob = json.dumps({"version": WORLD_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def vocabulary(self) -> list[str]:
        """The tokenizer's words, id by id."""
        return task.VOCAB

    def connective_words(self) -> tuple[str, ...]:
        """The words one of which starts each column's step (none here)."""
        return ()


@dataclass(frozen=True)
class World:
    root: Path
    policy: Path
    head: Path
    prompts: Path
    info: dict

    def digest(self) -> str:
        """sha256 over the policy's and the random head's tensors (name, dtype, shape, bytes) in name order:
        two builds of one spec hold the same weights exactly when their digests agree (the files' bytes
        are no test: safetensors' metadata order varies from one write to the next)."""
        hasher = hashlib.sha256()
        for part in (self.policy, self.head):
            tensors = load_file(str(part / "model.safetensors"))
            for name in sorted(tensors):
                tensor = tensors[name].contiguous()
                hasher.update(f"{part.name}/{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
                hasher.update(tensor.flatten().view(torch.uint8).numpy().tobytes())
        return hasher.hexdigest()[:16]


def build_world(cache_dir: str | Path, spec: WorldSpec = WorldSpec(), log=print) -> World:
    """The world for `spec` under cache_dir/<spec.prefix>-<key>/ (world-<key>/ for the demo's), built unless a
    complete one is already there."""
    root = Path(cache_dir) / f"{spec.prefix}-{spec.key()}"
    stamp = root / "world.json"
    if not stamp.exists():
        _build(root, spec, log)
    info = json.loads(stamp.read_text())
    return World(root=root, policy=root / "policy", head=root / "head-random", prompts=root / "prompts.jsonl",
                  info=info)


def _build(root: Path, spec: WorldSpec, log) -> None:
    began = time.perf_counter()
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = task.make_tokenizer(spec.vocabulary())
    config = Qwen3Config(
        vocab_size=len(spec.vocabulary()), hidden_size=spec.hidden_size, intermediate_size=3 * spec.hidden_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.hidden_size // spec.head_dim,
        num_key_value_heads=max(1, spec.hidden_size // (2 * spec.head_dim)), head_dim=spec.head_dim,
        max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
        eos_token_id=task.EOS_ID, bos_token_id=task.EOS_ID, pad_token_id=task.PAD_ID)
    torch.manual_seed(spec.seed)
    model = Qwen3ForCausalLM(config)
    log(f"building the {spec.name} world in {root}: pretraining a "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M {spec.num_layers}-layer Qwen3 policy on worked "
        f"{spec.min_digits}-{spec.max_digits} digit additions until its sampled accuracy reaches "
        f"{spec.target_accuracy:.0%}")
    stats = pretrain(model, tokenizer, spec, log)

    write_policy(root, model, tokenizer)
    write_prompts(root / "prompts.jsonl", spec)
    info = {"spec": asdict(spec), "pretrain": stats, "build_s": round(time.perf_counter() - began, 1)}
    (root / "world.json").write_text(json.dumps(info, indent=2) + "\n")  # written last: marks the world complete
    log(f"{spec.name} world ready in {info['build_s']:.0f} s (pretraining steps {stats['steps']}, expected sampled "
        f"accuracy {stats['expected_accuracy']:.2f})")


def write_policy(root: Path, model, tokenizer) -> None:
    """root/policy (the pretrained policy, an HF model directory) and root/head-random (its random head, seed 0)."""
    policy_dir = root / "policy"
    policy_dir.mkdir(exist_ok=True)
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(policy_dir)
    save_file({name: t.contiguous() for name, t in model.state_dict().items()}, str(policy_dir / "model.safetensors"),
              metadata={"format": "pt"})
    tokenizer.save_pretrained(policy_dir)
    materialize_random_head(policy_dir, root / "head-random", seed=0)


def encode(tokenizer, a: int, b: int, connectives: tuple[str, ...] = (),
           rng: random.Random | None = None) -> tuple[list[int], list[int]]:
    """(prompt ids, solution ids ending in <eos>) exactly as the RL run will see them; the solution's connectives
    (if any) drawn from rng."""
    prompt = tokenizer(task.prompt_text(a, b), add_special_tokens=False)["input_ids"]
    text = task.solution_text(a, b, connectives=connectives, rng=rng)
    solution = tokenizer(text, add_special_tokens=False)["input_ids"] + [task.EOS_ID]
    return prompt, solution


def make_batch(tokenizer, problems: list[tuple[int, int]], connectives: tuple[str, ...] = (),
               rng: random.Random | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, T], attention mask [B, T], and a mask of the solution tokens to predict [B, T]; the
    solutions' connectives (if any) drawn from rng, problem by problem."""
    rows = [encode(tokenizer, a, b, connectives, rng) for a, b in problems]
    width = max(len(p) + len(s) for p, s in rows)
    ids = torch.full((len(rows), width), task.PAD_ID)
    attention = torch.zeros_like(ids)
    target = torch.zeros_like(ids, dtype=torch.bool)
    for i, (prompt, solution) in enumerate(rows):
        n = len(prompt) + len(solution)
        ids[i, :n] = torch.tensor(prompt + solution)
        attention[i, :n] = 1
        target[i, len(prompt):n] = True
    return ids, attention, target


def solution_logprobs(model, ids, attention, target) -> torch.Tensor:
    """Per problem, the summed log-prob of its worked solution under teacher forcing. [B]"""
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    token_lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]  # [B, T-1]
    return (token_lp * target[:, 1:]).sum(-1)


def expected_accuracy(model, tokenizer, batch, connectives: tuple[str, ...] = ()) -> float:
    """Mean over the batch's problems of exp(summed solution log-probs): the probability that sampling at
    temperature 1 writes the worked solution. With connectives, each connective token's log-prob counts as
    log(n p) (module docstring), so that the estimate is of writing a worked solution with any connectives."""
    ids, attention, target = batch
    logprobs = solution_logprobs(model, ids, attention, target)
    if connectives:
        forks = torch.isin(ids, torch.tensor(tokenizer.convert_tokens_to_ids(list(connectives)))) & target.bool()
        logprobs = logprobs + forks.sum(-1) * log(len(connectives))
    return float(logprobs.exp().mean())


def pretrain(model, tokenizer, spec: WorldSpec, log) -> dict:
    """AdamW on worked solutions until the expected sampled accuracy on held-out problems reaches the target.
    Held-out problem i comes from random.Random(10_000 + i) and the held-out connectives from
    random.Random(spec.seed + 2); the training problems and their connectives from one random.Random(spec.seed)."""
    rng = random.Random(spec.seed)
    connectives = spec.connective_words()
    held_out = make_batch(tokenizer, [task.sample_problem(random.Random(10_000 + i), spec.min_digits,
                                                          spec.max_digits) for i in range(spec.eval_problems)],
                          connectives, random.Random(spec.seed + 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / spec.warmup_steps))
    accuracy, loss, step = 0.0, torch.tensor(float("nan")), 0
    while step < spec.max_steps:
        model.train()
        problems = [task.sample_problem(rng, spec.min_digits, spec.max_digits) for _ in range(spec.batch_size)]
        ids, attention, target = make_batch(tokenizer, problems, connectives, rng)
        loss = -solution_logprobs(model, ids, attention, target).sum() / target.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        warmup.step()
        step += 1
        if step % spec.eval_every == 0:
            model.eval()
            with torch.no_grad():
                accuracy = expected_accuracy(model, tokenizer, held_out, connectives)
            log(f"  pretraining step {step}: loss {loss.item():.3f}, expected sampled accuracy {accuracy:.2f}")
            if accuracy >= spec.target_accuracy:
                break
    model.eval()
    return {"steps": step, "loss": round(loss.item(), 4), "expected_accuracy": round(accuracy, 4)}


def write_prompts(path: Path, spec: WorldSpec) -> None:
    """The GRPO prompt set: {"input": prompt, "label": answer} per line, drawn apart from pretraining (seed+1)."""
    rng = random.Random(spec.seed + 1)
    with path.open("w") as f:
        for _ in range(spec.num_prompts):
            a, b = task.sample_problem(rng, spec.min_digits, spec.max_digits)
            f.write(json.dumps({"input": task.prompt_text(a, b), "label": str(a + b)}) + "\n")
