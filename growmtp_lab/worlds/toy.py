"""The toy world of the tests and of the benchmarks: a tiny Qwen3 policy vLLM can serve, a few-step head
trainer on records, and synthetic records of any shape (`synthetic_record`).

A word-level tokenizer ("t0".."t{V-1}", whitespace-split) comes with it, because vLLM 0.29's `LLM`
cannot start without one; prompts are token ids anyway. The policy's lm_head is
scaled up so its next-token distributions are peaked and context-dependent, like a trained model's,
rather than near-uniform as at initialisation.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from openrlhf_growmtp.core.records import SequenceRecord

POLICY = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
              num_hidden_layers=2, vocab_size=128, max_position_embeddings=1024, rms_norm_eps=1e-6,
              initializer_range=0.02, tie_word_embeddings=False, eos_token_id=1, bos_token_id=0,
              pad_token_id=0)


def make_policy(out_dir: str | Path, seed: int = 0, lm_head_std: float = 0.12, **overrides) -> Path:
    """Write a tiny Qwen3ForCausalLM (fp32) with peaked output distributions."""
    torch.manual_seed(seed)
    config = Qwen3Config(**{**POLICY, **overrides})
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
        model.lm_head.weight.normal_(0.0, lm_head_std)
        for layer in model.model.layers:  # attention and MLP strong enough to make context matter
            for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                proj.weight.normal_(0.0, 0.08)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config.architectures = ["Qwen3ForCausalLM"]
    config.save_pretrained(out)
    state = {name: t.contiguous() for name, t in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    make_tokenizer(config.vocab_size).save_pretrained(out)
    return out


def make_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    vocab = {f"t{i}": i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t2"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="t0", eos_token="t1", pad_token="t0",
                                   unk_token="t2")


def load_policy(model_dir: str | Path) -> Qwen3ForCausalLM:
    return Qwen3ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def random_prompts(count: int, vocab: int, min_len: int = 4, max_len: int = 40, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of different lengths (ids 2.. so they avoid bos/eos)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (count,), generator=g)
    return [torch.randint(2, vocab, (int(n),), generator=g).tolist() for n in lengths]


def policy_hidden_states(policy: Qwen3ForCausalLM, token_ids: torch.Tensor) -> torch.Tensor:
    """H_p for every position: the policy's final-norm hidden states over a committed sequence [T] -> [T, H]."""
    with torch.no_grad():
        return policy.model(token_ids[None]).last_hidden_state[0]


def train_head_on_records(head, policy: Qwen3ForCausalLM, records, steps: int, lr: float = 3e-3,
                          objective: str = "dca") -> list[float]:
    """A few Adam steps of the GrowMTP head loss on fixed records (transport-free hiddens). Returns losses."""
    from openrlhf_growmtp.core.head_loss import HeadLossConfig, head_loss_backward

    hiddens = [policy_hidden_states(policy, rec.token_ids) for rec in records]
    optimizer = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=lr)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        stats = head_loss_backward(head, records, hiddens, HeadLossConfig(objective=objective))
        if not stats.finite:
            raise FloatingPointError("non-finite head loss while training the toy head")
        optimizer.step()
        losses.append(float(stats.loss))
    return losses


def synthetic_record(prompt_len: int = 5, accepted: list[int] | tuple[int, ...] = (2, 0, 3), depth: int = 3,
                     topk: int = 4, vocab_size: int = 50, hidden_size: int | None = 8, seed: int = 0,
                     trailing_tokens: int = 1) -> SequenceRecord:
    """A valid record with the given accepted counts: random tokens, drafts and log-probs, consistent with
    one another as an engine's would be (the committed tokens hold each cycle's accepted drafts and a
    recovered token that differs from the rejected draft), and, with `hidden_size`, random hidden states."""
    g = torch.Generator().manual_seed(seed)
    num_cycles = len(accepted)
    acc = torch.tensor(accepted, dtype=torch.long)
    starts = (prompt_len - 1 + torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), acc[:-1] + 1]), 0))
    length = int(starts[-1]) + int(acc[-1]) + 1 + trailing_tokens + 1
    token_ids = torch.randint(0, vocab_size, (length,), generator=g)
    drafts = torch.randint(0, vocab_size, (num_cycles, depth), generator=g)
    for r in range(num_cycles):
        s, a = int(starts[r]), int(acc[r])
        token_ids[s + 2:s + 2 + a] = drafts[r, :a]
        if a < depth:  # the recovered token differs from the rejected draft
            token_ids[s + 2 + a] = (drafts[r, a] + 1) % vocab_size
    scores = torch.randn(num_cycles, depth, vocab_size, generator=g)
    top = torch.log_softmax(scores, dim=-1).topk(topk, dim=-1)
    hidden = None if hidden_size is None else torch.randn(length, hidden_size, generator=g)
    return SequenceRecord(token_ids=token_ids, prompt_len=prompt_len, start=starts, drafts=drafts,
                          topk_ids=top.indices, topk_logprobs=top.values, accepted=acc, hidden=hidden)
