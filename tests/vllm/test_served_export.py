"""A run's export served as `make serve` serves it: vLLM's own engine, configured only by the export's
speculative config and the server's settings (no worker extension, no capture), drafting with the grown
head through the plugin's registration.

- greedy outputs with speculative decoding equal those of the same engine settings without it;
- sampled tokens keep the target's distribution (the chi-square test of test_distribution.py);
- the plugin's capture hooks stay inert in a served engine;
- the server's command line (cli/serve.py) parses, with vLLM's own parser, into exactly these settings.
The full server round trip (HTTP, /metrics, acceptance against the run's τ) is `make serve-check`.
"""

import json
import os
import shutil

import numpy as np
import pytest
from vllm import LLM, SamplingParams

from helpers.engines import K
from openrlhf_growmtp.cli.serve import CPU_ENV, engine_settings, server_argv, server_env
from openrlhf_growmtp.core.model_export import RUN_HEAD_DIR, export_model, read_serve_config
from test_distribution import N, WRONG_TEMPERATURE, exact_joint, simulated_test
from growmtp_lab.worlds.toy import random_prompts
from vllm_patches.capture import core as capture
from vllm_patches.capture.v1 import hooks_active
from vllm_patches.engine_facts import engine_counters, in_process_core

TEST_ENGINE = dict(max_model_len=512, seed=0, disable_log_stats=False)  # in-process test limits on top


def counter_delta(after: dict, before: dict, name: str) -> float:
    """A vLLM counter's growth (a counter appears only once it has counted something)."""
    return after.get(name, 0) - before.get(name, 0)


@pytest.fixture(scope="module")
def exported(world, trained_head, tmp_path_factory):
    """A run's final export (the policy's files + growmtp_head/), exported with growmtp-export."""
    root = tmp_path_factory.mktemp("run")
    final = root / "final"
    shutil.copytree(world["policy_dir"], final)
    shutil.copytree(trained_head, final / RUN_HEAD_DIR)
    return export_model(final, root / "served")


def served_and_plain(settings: dict):
    """(served engine, the same without speculative decoding), in a capture state as a fresh server has it.
    The plain engine is built first: each engine re-registers vLLM's Prometheus counters in the process
    (dropping the previous engine's), and only the served engine's are read."""
    saved, capture.STATE = capture.STATE, capture.CaptureState()
    plain = LLM(**{name: value for name, value in settings.items() if name != "speculative_config"})
    served = LLM(**settings)
    try:
        yield served, plain
    finally:
        for llm in (served, plain):
            in_process_core(llm).model_executor.shutdown()
        capture.STATE = saved


@pytest.fixture(scope="module")
def engines(exported):
    yield from served_and_plain({**engine_settings(exported, cpu=True), **TEST_ENGINE})


def test_the_export_serves_at_the_depth_the_run_trained(exported, engines):
    served, _ = engines
    config = served.llm_engine.vllm_config.speculative_config
    assert read_serve_config(exported)["k"] == K == config.num_speculative_tokens
    assert config.draft_model_config.hf_config.architectures[0].endswith("GrowMTPHead")  # the plugin's class


def greedy_with_and_without(served, plain, prompts: list[list[int]], max_tokens: int = 48):
    """(greedy outputs of the served engine, of the plain one, draft tokens the served engine accepted)."""
    prompts = [{"prompt_token_ids": p} for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before = engine_counters(served)
    with_spec = [list(o.outputs[0].token_ids) for o in served.generate(prompts, params, use_tqdm=False)]
    without = [list(o.outputs[0].token_ids) for o in plain.generate(prompts, params, use_tqdm=False)]
    return with_spec, without, counter_delta(engine_counters(served), before, "spec_decode_num_accepted_tokens")


def test_greedy_outputs_with_speculative_decoding_equal_those_without(engines):
    with_spec, without, accepted = greedy_with_and_without(*engines, random_prompts(24, 128, seed=21))
    # the comparison means something only where drafts were accepted: require many accepted draft tokens
    # (of 24 x 48 generated; the trained head's drafts are accepted at a rate well above this)
    assert accepted >= 200, accepted
    assert with_spec == without


def test_sampled_tokens_keep_the_target_distribution(world, engines):
    """Tokens (1, 2) of N requests: token 2 comes from the first draft-then-verify cycle of each request."""
    served, _ = engines
    policy = world["policy"]
    prompt = [5, 17, 99, 42, 8, 63, 21]
    before = engine_counters(served)
    outputs = served.generate([{"prompt_token_ids": prompt}] * N,
                              SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    drafts = counter_delta(engine_counters(served), before, "spec_decode_num_drafts")
    assert drafts == N, "each request's token 2 must come from one verification"
    tokens = np.array([list(o.outputs[0].token_ids) for o in outputs])
    joint = exact_joint(policy, prompt, (1.0, WRONG_TEMPERATURE))
    counts = np.bincount(tokens[:, 0] * policy.config.vocab_size + tokens[:, 1], minlength=len(joint[1.0]))
    p_value, power = simulated_test(joint[1.0], joint[WRONG_TEMPERATURE], counts, np.random.default_rng(1))
    print(f"served: chi-square p-value {p_value:.3f}, power vs temperature {WRONG_TEMPERATURE}: {power:.3f}")
    assert power >= 0.9, power
    assert p_value > 1e-3, p_value


def test_capture_hooks_stay_inert_in_a_served_engine(engines):
    """The plugin installs the capture hooks in every vLLM process; nothing turns them on in a server."""
    served, _ = engines
    served.generate([{"prompt_token_ids": [3, 4, 5, 6]}], SamplingParams(temperature=1.0, max_tokens=16),
                    use_tqdm=False)
    runner = in_process_core(served).model_executor.driver_worker.worker.model_runner
    assert hooks_active(runner)  # installed, and on the path every step takes
    assert not capture.STATE.config.enabled
    assert capture.STATE.steps == [] and capture.STATE.errors == [] and capture.STATE.hidden == {}


def test_the_server_command_parses_into_the_tested_settings(exported):
    """`make serve` starts vLLM's server with server_argv; vLLM's own parser must read it back as the
    settings the engines above run with."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    settings = engine_settings(exported, cpu=True)
    argv = server_argv(settings, "127.0.0.1", 8000)
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[3:])
    assert (args.host, args.port) == ("127.0.0.1", 8000)
    engine_args = AsyncEngineArgs.from_cli_args(args)
    for name, value in settings.items():
        parsed = getattr(engine_args, name)
        assert (parsed if name != "served_model_name" else parsed[0]) == value, name
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == read_serve_config(exported)["speculative_config"]
    env = server_env(exported, cpu=True)
    assert all(env[name] == os.environ.get(name, value) for name, value in CPU_ENV.items())
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0"
