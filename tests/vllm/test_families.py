"""MiMo checkpoints that ship native MTP weights: extract the head, draft with it on the engine (Qwen3.5:
test_qwen3_5.py)."""

import torch
from helpers.engines import close_engine
from safetensors.torch import save_file
from transformers import Qwen2Config, Qwen2ForCausalLM

from openrlhf_growmtp.core.checkpoint import (export_head, init_random_head_, load_head, load_native_head,
                                              to_native_state_dict)
from openrlhf_growmtp.core.draft_vocab import DRAFT_VOCAB_META, DraftVocab
from openrlhf_growmtp.core.families import get_family
from openrlhf_growmtp.core.head import MTPHead
from openrlhf_growmtp.core.head_config import make_head_config
from growmtp_lab.worlds.toy import POLICY, make_tokenizer, random_prompts
from test_records_engine import engine_q_vs_reconstruction
from vllm import SamplingParams

FIELDS = {k: v for k, v in POLICY.items() if k != "head_dim"}


def native_checkpoint(out, family_name: str, config, model_class, architecture: str):
    """A tiny full checkpoint of the family with its native MTP weights inside, plus a tokenizer."""
    torch.manual_seed(0)
    config.architectures = [architecture]
    model = model_class(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
        model.lm_head.weight.normal_(0.0, 0.12)
    family = get_family(family_name)
    head = init_random_head_(MTPHead(make_head_config(config, family)), seed=1)
    with torch.no_grad():  # a native head is trained: give it weights that matter
        for p in head.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.08)
    state = {n: t.contiguous() for n, t in model.state_dict().items()}
    state.update(to_native_state_dict(head.state_dict(), family))
    if config.tie_word_embeddings:
        del state["lm_head.weight"]  # the embedding's (safetensors stores no shared tensors)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    make_tokenizer(config.vocab_size).save_pretrained(out)
    return model


def test_mimo_native_head_drafts_on_the_engine_and_matches_reconstruction(tmp_path):
    from vllm_patches.engine import SpecEngine

    config = Qwen2Config(**FIELDS, num_nextn_predict_layers=1)
    # MiMo-7B's config is Qwen2's plus num_nextn_predict_layers; vLLM serves it as MiMoForCausalLM
    policy = native_checkpoint(tmp_path / "mimo", "mimo", config, Qwen2ForCausalLM, "MiMoForCausalLM")
    head = load_native_head(tmp_path / "mimo", policy.model.embed_tokens, policy.lm_head)
    export_head(head, tmp_path / "head")
    engine = SpecEngine(tmp_path / "mimo", tmp_path / "head", 3, capture_q=True, dtype="float32",
                        enforce_eager=True, max_model_len=512, seed=0)
    try:
        result = engine.generate(random_prompts(6, 128, seed=2),
                                 SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True))
        assert result.metrics.acceptance.cycles > 50
        reloaded = load_head(tmp_path / "head", policy.model.embed_tokens, policy.lm_head)
        per_depth = engine_q_vs_reconstruction(reloaded, policy, result, exact=False)
        assert per_depth.max() <= 1e-4, per_depth
        # the native head drafts over a draft vocabulary as a random head does: the same q on both sides
        vocab = DraftVocab(torch.arange(0, 128, 4), 128)
        engine.set_draft_vocab(vocab)
        result = engine.generate(random_prompts(4, 128, seed=3),
                                 SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True))
        assert {rec.meta[DRAFT_VOCAB_META] for rec in result.records} == {vocab.tag}
        reloaded.draft_vocab = vocab
        assert engine_q_vs_reconstruction(reloaded, policy, result, exact=False).max() <= 1e-4
    finally:
        close_engine(engine)
