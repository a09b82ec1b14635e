"""The fault suite's faults (tests/faults), each patched into its module right after that module is first
imported, in whichever process of the launched run imports it (`install`, from `tests/faults/inject`'s
sitecustomize). $GROWMTP_FAULT_DIR holds the files the run's processes agree through."""

from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.util
import os
import signal
import sys

import torch


class NaNGradient(torch.autograd.Function):
    """The identity forward; a NaN gradient backward (a finite loss whose gradient is not)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def _claim(name: str) -> bool:
    """True in the first process to claim `name` in this run, False in every other."""
    try:
        os.close(os.open(os.path.join(os.environ["GROWMTP_FAULT_DIR"], name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def engine_killed(module) -> None:
    """The engine's process is killed (SIGKILL, as by the kernel's OOM killer) at its $GROWMTP_FAULT_AT-th
    prompt."""
    cls, original = module.GrowMTPRolloutActor, module.GrowMTPRolloutActor.generate_responses
    calls, kill_at = [0], int(os.environ["GROWMTP_FAULT_AT"])

    async def generate_responses(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return await original(self, *args, **kwargs)

    cls.generate_responses = generate_responses


def head_sync_fails(module) -> None:
    """One engine of the run (the first to load a head) fails its second head load."""
    cls, original = module.GrowMTPRolloutActor, module.GrowMTPRolloutActor.growmtp_load_head
    calls = [0]

    async def growmtp_load_head(self, blob):
        calls[0] += 1
        if calls[0] == 1:
            self._growmtp_faulty = _claim("faulty_engine")
        if calls[0] == 2 and self._growmtp_faulty:
            raise RuntimeError("injected fault: this engine could not load the head")
        return await original(self, blob)

    cls.growmtp_load_head = growmtp_load_head


def nonfinite_gradient_rank1(module) -> None:
    """On policy rank 1 only, every head loss keeps its finite value but backpropagates NaN."""
    original = module.head_loss_per_cycle_at

    def poisoned(*args, **kwargs):
        per_cycle, alpha = original(*args, **kwargs)
        return (NaNGradient.apply(per_cycle) if os.environ.get("RANK") == "1" else per_cycle), alpha

    module.head_loss_per_cycle_at = poisoned


def save_interrupted(module) -> None:
    """Policy rank 0 is killed while saving the checkpoint of RL step 2: after DeepSpeed wrote its files, before
    the head snapshot."""
    cls, original = module.GrowMTPPolicyActor, module.GrowMTPPolicyActor._write_snapshot

    def _write_snapshot(self, path):
        if path.parent.name == "global_step2" and os.environ.get("RANK") == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, path)

    cls._write_snapshot = _write_snapshot


def export_disk_full(module) -> None:
    """The disk fills during the run's final export, in the process that writes it (policy rank 0): the write of
    the policy's weights ($GROWMTP_FAULT_AT=policy) or of the head's (=head) writes half its bytes, then fails
    with ENOSPC, as a full filesystem does."""
    import errno
    import importlib

    from safetensors.torch import save

    cls, original = module.GrowMTPStrategy, module.GrowMTPStrategy.save_model
    owner_name, name = {"policy": ("transformers.modeling_utils", "safe_save_file"),
                        "head": ("openrlhf_growmtp.core.checkpoint", "save_file")}[os.environ["GROWMTP_FAULT_AT"]]

    def full(tensors, filename, metadata=None):
        data = save(tensors, metadata=metadata)
        with open(filename, "wb") as f:
            f.write(data[:len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device (injected fault)", str(filename))

    def save_model(self, *args, **kwargs):
        owner = importlib.import_module(owner_name)
        real = getattr(owner, name)
        setattr(owner, name, full)
        try:
            return original(self, *args, **kwargs)
        finally:
            setattr(owner, name, real)

    cls.save_model = save_model


def record_cut_short(module) -> None:
    """The first record of the engine's $GROWMTP_FAULT_AT-th prompt leaves it cut to half its bytes."""
    cls, original = module.GrowMTPRolloutActor, module.GrowMTPRolloutActor.generate_responses
    calls, cut_at = [0], int(os.environ["GROWMTP_FAULT_AT"])

    async def generate_responses(self, *args, **kwargs):
        responses = await original(self, *args, **kwargs)
        calls[0] += 1
        if calls[0] == cut_at:
            record = responses[0][module.RECORD_KEY]
            responses[0][module.RECORD_KEY] = dataclasses.replace(record, blob=record.blob[:len(record.blob) // 2])
        return responses

    cls.generate_responses = generate_responses


FAULTS = {
    "engine_killed": ("openrlhf_growmtp.trainer.rollout_actor", engine_killed),
    "head_sync_fails": ("openrlhf_growmtp.trainer.rollout_actor", head_sync_fails),
    "nonfinite_gradient_rank1": ("openrlhf_growmtp.core.head_loss", nonfinite_gradient_rank1),
    "save_interrupted": ("openrlhf_growmtp.trainer.ppo_actor", save_interrupted),
    "export_disk_full": ("openrlhf_growmtp.trainer.strategy", export_disk_full),
    "record_cut_short": ("openrlhf_growmtp.trainer.rollout_actor", record_cut_short),
}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds the target module as usual, and patches it once its code has run."""

    def __init__(self, name: str, patch):
        self.name, self.patch = name, patch

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run, patch = spec.loader.exec_module, self.patch

        def exec_module(module):
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


def install(fault: str) -> None:
    """Patch `fault` into its module when that module is first imported in this process."""
    sys.meta_path.insert(0, _PatchAfterImport(*FAULTS[fault]))
