"""The from-scratch study's bookkeeping (`growmtp_lab/from_scratch.py`): the decision rule fixed before its
runs, the conditions that add seeds, and which run comes next."""

from __future__ import annotations

import json

from growmtp_lab import from_scratch
from growmtp_lab.from_scratch import SETTINGS, Setting, decide, next_command, wants_more_seeds


def world(**taus):
    """A setting's exported entry: per arm, τ final per seed (given as {arm: {seed: tau}})."""
    return {"arms": {arm: {"tau_final": {str(s): t for s, t in by_seed.items()}, "alpha_gap": {}}
                     for arm, by_seed in taus.items()}}


def test_hybrid_becomes_the_default_only_if_never_behind_and_ahead_on_every_seed_of_one_world():
    ahead = world(growmtp={42: 1.80, 43: 1.85}, hybrid={42: 1.90, 43: 1.95})  # +0.10 on both seeds
    level = world(growmtp={45: 2.30}, hybrid={45: 2.29})  # -0.01: within the 0.02 allowed
    assert decide({"paper/unbiased-alpha": ahead, "demo/held-out": level}) == "hybrid"
    behind = world(growmtp={45: 2.30}, hybrid={45: 2.27})  # -0.03 on one seed of another world
    assert decide({"paper/unbiased-alpha": ahead, "demo/held-out": behind}) == "dca"
    mixed = world(growmtp={42: 1.80, 43: 1.85}, hybrid={42: 1.90, 43: 1.87})  # +0.02 on one seed only
    assert decide({"paper/unbiased-alpha": mixed}) == "dca"
    # one world's settings together: ahead on its 40-step seeds but not on its held-out one
    held_out = world(growmtp={45: 2.0}, hybrid={45: 2.03})
    assert decide({"paper/unbiased-alpha": ahead, "paper/held-out": held_out}) == "dca"
    assert decide({"reasoning": world(growmtp={42: 2.0}, ce={42: 2.5})}) == "dca"  # no hybrid ran


def keep_run(keep, folder, arm, seed, taus):
    (keep / folder).mkdir(parents=True, exist_ok=True)
    rows = [{"step": i + 1, "tau": t, "alpha": [0.5], "reward": 0.5, "rollout_s": 1.0, "step_s": 2.0}
            for i, t in enumerate(taus)]
    (keep / folder / f"{arm}-s{seed}.json").write_text(json.dumps({"rows": rows}))


def test_the_lr_split_adds_seeds_only_where_the_order_turns(tmp_path):
    setting = SETTINGS["paper/lr-5e-4"]
    assert wants_more_seeds(setting, tmp_path) is None  # not run yet
    keep_run(tmp_path, "paper-0123456789ab", "growmtp", 42, [1.8] * 40)  # the recipe's LR: CE above
    keep_run(tmp_path, "paper-0123456789ab", "ce", 42, [2.0] * 40)
    keep_run(tmp_path, "paper-0123456789ab-lr-5e-4", "growmtp", 42, [1.9] * 40)
    keep_run(tmp_path, "paper-0123456789ab-lr-5e-4", "ce", 42, [1.7] * 40)  # turned over
    assert wants_more_seeds(setting, tmp_path) is True
    keep_run(tmp_path, "paper-0123456789ab-lr-5e-4", "ce", 42, [2.1] * 40)  # the same order
    assert wants_more_seeds(setting, tmp_path) is False
    assert [seed for _, seed in from_scratch.runs(setting, tmp_path)] == [42, 42]


def test_the_horizon_adds_seeds_only_where_the_order_at_step_120_differs_from_step_40(tmp_path):
    setting = SETTINGS["reasoning/120-steps"]
    folder = "reasoning-0123456789ab-120-steps"
    keep_run(tmp_path, folder, "growmtp", 42, [1.5] * 40 + [2.6] * 80)  # behind at 40, first at 120
    keep_run(tmp_path, folder, "ce", 42, [2.0] * 120)
    keep_run(tmp_path, folder, "hybrid", 42, [1.9] * 40 + [2.2] * 80)
    assert wants_more_seeds(setting, tmp_path) is True
    assert {seed for _, seed in from_scratch.runs(setting, tmp_path)} == {42, 43, 44}
    keep_run(tmp_path, folder, "growmtp", 42, [1.5] * 120)  # last at both ...
    keep_run(tmp_path, folder, "hybrid", 42, [1.9] * 40 + [1.95] * 80)  # ... and hybrid below CE at both
    assert wants_more_seeds(setting, tmp_path) is False


def test_next_names_the_first_missing_run_with_its_settings_flags(tmp_path):
    cmd = next_command(tmp_path)
    first = next(iter(SETTINGS.values()))
    assert cmd[cmd.index("--worlds") + 1] == first.world and cmd[cmd.index("--keep") + 1] == str(tmp_path)
    assert cmd[cmd.index("--arms") + 1] == first.arms[0] and cmd[cmd.index("--seeds") + 1] == str(first.seeds[0])
    tagged = SETTINGS["paper/lr-5e-4"]
    cmd = from_scratch.command(tagged, "ce", 42, tmp_path)
    assert cmd[cmd.index("--tag") + 1] == tagged.tag and cmd[cmd.index("--head-lr") + 1] == tagged.head_lr
    assert "--alpha-estimate" not in cmd and "--steps" not in cmd


def test_the_export_leaves_the_default_undecided_until_every_run_is_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(from_scratch, "SETTINGS", {"demo/held-out": Setting("demo", ("growmtp", "hybrid"), (45,))})
    keep_run(tmp_path, "world-0123456789ab", "growmtp", 45, [1.0] * 100)
    doc = from_scratch.export(tmp_path)
    assert (doc["default"], doc["decided"], doc["runs_missing"]) == ("dca", False, 1)
    cmd = next_command(tmp_path)  # the hybrid run, not the kept one
    assert (cmd[cmd.index("--arms") + 1], cmd[cmd.index("--seeds") + 1]) == ("hybrid", "45")


def test_a_kept_seed_with_the_hybrid_too_far_below_decides_dca_before_the_rest_run(tmp_path, monkeypatch):
    monkeypatch.setattr(from_scratch, "SETTINGS", {"demo/held-out": Setting("demo", ("growmtp", "hybrid"), (45, 46))})
    keep_run(tmp_path, "world-0123456789ab", "growmtp", 45, [2.0] * 100)
    keep_run(tmp_path, "world-0123456789ab", "hybrid", 45, [1.99] * 100)  # -0.01: within the rule
    doc = from_scratch.export(tmp_path)
    assert (doc["default"], doc["decided"], doc["runs_missing"]) == ("dca", False, 2)
    keep_run(tmp_path, "world-0123456789ab", "hybrid", 45, [1.95] * 100)  # -0.05: no later seed can undo it
    doc = from_scratch.export(tmp_path)
    assert (doc["default"], doc["decided"], doc["runs_missing"]) == ("dca", True, 2)
