"""Fixtures for the OpenRLHF integration tests: a tiny policy, its random head, one-rank DeepSpeed."""

from __future__ import annotations

import os

import pytest
import torch
from helpers.trainer import free_port

from growmtp_lab.worlds import toy
from openrlhf_growmtp.core.checkpoint import materialize_random_head
from openrlhf_growmtp.trainer import installer


@pytest.fixture(scope="session")
def policy_dir(tmp_path_factory):
    return toy.make_policy(tmp_path_factory.mktemp("policy"), seed=0)


@pytest.fixture(scope="session")
def head_dir(policy_dir, tmp_path_factory):
    return materialize_random_head(policy_dir, tmp_path_factory.mktemp("head"), seed=0)


@pytest.fixture(scope="session")
def single_rank():
    """torch.distributed with one gloo rank in this process (what DeepSpeed's init_distributed picks up)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    installer.install_cpu_support()
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()

