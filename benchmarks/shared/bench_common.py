"""What the benchmarks share: Qwen3-4B's shapes, records drawn at a given τ, the policy's training step, and the
one place they call the core's head update (the chain-by-chain reference is `growmtp_lab/reference_drafting.py`'s).

Imported as `benchmarks.shared.bench_common` by the benchmarks (each run from the repository's root as
`python -m benchmarks.<script>`); nothing here imports from tests/.
"""

from __future__ import annotations

import statistics
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from openrlhf_growmtp.core import HeadLossConfig, MTPHead, SequenceRecord, head_loss_backward
from growmtp_lab.worlds.toy import synthetic_record


def qwen3_4b_config(num_layers: int = 1) -> Qwen3Config:
    """Qwen3-4B's text config (its real widths, heads, vocabulary, RoPE base and tying) with `num_layers` layers."""
    return Qwen3Config(hidden_size=2560, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       intermediate_size=9728, num_hidden_layers=num_layers, vocab_size=151936,
                       tie_word_embeddings=True, initializer_range=0.02, max_position_embeddings=40960,
                       rope_theta=1000000.0, rms_norm_eps=1e-6)


def sync(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def median_seconds(fn, device, repeats: int) -> tuple[float, list[float]]:
    """fn() timed `repeats` times after one warm-up call, the device synchronised around each: the median
    and every time, in seconds."""
    fn()
    seconds = []
    for _ in range(repeats):
        sync(device)
        began = time.perf_counter()
        fn()
        sync(device)
        seconds.append(time.perf_counter() - began)
    return statistics.median(seconds), seconds


def head_update(head: MTPHead, records: list[SequenceRecord], hiddens: list[torch.Tensor] | None,
                chunk_cycles: int | None):
    """One head update as the trainer runs it (DCA + VGM, gradients accumulated into the head's .grad):
    the only call of the core's loss entry point in the benchmarks that use it. Returns its stats."""
    return head_loss_backward(head, records, hiddens, HeadLossConfig(chunk_cycles=chunk_cycles))


def accepted_at_tau(num_cycles: int, tau: float, k: int, generator: torch.Generator) -> list[int]:
    """Accepted counts in 0..K with mean tau - 1: a truncated geometric draw, P(a) ∝ r^a, r set by bisection."""
    target = tau - 1.0
    lo, hi = 0.01, 100.0
    for _ in range(60):
        r = (lo * hi) ** 0.5
        weights = torch.tensor([r ** a for a in range(k + 1)], dtype=torch.float64)
        mean = float((weights * torch.arange(k + 1)).sum() / weights.sum())
        lo, hi = (r, hi) if mean < target else (lo, r)
    return torch.multinomial(weights.float(), num_cycles, replacement=True, generator=generator).tolist()


def records_at_tau(tokens: int, prompt: int, tau: float, k: int, topk: int, vocab_size: int,
                   hidden_size: int | None, seed: int = 0) -> SequenceRecord:
    """One response of ~`tokens` tokens after a `prompt`-token prompt, in cycles of mean accepted tau - 1.

    Its ids are drawn over the first `vocab_size` ids (a [cycles, K, 151936] draw would dwarf what is
    measured; which ids a record holds does not change the cost of using it)."""
    g = torch.Generator().manual_seed(seed)
    accepted = accepted_at_tau(max(1, int(tokens / tau)), tau, k, g)
    return synthetic_record(prompt_len=prompt, accepted=accepted, depth=k, topk=topk, vocab_size=vocab_size,
                            hidden_size=hidden_size, seed=seed)


def policy_hiddens(policy: Qwen3ForCausalLM, records: list[SequenceRecord], batch: int, device) -> list[torch.Tensor]:
    """`policy_step` over the records' token ids, `batch` records at a time: each record's hidden states [T, H]."""
    hiddens = []
    for lo in range(0, len(records), batch):
        ids = torch.stack([r.token_ids for r in records[lo:lo + batch]]).to(device)
        hiddens.extend(policy_step(policy, ids).unbind(0))
    return hiddens


def policy_step(policy: Qwen3ForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """The part of a GRPO step that grows with the model, over ids [B, T]: forward, the token log-probs
    (log-softmax in fp32, gather), their mean as the loss, backward. Returns the final-norm hidden states
    [B, T, H] (detached), which the trainer hands the head."""
    out = policy(input_ids=ids, output_hidden_states=True)
    logp = torch.log_softmax(out.logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None])
    (-logp.mean()).backward()
    return out.hidden_states[-1].detach()


class LineFit:
    """y = a + b x by least squares, with its residuals. With `nonnegative_slope` (a time against a size, which
    cannot fall as the size grows) a negative least-squares slope is the timings' noise, not a cost: the best
    line with b >= 0 is then flat at the mean, and `clipped` says so."""

    def __init__(self, xs, ys, nonnegative_slope: bool = False):
        x = torch.tensor([float(v) for v in xs], dtype=torch.float64)
        y = torch.tensor([float(v) for v in ys], dtype=torch.float64)
        if x.numel() < 2 or float(x.max() - x.min()) == 0.0:
            raise ValueError(f"a line needs two distinct x values, got {list(xs)}")
        design = torch.stack([torch.ones_like(x), x], dim=1)
        coef = torch.linalg.lstsq(design, y[:, None]).solution[:, 0]
        self.clipped = nonnegative_slope and float(coef[1]) < 0
        if self.clipped:
            coef = torch.stack([y.mean(), torch.zeros((), dtype=torch.float64)])
        self.a, self.b = float(coef[0]), float(coef[1])
        self.xs, self.ys = x.tolist(), y.tolist()
        self.residuals = (y - design @ coef).tolist()

    def at(self, x: float) -> float:
        return self.a + self.b * x

    def as_dict(self) -> dict:
        return {"a": self.a, "b": self.b, "x": self.xs, "y": self.ys, "residuals": self.residuals,
                "clipped": self.clipped}


def fit_line(xs, ys, nonnegative_slope: bool = False) -> LineFit:
    return LineFit(xs, ys, nonnegative_slope)
