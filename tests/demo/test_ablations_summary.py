"""The ablations' summaries: the lag pairs each step's probe with the next step's α, and an ordering is only
claimed where the seeds do not overlap; a kept result carries over to a fresh runs directory only when it was
made under the same settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from growmtp_lab import ablation_arms as ablations


def _rows(lag_alpha, head_alpha):
    return [{"step": t, "reward": 0.5, "rollout_s": 1.0, "step_s": 2.0, "tau": 2.0, "alpha": [0.5, 0.3],
             "head_update_s": 0.1, "lag_alpha": la, "head_alpha": ha}
            for t, (la, ha) in enumerate(zip(lag_alpha, head_alpha), start=1)]


def test_lag_compares_the_probe_at_t_with_the_trainers_alpha_at_t_plus_one_after_warmup():
    rows = _rows(lag_alpha=[[0.9, 0.9], [0.8, 0.6], [0.7, 0.5], [0.6, 0.4]],
                 head_alpha=[[0.1, 0.1], [0.2, 0.2], [0.75, 0.45], [0.5, 0.3]])
    lag = ablations.lag(rows, warmup_steps=1)
    # pairs: (lag_alpha(2), head_alpha(3)), (lag_alpha(3), head_alpha(4)); step 1 is warm-up, step 4 has no next
    assert lag["steps"] == 2
    assert lag["alpha_trained_policy"] == pytest.approx([0.75, 0.55])
    assert lag["alpha_next_policy"] == pytest.approx([0.625, 0.375])
    assert lag["gap"] == pytest.approx([0.125, 0.175])
    assert lag["relative"] == pytest.approx([0.125 / 0.75, 0.175 / 0.55])


def test_an_ordering_is_claimed_only_when_every_seed_of_one_arm_is_beyond_every_seed_of_the_other():
    def summary(tau):
        return {"tau_final": tau, "reward_mean": 0.5, "alpha_final": [0.5]}

    per_seed = {"growmtp": {1: summary(2.3), 2: summary(2.5)}, "ce": {1: summary(2.0), 2: summary(2.2)},
                "kl": {1: summary(2.2), 2: summary(2.4)}, "tv": {1: summary(2.6), 2: summary(2.7)},
                "ar": {1: {"reward_mean": 0.4}, 2: {"reward_mean": 0.6}}}
    stats = ablations.compare(per_seed)
    assert stats["ce"]["vs_growmtp"] == "below"
    assert stats["kl"]["vs_growmtp"] == "within the seed spread"
    assert stats["tv"]["vs_growmtp"] == "above"
    assert "vs_growmtp" not in stats["ar"] and "vs_growmtp" not in stats["growmtp"]
    assert stats["growmtp"]["tau_final"] == pytest.approx({"mean": 2.4, "min": 2.3, "max": 2.5})
    assert stats["ar"]["reward_mean"]["mean"] == pytest.approx(0.5)
    # one seed has no spread to exceed: no ordering is claimed, however far apart the arms are
    one_seed = ablations.compare({"growmtp": {1: summary(2.3)}, "tv": {1: summary(1.0)}})
    assert one_seed["tv"]["vs_growmtp"] == "one seed: no claim"


def test_every_arm_runs_the_demo_command_with_its_own_flags_only():
    assert ablations.ARMS["ar"].drafts is False and all(a.drafts for n, a in ablations.ARMS.items() if n != "ar")
    flags = [a.flags for a in ablations.ARMS.values()]
    assert len(set(flags)) == len(flags)  # no two arms run the same configuration


def test_a_kept_result_is_restored_into_a_fresh_runs_directory_only_when_made_under_the_same_settings(tmp_path):
    from growmtp_lab.ablations import keep, restore

    made_under = {"settings": {"steps": 40, "k": 5}, "flags": ["--growmtp_loss", "ce"], "k": 5}
    first = tmp_path / "sitting1" / "ce-s42" / "result.json"
    first.parent.mkdir(parents=True)
    first.write_text(json.dumps({"rows": [{"step": 1, "tau": 1.5}], "wall_s": 60.0, **made_under}))
    kept = tmp_path / "docs" / "paper-abc"
    keep(first, kept, "ce-s42.json")
    keep(first, None, "ce-s42.json")  # no keep directory: nothing kept, nothing fails

    fresh = tmp_path / "sitting2" / "ce-s42" / "result.json"
    restore(kept, "ce-s42.json", fresh, made_under)
    assert fresh.read_bytes() == first.read_bytes()

    for changed in ({**made_under, "flags": ["--growmtp_loss", "kl"]},
                    {**made_under, "settings": {"steps": 41, "k": 5}}):
        other = tmp_path / "sitting3" / "ce-s42" / "result.json"
        restore(kept, "ce-s42.json", other, changed)
        assert not other.exists()  # that run goes again

    own = json.dumps({"rows": [{"step": 1, "tau": 1.7}], "wall_s": 61.0, **made_under})
    fresh.write_text(own)  # a sitting's own result, made under the same settings, is never overwritten by a kept one
    restore(kept, "ce-s42.json", fresh, made_under)
    assert fresh.read_text() == own
    # one made under other settings (another setting's run under the same --name) is not read back as this one's
    flags = ["--growmtp_loss", "ce", "--growmtp_alpha_estimate", "topk"]
    fresh.write_text(json.dumps({"rows": [{"step": 1, "tau": 1.9}], "wall_s": 62.0, **made_under, "flags": flags}))
    restore(kept, "ce-s42.json", fresh, made_under)
    assert fresh.read_bytes() == first.read_bytes()  # replaced by the kept run made under this setting
    other.parent.mkdir(parents=True, exist_ok=True)
    other.write_text(json.dumps({**made_under, "settings": {"steps": 41, "k": 5}}))
    restore(None, "ce-s42.json", other, made_under)  # nothing kept: removed, so that the run goes again
    assert not other.exists()
    # a Recipe field added after a run was kept (max_num_seqs) reads as its default there: restored under the
    # default, not under another value
    from growmtp_lab.recipes import Recipe

    defaults = {"settings": {"steps": 40, "k": 5, "max_num_seqs": Recipe.max_num_seqs}, "flags": made_under["flags"],
                "k": 5}
    older = tmp_path / "sitting5" / "ce-s42" / "result.json"
    restore(kept, "ce-s42.json", older, defaults)
    assert older.read_bytes() == first.read_bytes()
    newer = tmp_path / "sitting6" / "ce-s42" / "result.json"
    restore(kept, "ce-s42.json", newer, {**defaults, "settings": {**defaults["settings"], "max_num_seqs": 2}})
    assert not newer.exists()
    restore(kept, "missing.json", tmp_path / "sitting4" / "x.json")
    restore(None, "ce-s42.json", tmp_path / "sitting4" / "y.json")
    assert not (tmp_path / "sitting4").exists()


def test_sampled_text_statistics_are_kept_with_every_setting_that_reads_them(tmp_path):
    from growmtp_lab.ablations import _text_statistics

    out, first, second = tmp_path / "runs" / "paper", tmp_path / "docs" / "paper-abc", tmp_path / "docs" / "paper-abc-t"
    first.mkdir(parents=True)
    (first / "sampled_text.json").write_text(json.dumps({"entropy_nats": 2.3}) + "\n")
    assert _text_statistics(None, None, out, first) == {"entropy_nats": 2.3}  # restored, nothing recomputed
    # a second setting under the same --name finds the runs directory's copy and keeps it beside its own runs
    assert _text_statistics(None, None, out, second) == {"entropy_nats": 2.3}
    assert (second / "sampled_text.json").read_bytes() == (first / "sampled_text.json").read_bytes()


def test_a_worlds_digest_follows_its_tensors_not_its_files_metadata(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    from growmtp_lab.ablations import note_build
    from growmtp_lab.worlds.demo_world import World

    def world(root, metadata, bump=0.0):
        for part, names in (("policy", ("a", "b")), ("head-random", ("c",))):
            (root / part).mkdir(parents=True)
            tensors = {n: torch.arange(6, dtype=torch.bfloat16).reshape(2, 3) + i for i, n in enumerate(names)}
            tensors[names[0]][0, 0] += bump
            save_file(tensors, str(root / part / "model.safetensors"), metadata=metadata)
        return World(root=root, policy=root / "policy", head=root / "head-random", prompts=root / "p", info={})

    one = world(tmp_path / "one", {"format": "pt", "layout": "x"})
    same = world(tmp_path / "same", {"layout": "x", "format": "pt"})
    other = world(tmp_path / "other", {"format": "pt", "layout": "x"}, bump=1.0)
    assert load_file(str(one.policy / "model.safetensors")).keys() == {"a", "b"}
    assert one.digest() == same.digest() != other.digest()

    builds = tmp_path / "keep" / "builds.json"
    for digest in (one.digest(), same.digest(), other.digest()):
        note_build(builds, digest, {"vocab_size": 32, "policy_layers": 2})
    assert [b["digest"] for b in json.loads(builds.read_text())] == [one.digest(), other.digest()]


def test_the_world_facts_an_export_reads_are_the_kept_builds_own(tmp_path):
    from growmtp_lab.ablations import note_build, world_facts

    builds = tmp_path / "builds.json"
    assert world_facts(tmp_path) == {}  # nothing kept: nothing claimed (an export writes null, not a guess)
    builds.write_text(json.dumps([{"digest": "a" * 16, "first_seen": "then"}]))  # kept before facts were recorded
    note_build(builds, "a" * 16, {"vocab_size": 4096, "policy_layers": 8})
    assert world_facts(tmp_path) == {"vocab_size": 4096, "policy_layers": 8}
    assert json.loads(builds.read_text())[0]["first_seen"] == "then"
    note_build(builds, "b" * 16, {"vocab_size": 4096, "policy_layers": 10})  # another build disagrees on one
    assert world_facts(tmp_path) == {"vocab_size": 4096}


def test_the_ce_k1_start_trains_one_k1_ce_head_per_world_and_runs_from_it_at_a_third_of_the_lr(tmp_path, monkeypatch):
    import subprocess

    from growmtp_lab import ablations as cli
    from growmtp_lab.recipes import WORLDS
    from growmtp_lab.worlds.demo_world import World

    world = World(root=tmp_path / "w", policy=tmp_path / "policy", head=tmp_path / "random",
                  prompts=tmp_path / "prompts.jsonl", info={})
    world.root.mkdir()
    recipe, kept = WORLDS["paper"].recipes["full"], tmp_path / "kept"
    assert cli.start("random", world, recipe, kept, quick=False) == (world, recipe)
    calls = []

    def ceiling(cmd, saves=True, **_):  # what demo.ceiling leaves when training raised τ
        calls.append(cmd)
        flags = dict(zip(cmd[3::2], cmd[4::2]))
        if saves:
            (Path(flags["--save-head"]) / "model.safetensors").parent.mkdir(parents=True)
            (Path(flags["--save-head"]) / "model.safetensors").write_bytes(b"weights")
        Path(flags["--out"]).write_text("{}")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(cli.subprocess, "run", ceiling)
    started, faster = cli.start("ce_k1", world, recipe, kept, quick=False)
    flags = dict(zip(calls[0][3::2], calls[0][4::2]))
    assert calls[0][1:3] == ["-m", "growmtp_lab.ceiling"]
    assert (flags["--k"], flags["--objective"], flags["--topk"]) == ("1", "ce", "64")
    assert (flags["--policy"], flags["--head"]) == (str(world.policy), str(world.head))
    assert started.head == Path(flags["--save-head"]) and started.policy == world.policy
    assert float(faster.head_lr) == pytest.approx(float(recipe.head_lr) / 3) and faster.k == recipe.k
    assert (kept / "start_head.json").exists()
    cli.start("ce_k1", world, recipe, kept, quick=False)
    assert len(calls) == 1  # built once per world
    other = World(root=tmp_path / "v", policy=world.policy, head=world.head, prompts=world.prompts, info={})
    other.root.mkdir()
    monkeypatch.setattr(cli.subprocess, "run", lambda cmd, **kw: ceiling(cmd, saves=False))
    with pytest.raises(RuntimeError, match="K=1 CE head for v was not built"):
        cli.start("ce_k1", other, recipe, kept, quick=False)


def test_the_ceiling_trains_the_objective_it_is_given():
    from helpers.tiny import make_head, make_records

    from openrlhf_growmtp.core.head_loss import HeadLossConfig, measure_head_loss
    from growmtp_lab import ceiling

    records = make_records(k=3)
    hiddens = [rec.hidden for rec in records]
    ce = measure_head_loss(make_head("qwen3"), records, hiddens, HeadLossConfig(objective="ce")).loss
    dca = measure_head_loss(make_head("qwen3"), records, hiddens).loss
    # one epoch, one batch: the loss it reports is the objective's on the head as it started (fp32, a few terms)
    reported = ceiling.train(make_head("qwen3"), records, hiddens, epochs=1, lr=1e-3, batch=len(records), seed=0,
                             cfg=HeadLossConfig(objective="ce"))
    assert reported == pytest.approx(ce, rel=1e-6) and abs(reported - dca) > 1e-3


def test_every_kept_run_says_how_it_was_made():
    # the repository's record: seed, commit (null where it was not recorded), the determinism flag, the α
    # estimate (none without a head) and the world's digest, one of the builds kept beside it with its facts
    from pathlib import Path

    kept = sorted(Path(__file__).resolve().parents[2].glob("docs/data/ablations/runs/*/*-s[0-9]*.json"))
    assert len(kept) > 100
    for path in kept:
        made = json.loads(path.read_text())
        assert made["seed"] == int(path.stem.rsplit("-s", 1)[1]), path
        assert made["commit"] is None or len(made["commit"]) >= 40, path
        assert made["full_determinism"] is True, path
        assert (made["alpha_estimate"] == ("residual" if made["k"] else None)
                or "--growmtp_alpha_estimate" in made["flags"])
        builds = json.loads((path.parent / "builds.json").read_text())
        assert made["world_digest"] in [b["digest"] for b in builds], path
        assert all(b["vocab_size"] > 0 and b["policy_layers"] > 0 for b in builds), path
