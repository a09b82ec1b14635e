"""What a world's sampled text is like: the policy's per-token entropy and the share of its mass in the top-k
(the width the engine records), over responses it samples at temperature 1 from the world's own prompts."""

from __future__ import annotations

import json
from pathlib import Path

import torch


@torch.no_grad()
def sampled_text_statistics(model, tokenizer, prompts: list[str], topk: int, max_new_tokens: int = 128,
                            seed: int = 0) -> dict:
    """Mean entropy (nats) and top-`topk` mass of the next-token distribution at every sampled response token
    (up to and with the first <eos>), and the mean response length, over one sample per prompt."""
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in prompts]
    width = max(map(len, ids))
    pad = tokenizer.pad_token_id
    batch = torch.tensor([[pad] * (width - len(row)) + row for row in ids])  # left-padded
    torch.manual_seed(seed)
    out = model.generate(input_ids=batch, attention_mask=(batch != pad).long(), do_sample=True, temperature=1.0,
                         top_k=0, top_p=1.0, max_new_tokens=max_new_tokens, output_scores=True,
                         return_dict_in_generate=True, pad_token_id=pad, eos_token_id=tokenizer.eos_token_id)
    logp = torch.log_softmax(torch.stack(out.scores, 1).float(), -1)  # [B, steps, V]
    is_eos = (out.sequences[:, width:] == tokenizer.eos_token_id).long()
    alive = (is_eos.cumsum(1) - is_eos) == 0  # every position up to and with the first <eos>
    entropy = -(logp.exp() * logp).sum(-1)
    mass = logp.topk(min(topk, logp.shape[-1]), -1).values.exp().sum(-1)
    tokens = int(alive.sum())
    return {"sampled_responses": len(prompts), "mean_response_tokens": round(tokens / len(prompts), 1),
            "entropy_nats": round(float(entropy[alive].mean()), 4),
            f"top{topk}_mass": round(float(mass[alive].mean()), 4)}


def world_text_statistics(policy_dir: Path, prompts_file: Path, topk: int, count: int = 64,
                          max_new_tokens: int = 128) -> dict:
    """`sampled_text_statistics` of a world's policy (fp32) over the first `count` prompts of its prompt set."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(policy_dir), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(policy_dir))
    prompts = [json.loads(line)["input"] for line in prompts_file.read_text().splitlines()[:count]]
    return sampled_text_statistics(model, tokenizer, prompts, topk, max_new_tokens)
