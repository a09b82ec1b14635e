"""`make speed-study`'s design and arithmetic, on synthetic runs: the arms' order reverses from run to run, every
ratio is against the same run's autoregressive arm, per generated token where the lengths differ, and a seed run
twice counts once across seeds, its two runs' difference kept as the noise it shows."""

from __future__ import annotations

import json

import pytest

from growmtp_lab import paired, report, speed_study
from growmtp_lab.paired import PairedPlan, checkpoint_dir, checkpoint_flags, depth_at
from growmtp_lab.demo import paired_plan
from openrlhf_growmtp.measure.intervals import verdict

SAMPLES = 16


def arm_rows(step_s: float, rollout_s: float, length: float, steps: int = 10, tau: float | None = None):
    rows = []
    for step in range(1, steps + 1):
        row = {"step": step, "step_s": step_s, "rollout_s": rollout_s, "response_length": length, "reward": 0.5}
        if tau is not None:
            row["tau"] = tau
        rows.append(row)
    return rows


def test_the_arms_order_reverses_from_one_run_to_the_next_and_the_repeat_comes_last():
    plan = speed_study.schedule([21, 22, 23], 21, ["ar", "fixed", "auto"])
    assert plan == [("seed21", 21, ["ar", "fixed", "auto"]), ("seed22", 22, ["auto", "fixed", "ar"]),
                    ("seed23", 23, ["ar", "fixed", "auto"]), ("seed21-repeat", 21, ["auto", "fixed", "ar"])]
    assert speed_study.schedule([5], None, ["ar", "fixed"]) == [("seed5", 5, ["ar", "fixed"])]


def test_ratios_are_against_the_same_runs_ar_arm_and_per_token_where_lengths_differ():
    # GrowMTP's rollouts take 2 s for 40-token responses, AR's 3 s for 30-token ones: per token 0.05 against 0.1
    ar = {"wall_s": 100.0, "rows": arm_rows(5.0, 3.0, 30.0)}
    fixed = {"wall_s": 90.0, "rows": arm_rows(4.0, 2.0, 40.0, tau=2.0),
             "paired": [{"step": 10, "speedup": {"estimate": 1.4, "low": 1.3, "high": 1.5}, "tau": 2.1}]}
    c = speed_study.compare(fixed, ar, SAMPLES)
    assert c["net_wall_ratio"] == pytest.approx(0.9)
    assert c["net_wall_per_token_ratio"] == pytest.approx((90 / (40 * 160)) / (100 / (30 * 160)))
    assert c["rollout_ratio_early"] == pytest.approx(2 / 3) and c["step_ratio_late"] == pytest.approx(0.8)
    assert c["rollout_per_token_ratio_late"] == pytest.approx((2 / 40) / (3 / 30))
    assert c["crossover_step"] == 1 and c["tau_final"] == 2.0
    assert c["paired"] == {"10": {"estimate": 1.4, "low": 1.3, "high": 1.5}} and c["paired_tau"] == {"10": 2.1}


def test_windows_leave_out_the_warm_up_step_and_hold_30_percent():
    rows = [{"step": s} for s in range(1, 51)]
    assert [r["step"] for r in speed_study.window(rows, 0.3, last=False)] == list(range(2, 16))
    assert [r["step"] for r in speed_study.window(rows, 0.3, last=True)] == list(range(36, 51))


def test_a_seed_run_twice_counts_once_and_its_spread_is_kept(tmp_path):
    out = tmp_path / "study"
    plan = speed_study.schedule([21, 22, 23], 21, ["ar", "fixed"])
    walls = {"seed21": 90.0, "seed22": 80.0, "seed23": 85.0, "seed21-repeat": 94.0}
    for name, _, arms in plan:
        for arm in arms:
            (out / name / arm).mkdir(parents=True)
            wall = 100.0 if arm == "ar" else walls[name]
            rows = arm_rows(5.0, 3.0, 30.0, tau=None if arm == "ar" else 2.0)
            (out / name / arm / speed_study.ARM_FILE).write_text(json.dumps({"wall_s": wall, "rows": rows}))
    preset = speed_study.WORLDS["speed"].recipes["full"]
    summary = speed_study.summarize(out, plan, preset)
    net = summary["across"]["fixed"]["net_wall_ratio"]
    assert net["per_seed"] == {"21": [0.90, 0.94], "22": [0.80], "23": [0.85]}
    assert net["n"] == 3 and net["estimate"] == pytest.approx((0.92 + 0.80 + 0.85) / 3)
    assert net["repeat_difference"] == pytest.approx(0.04)
    assert net["low"] < net["estimate"] < net["high"] and net["detectable"] > 0
    assert f"| {verdict(net)} |" in speed_study.table(summary).splitlines()[2]
    assert "| fixed | net_wall_ratio |" in speed_study.table(summary)
    rows = {name: {arm: json.loads((out / name / arm / speed_study.ARM_FILE).read_text())["rows"] for arm in arms}
            for name, _, arms in plan}
    assert speed_study.plot(tmp_path, summary, rows).stat().st_size > 10_000
    assert speed_study.plot_cumulative(tmp_path, summary, rows).stat().st_size > 10_000


