"""Ours vs upstream on identical experience: one ZeRO-3 GRPO step on the tiny policy (one gloo rank, bf16).

k=0 (no head): our strategy and trainer are transparent, losses and parameters identical to upstream's.
detached: policy parameters identical to upstream's, the head moved. joint: the policy differs.
A non-finite head loss, or a finite one with a non-finite gradient: the head is untouched and the policy still
identical to upstream's.
frozen: no head in the step, the policy identical to upstream's, the head exported as it started.
"""

from __future__ import annotations

import contextlib
import json
from types import SimpleNamespace

import deepspeed
import pytest
import torch
from safetensors.torch import load_file

from growmtp_lab.worlds import toy
from openrlhf_growmtp.core.checkpoint import load_head, materialize_random_head
from openrlhf_growmtp.core.records import SequenceRecord
from openrlhf_growmtp.core.schedule import DEFAULT_HEAD_LR
from openrlhf_growmtp.trainer.head_step.deepspeed_patches import head_optimizer_state
from openrlhf_growmtp.trainer.keys import RECORD_KEY, PackedRecord

from helpers import tiny
from helpers.faults import NaNGradient
from helpers.trainer import K, TOPK, prepared_actor, train_args

BATCH, PROMPT, RESPONSE = 4, 5, 7


def make_experience(policy_dir, records, sequences=None):
    from openrlhf.trainer.ppo_utils.experience import Experience

    g = torch.Generator().manual_seed(7)
    drawn = torch.randint(2, 128, (BATCH, PROMPT + RESPONSE), generator=g)
    sequences = drawn if sequences is None else sequences
    with torch.no_grad():
        logits = toy.load_policy(policy_dir)(sequences).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, sequences[:, 1:, None])[..., 0][:, -RESPONSE:]
    info = {"reward": torch.tensor([1.0, 0.0, 0.5, 0.2])}
    if records is not None:
        info[RECORD_KEY] = [PackedRecord.of(r) for r in records]
    return Experience(sequences=sequences, attention_mask=torch.ones_like(sequences),
                      action_mask=torch.ones(BATCH, RESPONSE, dtype=torch.long), action_log_probs=logp,
                      advantages=torch.randn(BATCH, RESPONSE, generator=g),
                      response_length=torch.full((BATCH,), float(RESPONSE)),
                      total_length=torch.full((BATCH,), float(PROMPT + RESPONSE)), info=info)


def make_records():
    return tiny.make_records(K, TOPK, layouts=[(4, acc) for acc in ([0, 1, 3], [2, 0], [3, 3, 1, 0], [1])],
                             vocab_size=128, hidden_size=None)


