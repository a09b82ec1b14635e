"""The ablations' second world, in the paper's proportions (`python -m growmtp_lab.ablations --worlds
paper`): built once and cached like the demo's, nothing downloaded.

- Text with real entropy: the corpus is CPython's own standard library source (the running interpreter's
  `Lib/`, tests left out; about 11 MB), tokenized by a byte-level BPE of 4,096 tokens trained on it.
- The task: the demo's worked addition, after a thought. A prompt is the problem and `<think>`; a response
  is a passage of code (64 corpus tokens in pretraining, whatever the policy writes in RL), `</think>`, the
  worked solution and `<answer>` with the sum: about 90 tokens, most of them the passage's.
- The policy: a Qwen3 of 8 layers (hidden 256, 4 heads of 64, 2 key-value heads), pretrained on such
  responses with corpus passages until its expected sampled accuracy on the solution reaches a half (and
  for at least `min_steps`, so that the passages are modelled and not merely skipped).
- The head: one layer (1/9 of the backbone's), random (seed 0), drafting K=5 and recording the top-64.
`world.json` also holds what this world's sampled text is like: the policy's mean per-token entropy and
the mean share of its mass in the top-64, over responses it samples at temperature 1.
"""

from __future__ import annotations

import hashlib
import json
import random
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from growmtp_lab.worlds import task
from growmtp_lab.worlds.text_stats import sampled_text_statistics
from growmtp_lab.worlds.demo_world import World, write_policy

WORLD_VERSION = 1  # bump when anything below changes what a cached world holds
THINK, END_THINK, ANSWER = "<think>", "</think>", "<answer>"
SPECIAL = ["<pad>", "<eos>", "<unk>", THINK, END_THINK, ANSWER]
LEFT_OUT = {"test", "tests", "idlelib", "lib2to3", "site-packages", "__pycache__"}  # parts of Lib/ not used