def test_the_cumulative_wall_ratio_at_every_step_and_at_the_end_with_its_interval():
    # GrowMTP's steps cost 6 s for the first 10 steps, then 2 s; the autoregressive arm's 3 s throughout: the
    # cumulative ratio is 2 until step 10, then falls, and crosses 1 at step 41 (60 + 2 (s - 10) < 3 s: s > 40)
    ar = arm_rows(3.0, 2.0, 30.0, steps=60)
    mine = arm_rows(2.0, 1.0, 30.0, steps=60, tau=2.0)
    for row in mine[:10]:
        row["step_s"] = 6.0
    c = report.cumulative(mine, ar)
    assert c["ratio"][9] == pytest.approx(2.0) and c["ratio"][-1] == pytest.approx((60 + 100) / 180)
    assert c["crossover_step"] == 41 and c["steps"] == list(range(1, 61))
    end = c["end"]
    assert end["estimate"] == pytest.approx(c["ratio"][-1]) and end["method"].startswith("batch means")
    assert end["low"] < end["estimate"] < end["high"]  # the first batch's 6 s steps are spread
    assert report.cumulative(mine[:20], ar[:20])["end"] is None  # too few steps for batches


def test_paired_checkpoints_the_flags_the_places_and_the_depth_they_draft_at(tmp_path):
    assert checkpoint_flags(None) == []
    assert checkpoint_flags(5) == ["--ckpt.save_steps", "5", "--ckpt.save_hf", "--ckpt.disable_ds"]
    assert checkpoint_dir(tmp_path, 50, 50) == tmp_path / "final"
    assert checkpoint_dir(tmp_path, 10, 50) == tmp_path / "ckpt" / "global_step10_hf"  # upstream's name
    auto = [{"step": 1, "depth": 1}, {"step": 2, "depth": 3}, {"step": 3, "depth": 2}]
    assert depth_at(auto, 1, 3) == 3 and depth_at(auto, 3, 3) == 2  # the next step's depth, else its own
    assert depth_at([{"step": 1}], 1, 3) == 3  # a fixed-depth arm drafts at K
    full = PairedPlan(steps=(10, 50), pairs=6, every=10)
    assert paired_plan(full, 50) == full and full.processes == 3
    assert paired_plan(full, 25) == PairedPlan(steps=(10, 25), pairs=6, every=10)
    assert paired_plan(full, 8) == PairedPlan(steps=(8,), pairs=6, every=None)  # only the final export
    cmd = paired.command(tmp_path, 3, tmp_path / "p.jsonl", speed_study.WORLDS["speed"].recipes["full"], 6,
                         tmp_path / "o.json", processes=3)
    assert cmd[cmd.index("--processes") + 1] == "3" and cmd[cmd.index("--pairs") + 1] == "6"


def test_a_measured_checkpoint_is_not_measured_again(tmp_path, monkeypatch):
    (tmp_path / "paired").mkdir()
    (tmp_path / "paired" / "step10.json").write_text(json.dumps(
        {"speedup": {"estimate": 1.2, "low": 1.1, "high": 1.3, "n": 3}, "speedup_per_process": [1.1, 1.2, 1.3],
         "tau": 2.0, "depth": 3, "processes": 3, "rows": []}))
    monkeypatch.setattr(paired.subprocess, "run", lambda *a, **k: pytest.fail("measured again"))
    plan = PairedPlan(steps=(10,), pairs=6, every=10)
    found = paired.measure_run(tmp_path, [], tmp_path / "p.jsonl", speed_study.WORLDS["speed"].recipes["full"], plan,
                               3, log=lambda line: None)
    assert found == [{"step": 10, "speedup": {"estimate": 1.2, "low": 1.1, "high": 1.3, "n": 3},
                      "speedup_per_process": [1.1, 1.2, 1.3], "tau": 2.0, "depth": 3, "processes": 3}]