def gathered(module) -> dict[str, torch.Tensor]:
    params = dict(module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {name: p.detach().float().clone() for name, p in params.items()}


def one_step(args, policy_dir, ours: bool, records=None, sequences=None, save_to=None, draft_vocab=None):
    """Build strategy, actor and actor trainer as PolicyModelActor does, append one experience, train (and
    export the model as the final save does, to `save_to`). `draft_vocab`: the head's, as the controller sets it
    (`growmtp_set_draft_vocab`) before the step."""
    from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

    from openrlhf_growmtp.trainer import ppo_actor, strategy as growmtp_strategy

    strategy, actor, optimizer, scheduler = prepared_actor(args, policy_dir, ours)
    trainer = (ppo_actor.GrowMTPActorTrainer if ours else ActorPPOTrainer)(
        strategy, actor, None, optimizer, scheduler, micro_train_batch_size=args.train.micro_batch_size,
        tokenizer=None, vllm_engines=None)
    if draft_vocab is not None:
        growmtp_strategy.head_of(actor.model.module).draft_vocab = draft_vocab
    trainer.replay_buffer.append(make_experience(policy_dir, records, sequences))
    status = trainer.ppo_train(0.0)
    if save_to is not None:
        strategy.save_model(actor, SimpleNamespace(save_pretrained=lambda _: None), str(save_to))
    hf_model = actor.model.module
    head = growmtp_strategy.head_of(hf_model)
    with growmtp_strategy.without_head(hf_model):
        policy = gathered(hf_model)
    return status, policy, (gathered(head) if head is not None else None), optimizer, hf_model


@pytest.fixture(scope="module")
def upstream(single_rank, policy_dir, tmp_path_factory):
    args = train_args(policy_dir, tmp_path_factory.mktemp("up"))
    return one_step(args, policy_dir, ours=False)  # upstream cannot carry records; the rest is identical


def ours(policy_dir, head_dir, tmp_path, mode="detached", records=True, extra=(), matching=False, save_to=None):
    args = train_args(policy_dir, tmp_path, "--growmtp_k", str(K), "--growmtp_mode", mode, "--growmtp_topk", str(TOPK),
                      *extra)
    args.growmtp.head_dir = str(head_dir) if records else None  # no records: the trainer holds no head
    if matching:
        return one_step(args, policy_dir, ours=True, records=matching_records(), sequences=matching_sequences(),
                        save_to=save_to)
    return one_step(args, policy_dir, ours=True, records=make_records() if records else None, save_to=save_to)


def matching_records():
    """Records whose tokens are their samples' (unlike `make_records`): 5 prompt tokens, 12 in all."""
    accepted = ([0, 1, 2], [2, 2], [1, 1, 1], [0, 0, 0, 2])
    return tiny.make_records(K, TOPK, seed=10, layouts=[(PROMPT, acc) for acc in accepted], vocab_size=128,
                             hidden_size=None)


def matching_sequences():
    return torch.stack([rec.token_ids for rec in matching_records()])


def assert_identical(a: dict, b: dict):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.isfinite(a[name]).all(), name  # the spike saw a garbage ZeRO-3 gather once
        assert torch.equal(a[name], b[name]), f"{name}: max diff {(a[name] - b[name]).abs().max()}"


def test_k0_identical_to_upstream(upstream, single_rank, policy_dir, head_dir, tmp_path):
    status, policy, head, _, _ = ours(policy_dir, head_dir, tmp_path, records=False)
    up_status, up_policy, _, _, _ = upstream
    assert head is None
    assert status["policy_loss"] == up_status["policy_loss"]
    assert status["actor_grad_norm"] == up_status["actor_grad_norm"]
    assert_identical(policy, up_policy)
    initial = toy.load_policy(policy_dir).state_dict()
    assert any(not torch.equal(policy[n], initial[n].to(torch.bfloat16).float()) for n in policy)  # it trained


def test_detached_policy_identical_head_moved(upstream, single_rank, policy_dir, head_dir, tmp_path):
    status, policy, head, optimizer, _ = ours(policy_dir, head_dir, tmp_path)
    up_status, up_policy, _, _, _ = upstream
    assert_identical(policy, up_policy)
    assert status["policy_loss"] == up_status["policy_loss"]
    assert status["actor_grad_norm"] == up_status["actor_grad_norm"]  # the head's gradients are not in it
    initial = {n: p.to(torch.bfloat16).float() for n, p in load_head(head_dir).state_dict().items()}
    # every matrix moved; RMSNorm weights at 1.0 move by ~lr/10 = 3e-5 in fp32, below bf16's spacing at 1.0
    matrices = {n for n in head if head[n].ndim == 2}
    assert {n for n in head if not torch.equal(head[n], initial[n])} >= matrices and len(matrices) == 8
    assert status["growmtp/head_finite"] == 1.0 and status["growmtp/head_cycles"] == 10
    assert status["growmtp/head_hidden_from_forward"] == 0.0  # records of other tokens: a forward of its own
    assert torch.isfinite(torch.tensor(status["growmtp/head_loss"]))
    # the recorded top-k's mean share of the target mass, over the (cycle, draft position) pairs the loss reads
    # (VGM: positions 1..min(accepted + 1, K)), from the records as the trainer receives them (packed: bf16
    # log-probs); the trainer sums <= 40 fp32 terms: rel error < 3e-6
    received = [SequenceRecord.unpack(r.pack()) for r in make_records()]
    mass = torch.cat([torch.logsumexp(r.topk_logprobs[c, :min(int(r.accepted[c]) + 1, r.depth)].double(), dim=-1).exp()
                      for r in received for c in range(r.num_cycles)])
    assert status["growmtp/head_topk_mass"] == pytest.approx(mass.mean().item(), rel=1e-5)
    # the head's own group and schedule: warm-up step 0 runs at peak / warmup_steps, then the next LR is set
    groups = {g.get("name"): g for g in optimizer.param_groups}
    assert groups["growmtp_head"]["weight_decay"] == 0.0
    assert status["growmtp/head_lr"] == pytest.approx(DEFAULT_HEAD_LR["random"] / 10)
    assert groups["growmtp_head"]["lr"] == pytest.approx(DEFAULT_HEAD_LR["random"] * 2 / 10)


def test_a_rollout_drafted_shallower_than_k_policy_identical_head_reads_its_depth(upstream, single_rank, policy_dir,
                                                                                 head_dir, tmp_path):
    """`--growmtp_depth auto` drafted this step's rollout at depth 1 < K: the policy is upstream's, the head
    trains on the depth-1 records, and its per-position statistics stop at the depth drafted."""
    args = train_args(policy_dir, tmp_path, "--growmtp_k", str(K), "--growmtp_topk", str(TOPK), "--growmtp_depth",
                      "auto")
    args.growmtp.head_dir = str(head_dir)
    shallow = tiny.make_records(1, TOPK, layouts=[(4, acc) for acc in ([0, 1, 1], [1, 0], [1, 1, 1, 0], [1])],
                                vocab_size=128, hidden_size=None)
    status, policy, head, _, _ = one_step(args, policy_dir, ours=True, records=shallow)
    up_status, up_policy, _, _, _ = upstream
    assert_identical(policy, up_policy)
    assert status["policy_loss"] == up_status["policy_loss"]
    assert status["growmtp/head_finite"] == 1.0 and status["growmtp/head_cycles"] == 10
    assert "growmtp/head_alpha_1" in status and "growmtp/head_alpha_2" not in status
    initial = {n: p.to(torch.bfloat16).float() for n, p in load_head(head_dir).state_dict().items()}
    assert any(not torch.equal(head[n], initial[n]) for n in head if head[n].ndim == 2)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_hidden_states_from_the_training_forward_policy_identical_no_extra_forward(packed, single_rank, policy_dir,
                                                                                   head_dir, tmp_path, monkeypatch):
    # one policy step per RL step and records of exactly their samples' tokens: the head reads H_p from the
    # policy's own training forward of each micro-batch, and no forward of its own runs
    from openrlhf_growmtp.trainer.head_step import head_rl_step, hidden_states

    assert matching_sequences().shape == (BATCH, PROMPT + RESPONSE)
    flags = ("--ds.packing_samples",) if packed else ()
    up_status, up_policy, _, _, _ = one_step(train_args(policy_dir, tmp_path / "up", *flags), policy_dir, ours=False,
                                             sequences=matching_sequences())
    given = []

    def spy_update(self, indices, hiddens):
        # the policy's weights are still the rollout's here: its own forward of the same sequences
        records = [self.records[i] for i in indices]
        reference = hidden_states.backbone_hidden_states(self.engine.module.model, records, 1, len(records),
                                                         grad=False)
        given.append(list(zip(hiddens, reference)))
        return real_update(self, indices, hiddens)

    def no_forward_of_its_own(*args, **kwargs):
        raise AssertionError("the head ran a policy forward of its own")

    real_update = head_rl_step.HeadRLStep.update
    monkeypatch.setattr(head_rl_step.HeadRLStep, "update", spy_update)
    monkeypatch.setattr(hidden_states, "step_hidden_states", no_forward_of_its_own)
    status, policy, head, _, _ = ours(policy_dir, head_dir, tmp_path / "ours", extra=flags, matching=True)
    assert_identical(policy, up_policy)
    assert status["policy_loss"] == up_status["policy_loss"]
    assert status["actor_grad_norm"] == up_status["actor_grad_norm"]
    assert [len(pairs) for pairs in given] == [2, 2]  # one call per micro-batch, on its own samples
    for hidden, reference in (pair for pairs in given for pair in pairs):
        assert hidden.shape == reference.shape and hidden.dtype == torch.bfloat16
        if not packed:  # the same weights, tokens and batch layout: bit for bit
            assert torch.equal(hidden, reference)
        else:  # packed attention (another kernel) vs padded: within 2 bf16 ulps (<= 2^-7 of |h| each)
            assert (hidden.float() - reference.float()).abs().max() <= 2 ** -6 * reference.float().abs().max()
    assert status["growmtp/head_finite"] == 1.0 and status["growmtp/head_cycles"] == 12
    assert status["growmtp/head_hidden_from_forward"] == 1.0
    initial = {n: p.to(torch.bfloat16).float() for n, p in load_head(head_dir).state_dict().items()}
    assert all(not torch.equal(head[n], initial[n]) for n in head if head[n].ndim == 2)


def test_joint_policy_differs(upstream, single_rank, policy_dir, head_dir, tmp_path):
    _, policy, head, _, _ = ours(policy_dir, head_dir, tmp_path, mode="joint")
    _, up_policy, _, _, _ = upstream
    differ = [n for n in policy if not torch.equal(policy[n], up_policy[n])]
    assert "model.layers.1.mlp.down_proj.weight" in differ, differ


def test_frozen_head_stays_out_of_the_step_and_is_exported_as_it_started(upstream, single_rank, policy_dir, head_dir,
                                                                         tmp_path):
    """--growmtp_mode frozen (the ablations' frozen arm): the records arrive, the trainer holds no head, the
    policy's step is upstream's, and the final export carries the head the engines drafted with, unchanged."""
    status, policy, head, _, _ = ours(policy_dir, head_dir, tmp_path, mode="frozen", save_to=tmp_path / "final")
    up_status, up_policy, _, _, _ = upstream
    assert head is None and not [key for key in status  # no head metric; the memory any run reports
                                 if key.startswith("growmtp/") and not key.startswith("growmtp/mem_")]
    assert status["policy_loss"] == up_status["policy_loss"]
    assert_identical(policy, up_policy)
    exported = load_file(str(tmp_path / "final" / "growmtp_head" / "model.safetensors"))
    initial = load_file(str(head_dir / "model.safetensors"))
    assert_identical(exported, initial)
    config = json.loads((tmp_path / "final" / "growmtp_head" / "config.json").read_text())
    assert config["growmtp_trained_k"] == K


def test_nonfinite_head_loss_skips_head_update(upstream, single_rank, policy_dir, head_dir, tmp_path, monkeypatch,
                                              caplog):
    from openrlhf_growmtp.core import head_loss

    real = head_loss.head_loss_per_cycle_at

    def poisoned(*args, **kwargs):
        per_cycle, alpha = real(*args, **kwargs)
        return per_cycle * float("nan"), alpha

    monkeypatch.setattr(head_loss, "head_loss_per_cycle_at", poisoned)
    status, policy, head, optimizer, _ = ours(policy_dir, head_dir, tmp_path)
    # the shared optimizer stepped the policy, and the head's Adam state never came to exist
    assert head_optimizer_state(SimpleNamespace(optimizer=optimizer)) == {}
    _, up_policy, _, _, _ = upstream
    assert status["growmtp/head_finite"] == 0.0
    assert "head update is skipped" in caplog.text
    assert_identical(policy, up_policy)
    initial = {n: p.to(torch.bfloat16).float() for n, p in load_head(head_dir).state_dict().items()}
    assert_identical(head, initial)


def test_nonfinite_head_gradient_with_a_finite_loss_skips_the_head_step(upstream, single_rank, policy_dir, head_dir,
                                                                       tmp_path, monkeypatch, caplog):
    """DeepSpeed reports a non-finite gradient norm as -1 and steps bf16 groups with it; the head's step is
    skipped instead: the head and its Adam state stay as they were, the policy's step is upstream's."""
    from openrlhf_growmtp.core import head_loss

    real = head_loss.head_loss_per_cycle_at

    def poisoned(*args, **kwargs):
        per_cycle, alpha = real(*args, **kwargs)
        return NaNGradient.apply(per_cycle), alpha

    monkeypatch.setattr(head_loss, "head_loss_per_cycle_at", poisoned)
    status, policy, head, optimizer, _ = ours(policy_dir, head_dir, tmp_path)
    assert torch.isfinite(torch.tensor(status["growmtp/head_loss"]))  # the loss was finite
    assert status["growmtp/head_finite"] == 0.0 and status["growmtp/head_steps"] == 0.0
    assert "gradient was not finite" in caplog.text
    assert head_optimizer_state(SimpleNamespace(optimizer=optimizer)) == {}
    assert_identical(policy, upstream[1])
    initial = {n: p.to(torch.bfloat16).float() for n, p in load_head(head_dir).state_dict().items()}
    assert_identical(head, initial)


def test_gradient_checkpointing_reaches_the_backbone_not_the_head(upstream, single_rank, policy_dir, head_dir,
                                                                  tmp_path):
    # The paper scripts pass --actor.gradient_checkpointing_enable. A checkpointed head layer drops the KV
    # cache its prefix pass fills, so K >= 2 would crash; the head is attached after upstream enables it.
    plain_status, _, plain_head, _, _ = ours(policy_dir, head_dir, tmp_path / "plain")
    status, _, head, _, hf_model = ours(policy_dir, head_dir, tmp_path / "gc",
                                        extra=("--actor.gradient_checkpointing_enable",))
    assert all(layer.gradient_checkpointing for layer in hf_model.model.layers)
    assert not any(getattr(m, "gradient_checkpointing", False) for m in hf_model.mtp_head.modules())
    assert status["growmtp/head_finite"] == 1.0 and status["growmtp/head_cycles"] == 10
    assert status["growmtp/head_loss"] == plain_status["growmtp/head_loss"]
    assert_identical(head, plain_head)


# Upstream's usual layouts: more than one policy optimizer step per RL step (4 samples here).
LAYOUTS = {
    # 2 mini-batches of 2 samples (micro-batches of 1: windows of 2 backwards), 2 epochs: 4 optimizer steps
    "mini-batches x epochs": (("--train.batch_size", "2", "--train.micro_batch_size", "1", "--train.max_epochs", "2"),
                              4),
    # 2 steps of 2 samples, each sample its own packed micro-batch (12 tokens each, 12 per micro-batch)
    "dynamic batching": (("--train.batch_size", "2", "--train.dynamic_batch_enable", "--ds.packing_samples",
                          "--train.max_tokens_per_gpu", "12"), 2),
    # one policy step per RL step (the head runs once over every record), on ZeRO-2
    "zero-2": (("--ds.zero_stage", "2"), 1),
    # one step, optimizer on the host: the gradients reach it at the window's last backward, so the head makes
    # one in every micro-batch
    "adam offload": (("--ds.adam_offload",), 1),
    # the optimizer's states and step on the host; the gradients reach it at each window's boundary
    "adam offload, mini-batches": (("--ds.adam_offload", "--train.batch_size", "2", "--train.micro_batch_size", "1"),
                                   2),
    # ZeRO-2's optimizer (its own accumulation and norms), mini-batches and epochs
    "zero-2, mini-batches x epochs": (("--ds.zero_stage", "2", "--train.batch_size", "2", "--train.micro_batch_size",
                                       "1", "--train.max_epochs", "2"), 4),
    "zero-2, adam offload": (("--ds.zero_stage", "2", "--ds.adam_offload", "--train.batch_size", "2",
                              "--train.micro_batch_size", "1"), 2),
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request, single_rank, policy_dir, tmp_path_factory):
    flags, steps = LAYOUTS[request.param]
    args = train_args(policy_dir, tmp_path_factory.mktemp("up_layout"), *flags)
    return flags, steps, one_step(args, policy_dir, ours=False)


def head_state_after_each_step(monkeypatch, optimizer_cls) -> list[dict]:
    """After every optimizer step: the head group's fp32 partitions and Adam state (moments, step count)."""
    from openrlhf_growmtp.trainer.head_step.deepspeed_patches import head_group_index, head_step_indices

    states = []
    real = optimizer_cls.step

    def step(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        zero3 = hasattr(self, "fp32_partitioned_groups_flat")
        flats = self.fp32_partitioned_groups_flat if zero3 else self.single_partition_of_fp32_groups
        indices = head_step_indices(self, 3 if zero3 else 2, head_group_index(self))
        states.append({**{f"param{i}": flats[i].detach().clone() for i in indices},
                       **head_optimizer_state(SimpleNamespace(optimizer=self))})
        return out

    monkeypatch.setattr(optimizer_cls, "step", step)
    return states


@pytest.mark.parametrize("schedule", ["rl_step", "policy_step"])
def test_several_policy_steps_policy_identical_records_follow_their_samples(layout, schedule, single_rank, policy_dir,
                                                                            head_dir, tmp_path, monkeypatch):
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

    from openrlhf_growmtp.trainer.head_step import head_rl_step

    flags, steps, (up_status, up_policy, _, _, _) = layout
    if schedule == "policy_step" and steps == 1:
        pytest.skip("one policy step per RL step: the two schedules are one (test_one_policy_step_...)")
    sample_of = {}  # a sample's tokens and its record's tokens -> the sample's index
    for i, (row, rec) in enumerate(zip(make_experience(policy_dir, None).sequences, make_records())):
        sample_of[tuple(row.tolist())] = sample_of[tuple(rec.token_ids.tolist())] = i
    head_calls, policy_calls = [], []

    def spy_head(head, records, *args, **kwargs):
        head_calls.append(sorted(sample_of[tuple(rec.token_ids.tolist())] for rec in records))
        return real_head(head, records, *args, **kwargs)

    def spy_policy(self, experience, *args, **kwargs):
        rows = [row[mask.bool()] for row, mask in zip(experience.sequences, experience.attention_mask)]
        policy_calls.append(sorted(sample_of[tuple(row.tolist())] for row in rows))
        return real_policy(self, experience, *args, **kwargs)

    real_head, real_policy = head_rl_step.update_head, ActorPPOTrainer.training_step
    monkeypatch.setattr(head_rl_step, "update_head", spy_head)
    monkeypatch.setattr(ActorPPOTrainer, "training_step", spy_policy)
    zero2 = "--ds.zero_stage" in flags
    after_step = head_state_after_each_step(monkeypatch, DeepSpeedZeroOptimizer if zero2 else
                                            DeepSpeedZeroOptimizer_Stage3)
    status, policy, head, optimizer, _ = ours(policy_dir, head_dir, tmp_path,
                                              extra=flags + ("--growmtp_head_update", schedule))

    offloaded = optimizer.offload_optimizer if hasattr(optimizer, "offload_optimizer") else optimizer.cpu_offload
    assert bool(offloaded) == ("--ds.adam_offload" in flags)  # ZeRO-3's name for it, then ZeRO-2's
    assert type(optimizer).__name__ == ("DeepSpeedZeroOptimizer" if zero2 else "DeepSpeedZeroOptimizer_Stage3")
    assert_identical(policy, up_policy)
    assert status["policy_loss"] == up_status["policy_loss"]
    assert len(policy_calls) > steps and len(after_step) == steps
    epochs = 2 if "--train.max_epochs" in flags else 1
    if schedule == "rl_step":
        # the paper's schedule: every record once, spread over the first window's micro-batches in order, one
        # head step; in every other optimizer step the head's parameters and Adam state stay bit for bit
        window = len(head_calls)
        assert 1 <= window <= len(policy_calls) // (steps // epochs) and window <= BATCH
        assert [i for call in head_calls for i in call] == list(range(BATCH))
        assert status["growmtp/head_steps"] == 1 and status["growmtp/head_epochs"] == 1
        for before, after in zip(after_step, after_step[1:]):
            assert before.keys() == after.keys() and any(k.endswith(".step") for k in after)
            assert all(torch.equal(before[k], after[k]) for k in after)
        assert all(float(v) == 1 for k, v in after_step[-1].items() if k.endswith(".step"))
    else:
        # each micro-batch's head update ran on exactly its own samples' records, every epoch saw every
        # record, and the head stepped with every policy step
        assert head_calls == policy_calls
        assert sorted(i for call in head_calls for i in call) == sorted(list(range(BATCH)) * epochs)
        assert status["growmtp/head_steps"] == steps and status["growmtp/head_epochs"] == epochs
        assert all(float(v) == steps for k, v in after_step[-1].items() if k.endswith(".step"))
    assert status["growmtp/head_cycles"] == 10 and status["growmtp/head_finite"] == 1.0  # first epoch: each once
    initial = {n: p.to(torch.bfloat16).float() for n, p in load_head(head_dir).state_dict().items()}
    assert all(not torch.equal(head[n], initial[n]) for n in head if head[n].ndim == 2)
    moments = head_optimizer_state(SimpleNamespace(optimizer=optimizer))  # what a checkpoint's snapshot records
    assert moments and all(float(m.abs().sum()) > 0 for m in moments.values())


def test_one_policy_step_per_rl_step_makes_the_two_schedules_one_run(upstream, single_rank, policy_dir, head_dir,
                                                                      tmp_path):
    runs = [ours(policy_dir, head_dir, tmp_path / schedule, extra=("--growmtp_head_update", schedule))
            for schedule in ("rl_step", "policy_step")]
    (status, policy, head, _, _), (other_status, other_policy, other_head, _, _) = runs
    assert status["growmtp/head_steps"] == 1
    assert_identical(policy, other_policy)
    assert_identical(head, other_head)
    readings = ("_s", "_gib")  # seconds and memory differ by nature
    assert {k: v for k, v in status.items() if not k.endswith(readings)} == \
        {k: v for k, v in other_status.items() if not k.endswith(readings)}


def test_zero2_and_zero3_step_the_head_with_the_same_gradient(single_rank, policy_dir, head_dir, tmp_path,
                                                              monkeypatch):
    """The head's gradient over a window of two micro-batches, interleaved with the policy's backwards, as
    DeepSpeed's two optimizers (each with its own accumulation) hand it to Adam after clipping.

    Compared as gradients: Adam's first step moves each element by about lr x sign(g), so elements with g
    near zero may land apart after it, and later steps amplify that; the gradients differ only by rounding
    (ZeRO-2 is set to accumulate in fp32, as ZeRO-3 does). A micro-batch lost from the window, or the
    head's gradient gathered before the window's last backward, would be far outside it.
    """
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from openrlhf_growmtp.trainer.head_step.deepspeed_patches import head_group_index

    stepped = {}
    for cls in (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3):
        def spy(self, i, real=cls._optimizer_step, zero3=cls is DeepSpeedZeroOptimizer_Stage3):
            group = self.sub_group_to_group_id[i] if zero3 else i
            flat = self.fp32_partitioned_groups_flat[i] if zero3 else self.single_partition_of_fp32_groups[i]
            if group == head_group_index(self):
                stepped.setdefault(type(self).__name__, []).append(flat.grad.detach().clone().flatten())
            return real(self, i)
        monkeypatch.setattr(cls, "_optimizer_step", spy)
    flags = ("--train.batch_size", "4", "--train.micro_batch_size", "2", "--ds.grad_accum_dtype", "fp32")
    for name, extra in (("zero3", ()), ("zero2", ("--ds.zero_stage", "2"))):
        status, _, _, _, _ = ours(policy_dir, head_dir, tmp_path / name, extra=flags + extra)
        assert status["growmtp/head_steps"] == 1 and status["growmtp/head_finite"] == 1.0
    zero2 = torch.cat(stepped["DeepSpeedZeroOptimizer"])
    zero3 = torch.cat(stepped["DeepSpeedZeroOptimizer_Stage3"])
    assert zero2.shape == zero3.shape and zero3.norm() > 0
    # fp32 sums of the same bf16 per-chunk gradients in another order: relative differences of a few 1e-7
    # Each micro-batch's head gradient is computed in bf16 (the parameters' dtype), and the two optimizers
    # round the window's terms to bf16 at different points (for communication, then accumulating): per
    # element up to 2^-8 relative of a term, once in each optimizer, for each of the window's two terms, whose
    # norms together may exceed the sum's where they partly cancel (counted as twice): 2 x 2 x 2^-8 x 2 = 2^-5
    # of the gradient's norm at worst. A micro-batch lost from the window would differ by tens of percent.
    assert float((zero2 - zero3).norm()) <= 2 ** -5 * float(zero3.norm())


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_draft_vocabulary_trains_over_its_rows_gathered_once_from_zero3(tied, single_rank, policy_dir, head_dir,
                                                                         tmp_path, monkeypatch):
    """`--growmtp_draft_vocab 32` under ZeRO-3, the lm_head partitioned (tied to the embedding as Qwen3-4B's, or
    not): the head update gathers it once, slices the vocabulary's 32 rows exactly as the gathered lm_head holds
    them, and scores logits of 32 columns (the lm_head module is not called for them). Its head loss is the
    masked full-vocabulary path's, and the policy's step is the same either way."""
    from openrlhf_growmtp.core.draft_vocab import DRAFT_VOCAB_META, DraftRows, DraftVocab
    from openrlhf_growmtp.core.head import MTPHead
    from openrlhf_growmtp.trainer.head_step import head_update

    if tied:  # the tiny policy with its lm_head the embedding (written by transformers, which ties on load)
        from transformers import AutoTokenizer, Qwen3ForCausalLM

        Qwen3ForCausalLM.from_pretrained(policy_dir, tie_word_embeddings=True).save_pretrained(tmp_path / "tied")
        AutoTokenizer.from_pretrained(policy_dir).save_pretrained(tmp_path / "tied")
        policy_dir = tmp_path / "tied"
        head_dir = materialize_random_head(policy_dir, tmp_path / "tied_head", seed=0)
    vocab = DraftVocab(torch.arange(2, 128, 4), 128)  # 32 ids
    records = make_records()
    for rec in records:
        rec.meta[DRAFT_VOCAB_META] = vocab.tag
    assert vocab.outside()[torch.cat([r.topk_ids for r in records])].any()
    slices, widths = [], []

    def slice_spy(cls, lm_head, vocab, gathered, real=DraftRows.slice.__func__):
        rows = real(cls, lm_head, vocab, gathered)
        assert lm_head.weight.numel() == 0  # partitioned outside the gather
        with deepspeed.zero.GatheredParameters([lm_head.weight]):
            slices.append(torch.equal(rows.weight, lm_head.weight.detach()[vocab.ids]))
        return rows

    def logits_spy(self, normed, real=DraftRows.logits):
        out = real(self, normed)
        widths.append(int(out.shape[-1]))
        return out

    def run(name):
        args = train_args(policy_dir, tmp_path / name, "--growmtp_k", str(K), "--growmtp_topk", str(TOPK),
                          "--growmtp_draft_vocab", "32")
        args.growmtp.head_dir = str(head_dir)
        return one_step(args, policy_dir, ours=True, records=records, draft_vocab=vocab)

    updates = []

    def update_spy(*args, real=head_update.head_loss_backward, **kwargs):
        updates.append(len(slices))
        return real(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(DraftRows, "slice", classmethod(slice_spy))
        patch.setattr(DraftRows, "logits", logits_spy)
        patch.setattr(head_update, "head_loss_backward", update_spy)
        status, policy, head, _, model = run("rows")
    # one slice per head update (here one per micro-batch of the window), each the gathered lm_head's rows
    assert updates == list(range(len(updates))) and len(updates) >= 1 and slices == [True] * len(updates)
    assert widths and set(widths) == {32}
    if tied:  # Qwen3-4B's layout: the rows were sliced from the embedding's own parameter
        assert model.lm_head.weight is model.model.embed_tokens.weight
    with monkeypatch.context() as patch:  # today's path: the lm_head over every id, -inf outside the 32
        patch.setattr(MTPHead, "sliced_draft_rows", lambda self, gathered=None: contextlib.nullcontext())
        patch.setattr(MTPHead, "scored_vocab_size", property(lambda self: self.config.vocab_size))
        masked_status, masked_policy, _, _, _ = run("masked")
    assert status["growmtp/head_finite"] == masked_status["growmtp/head_finite"] == 1.0
    assert_identical(policy, masked_policy)
    # bf16 logits: each the same 64-term dot product rounded once to bf16 (2^-8 relative), whichever columns
    # are computed beside it; log q and the loss (a few units) move by at most a few of those roundings
    assert status["growmtp/head_loss"] == pytest.approx(masked_status["growmtp/head_loss"], rel=2 ** -6)
    initial = {n: p.to(torch.bfloat16).float() for n, p in load_head(head_dir).state_dict().items()}
    assert any(not torch.equal(head[n], initial[n]) for n in head if head[n].ndim == 2)


def test_deepspeed_reads_only_what_it_wrote_into_its_gradient_bucket(single_rank, policy_dir, tmp_path, monkeypatch):
    """Upstream's ZeRO-2 step under torch's deterministic mode, with its gradient bucket allocated as upstream
    does (every element filled with NaN) and as the CPU layer does (unfilled: `fill_gradient_bucket`): the
    same finite parameters, so no element of the bucket is read before a gradient is copied into it."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    unfilled_setup = DeepSpeedZeroOptimizer.setup_buckets
    assert unfilled_setup.__wrapped__  # the CPU layer's (installer.install_cpu_support)
    policies = []
    saved = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    try:
        for setup in (unfilled_setup.__wrapped__, unfilled_setup):
            monkeypatch.setattr(DeepSpeedZeroOptimizer, "setup_buckets", setup)
            torch.use_deterministic_algorithms(True)
            torch.utils.deterministic.fill_uninitialized_memory = True
            args = train_args(policy_dir, tmp_path / str(len(policies)), "--ds.zero_stage", "2")
            policies.append(one_step(args, policy_dir, ours=False)[1])
    finally:
        torch.use_deterministic_algorithms(saved[0])
        torch.utils.deterministic.fill_uninitialized_memory = saved[1]
    assert all(torch.isfinite(p).all() for p in policies[0].values())
    assert_identical(*policies)