@dataclass(frozen=True)
class PaperWorldSpec:
    vocab_size: int = 4096
    num_layers: int = 8
    hidden_size: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    passage_tokens: int = 64
    min_digits: int = 2
    max_digits: int = 4
    seed: int = 0
    batch_size: int = 32
    lr: float = 1e-3
    warmup_steps: int = 50
    min_steps: int = 600
    max_steps: int = 3000
    target_accuracy: float = 0.5
    eval_every: int = 50
    eval_problems: int = 128
    num_prompts: int = 4096
    entropy_samples: int = 64  # responses sampled to measure the world's entropy and top-64 mass

    def key(self, corpus_digest: str) -> str:
        blob = json.dumps({"version": WORLD_VERSION, "corpus": corpus_digest, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def corpus_files() -> list[Path]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in lib.rglob("*.py") if not LEFT_OUT & set(p.relative_to(lib).parts))


def corpus_text() -> tuple[str, str]:
    """(the corpus, its digest): the standard library's source files in path order."""
    text = "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in corpus_files())
    return text, hashlib.sha256(text.encode()).hexdigest()[:16]


def train_tokenizer(text: str, vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE over the corpus, every digit its own token (the task's sums stay digit by digit)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False)])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(text.split("\n\n"), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>", additional_special_tokens=[THINK, END_THINK, ANSWER])


def prompt_text(a: int, b: int) -> str:
    return f"{task.prompt_text(a, b)} {THINK}"


def response_tail(a: int, b: int) -> str:
    """What follows the thought: `</think>`, the worked solution and the answer."""
    return f" {END_THINK} {task.solution_text(a, b, marker=ANSWER)}"


def score(response: str, label: str) -> float:
    return task.score(response, label, marker=ANSWER)


def build_paper_world(cache_dir: str | Path, spec: PaperWorldSpec = PaperWorldSpec(), log=print) -> World:
    """The world for `spec` under cache_dir/paper-<key>/, built unless a complete one is already there."""
    text, digest = corpus_text()
    root = Path(cache_dir) / f"paper-{spec.key(digest)}"
    stamp = root / "world.json"
    if not stamp.exists():
        _build(root, spec, text, digest, log)
    return World(root=root, policy=root / "policy", head=root / "head-random", prompts=root / "prompts.jsonl",
                 info=json.loads(stamp.read_text()))


def _build(root: Path, spec: PaperWorldSpec, text: str, digest: str, log) -> None:
    began = time.perf_counter()
    root.mkdir(parents=True, exist_ok=True)
    log(f"building the paper world in {root}: a {spec.vocab_size}-token BPE on the standard library's source")
    tokenizer = train_tokenizer(text, spec.vocab_size)
    corpus = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(spec.seed)
    model = Qwen3ForCausalLM(config)
    log(f"  corpus {len(corpus):,} tokens; pretraining a {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
        f"Qwen3 of {spec.num_layers} layers on thought + worked addition")
    stats = _pretrain(model, tokenizer, corpus, spec, log)
    write_policy(root, model, tokenizer)
    _write_prompts(root / "prompts.jsonl", spec)
    rng = random.Random(20_000 + spec.seed)
    problems = [task.sample_problem(rng, spec.min_digits, spec.max_digits) for _ in range(spec.entropy_samples)]
    stats["sampled"] = sampled_text_statistics(model, tokenizer, [prompt_text(a, b) for a, b in problems], topk=64,
                                               max_new_tokens=160, seed=spec.seed)
    info = {"spec": asdict(spec), "corpus_digest": digest, "corpus_tokens": len(corpus), "pretrain": stats,
            "build_s": round(time.perf_counter() - began, 1)}
    (root / "world.json").write_text(json.dumps(info, indent=2) + "\n")  # written last: marks the world complete
    log(f"paper world ready in {info['build_s'] / 60:.0f} min: {stats}")


def _batch(tokenizer, corpus: torch.Tensor, spec: PaperWorldSpec, rng: random.Random, size: int):
    """Right-padded ids [B, T], attention mask, the response mask, and the solution mask (after the thought)."""
    rows = []
    for _ in range(size):
        a, b = task.sample_problem(rng, spec.min_digits, spec.max_digits)
        start = rng.randrange(len(corpus) - spec.passage_tokens)
        prompt = tokenizer(prompt_text(a, b), add_special_tokens=False)["input_ids"]
        tail = tokenizer(response_tail(a, b), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append((prompt, corpus[start:start + spec.passage_tokens].tolist(), tail))
    width = max(len(p) + len(t) + len(tail) for p, t, tail in rows)
    ids = torch.full((size, width), tokenizer.pad_token_id)
    attention, response, solution = (torch.zeros_like(ids, dtype=torch.bool) for _ in range(3))
    for i, (prompt, thought, tail) in enumerate(rows):
        n_prompt, n_thought = len(prompt), len(thought)
        n = n_prompt + n_thought + len(tail)
        ids[i, :n] = torch.tensor(prompt + thought + tail)
        attention[i, :n] = True
        response[i, n_prompt:n] = True
        solution[i, n_prompt + n_thought:n] = True
    return ids, attention.long(), response, solution


def _token_logprobs(model, ids, attention) -> torch.Tensor:
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]  # [B, T-1]


def _pretrain(model, tokenizer, corpus, spec: PaperWorldSpec, log) -> dict:
    """AdamW (bf16 autocast) on responses with corpus passages, for at least min_steps and until the expected
    sampled accuracy of the solution (teacher forcing over held-out problems) reaches the target."""
    rng, held_rng = random.Random(spec.seed), random.Random(10_000 + spec.seed)
    held_out = _batch(tokenizer, corpus, spec, held_rng, spec.eval_problems)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / spec.warmup_steps))
    accuracy, loss, passage_nll, step = 0.0, float("nan"), float("nan"), 0
    while step < spec.max_steps:
        model.train()
        ids, attention, response, _ = _batch(tokenizer, corpus, spec, rng, spec.batch_size)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            token_lp = _token_logprobs(model, ids, attention)
        target = response[:, 1:]
        loss_t = -(token_lp * target).sum() / target.sum()
        optimizer.zero_grad(set_to_none=True)
        loss_t.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        warmup.step()
        step, loss = step + 1, loss_t.item()
        if step % spec.eval_every == 0:
            model.eval()
            ids, attention, response, solution = held_out
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                token_lp = _token_logprobs(model, ids, attention)
            thought = response[:, 1:] & ~solution[:, 1:]
            accuracy = float((token_lp * solution[:, 1:]).sum(-1).exp().mean())
            passage_nll = float(-(token_lp * thought).sum() / thought.sum())
            log(f"  pretraining step {step}: loss {loss:.3f}, passage nll {passage_nll:.3f}, "
                f"expected sampled accuracy {accuracy:.2f}")
            if step >= spec.min_steps and accuracy >= spec.target_accuracy:
                break
    model.eval()
    return {"steps": step, "loss": round(loss, 4), "passage_nll": round(passage_nll, 4),
            "expected_accuracy": round(accuracy, 4)}


def _write_prompts(path: Path, spec: PaperWorldSpec) -> None:
    """The GRPO prompt set: {"input": prompt, "label": answer} per line, drawn apart from pretraining."""
    rng = random.Random(spec.seed + 1)
    with path.open("w") as f:
        for _ in range(spec.num_prompts):
            a, b = task.sample_problem(rng, spec.min_digits, spec.max_digits)
            f.write(json.dumps({"input": prompt_text(a, b), "label": str(a + b)}) + "\n")
