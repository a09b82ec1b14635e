"""The demo's task, reward, world pieces and report, without Ray (fast)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from growmtp_lab import report
from growmtp_lab.worlds import demo_world as world, task
from growmtp_lab.worlds.demo_reward import reward_func


def test_worked_solution_is_correct_arithmetic():
    rng = random.Random(3)
    for _ in range(200):
        a, b = task.sample_problem(rng, 2, 4)
        text = task.solution_text(a, b)
        steps, answer = text.rsplit(" , A ", 1)
        assert int(answer.replace(" ", "")) == a + b
        carry = 0
        for column, (x, y) in zip(steps.split(" , "), zip(str(a)[::-1], str(b)[::-1])):
            terms, total = column.split(" = ")
            assert [int(t) for t in terms.split(" + ")] == [int(x), int(y)] + ([1] if carry else [])
            assert int(total.replace(" ", "")) == int(x) + int(y) + carry
            carry = int(total.replace(" ", "")) // 10


@pytest.mark.parametrize("response, label, expected", [
    ("7 + 9 = 1 6 , A 9 3 6 <eos>", "936", 1.0),
    ("A 9 3 6", "936", 1.0),
    ("A 9 3 6 <eos>", "937", 0.0),
    ("7 + 9 = 1 6 , 9 3 6 <eos>", "936", 0.0),  # no answer marker
    ("A 1 2 , A 9 3 6", "936", 1.0),  # the last answer counts
    ("A <eos>", "0", 0.0),
    ("A 0 9 3 6", "936", 1.0),  # leading zero: the same number
    ("", "936", 0.0),
])
def test_score(response, label, expected):
    assert task.score(response, label) == expected


def test_tokenizer_round_trip_and_reward_func():
    tokenizer = task.make_tokenizer()
    prompt = task.prompt_text(347, 589)
    ids = tokenizer(prompt + " " + task.solution_text(347, 589) + " <eos>", add_special_tokens=False)["input_ids"]
    assert task.VOCAB.index("<unk>") not in ids and ids[-1] == task.EOS_ID
    query = tokenizer.decode(ids)
    out = reward_func([query, query.replace("A 9 3 6", "A 9 3 7")], [prompt, prompt], ["936", "936"])
    assert out["rewards"].tolist() == [1.0, 0.0] and out["scores"].tolist() == [1.0, 0.0]


def test_batched_solution_logprobs_equal_one_problem_at_a_time():
    # the pretraining loss and its accuracy estimate come from padded batches: padding must not leak
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(task.VOCAB), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, pad_token_id=0)
    model = Qwen3ForCausalLM(config).eval()
    tokenizer = task.make_tokenizer()
    problems = [(12, 34), (4567, 8901), (305, 999)]  # different lengths
    with torch.no_grad():
        batched = world.solution_logprobs(model, *world.make_batch(tokenizer, problems))
        single = torch.cat([world.solution_logprobs(model, *world.make_batch(tokenizer, [p])) for p in problems])
        # the reference: sum of log p(solution token | prefix) over an unpadded sequence
        prompt, solution = world.encode(tokenizer, 4567, 8901)
        ids = torch.tensor([prompt + solution])
        logp = torch.log_softmax(model(ids).logits[0, :-1], -1)
        by_hand = sum(float(logp[i - 1, ids[0, i]]) for i in range(len(prompt), ids.shape[1]))
    torch.testing.assert_close(batched, single, atol=1e-4, rtol=0)
    assert abs(float(batched[1]) - by_hand) < 1e-4


def test_prompts_file_has_the_field_layout_and_correct_labels(tmp_path):
    spec = world.WorldSpec(num_prompts=50)
    world.write_prompts(tmp_path / "p.jsonl", spec)
    import json

    rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert len(rows) == 50
    for row in rows:
        left, right = row["input"].rstrip(" =").split(" + ")
        assert int(row["label"]) == int(left.replace(" ", "")) + int(right.replace(" ", ""))


def rows_for(arm, values, k=0):
    out = []
    for step, (reward, rollout, step_s) in enumerate(values, start=1):
        row = {"arm": arm, "step": step, "reward": reward, "rollout_s": rollout, "step_s": step_s}
        if k:
            row.update(tau=1.0 + 0.1 * step, alpha=[0.1 * step] + [0.0] * (k - 1), head_update_s=0.5)
        out.append(row)
    return out


def test_summary_ratios_skip_the_warm_up_step_and_final_is_a_window():
    growmtp = rows_for("growmtp", [(0.1, 10.0, 20.0)] + [(0.5, 2.0, 4.0)] * 7 + [(0.9, 4.0, 8.0)], k=2)
    ar = rows_for("ar", [(0.2, 10.0, 10.0)] + [(0.6, 1.0, 2.0)] * 8)
    s = report.summarize(growmtp, ar, k=2, extra={})
    assert s["final_window"] == 2  # 9 steps: at most a quarter of them
    assert s["rollout_time_ratio"] == pytest.approx((7 * 2.0 + 4.0) / 8 / 1.0)
    assert s["step_time_ratio"] == pytest.approx((7 * 4.0 + 8.0) / 8 / 2.0)
    assert s["rollout_time_ratio_all_steps"] == pytest.approx((10 + 14 + 4) / 9 / ((10 + 8) / 9))
    assert s["tau_first"] == pytest.approx(1.1) and s["tau_final"] == pytest.approx(1.85)
    assert s["alpha_final"] == pytest.approx([0.85, 0.0])
    assert s["reward_final_growmtp"] == pytest.approx(0.7) and s["reward_final_ar"] == pytest.approx(0.6)
    assert "  1  1.100  0.10  0.00" in report.table(growmtp, ar, 2)


def test_speedups_are_autoregressive_over_growmtp_means_of_the_last_ten_steps():
    # 12 steps: the first two slower than AR, the last ten at known times
    growmtp = rows_for("growmtp", [(0.5, 9.0, 12.0)] * 2 + [(0.5, 2.0, 4.0)] * 10, k=1)
    ar = rows_for("ar", [(0.5, 3.0, 6.0)] * 2 + [(0.5, 3.0, 5.0)] * 10)
    s = report.summarize(growmtp, ar, k=1, extra={})
    assert s["rollout_speedup_last10"] == pytest.approx(3.0 / 2.0)
    assert s["step_speedup_last10"] == pytest.approx(5.0 / 4.0)
    assert s["crossover_step"] is None  # cumulative 24 s against 12 s after 2 steps, 64 s against 62 s after 12


@pytest.mark.parametrize("ratios, expected", [
    ([1.3, 0.6, 1.1, 0.9, 0.8], 4),  # cumulative 13/10, 19/20, 30/30 (a tie), 39/40, 47/50: below from step 4
    ([0.9, 0.9, 0.9], 1),            # below from the first step
    ([0.9, 1.1, 1.0], None),         # 9/10, 20/20: a tie at the last step is not below
    ([1.2, 1.1], None),
    ([1.5, 0.4, 0.95], 2),           # a slow first step paid back by the second (15/10, 19/20, 28.5/30)
])
def test_crossover_is_the_step_from_which_the_cumulative_wall_stays_below(ratios, expected):
    growmtp = [{"step": i + 1, "step_s": 10.0 * r} for i, r in enumerate(ratios)]
    ar = [{"step": i + 1, "step_s": 10.0} for i in range(len(ratios))]
    assert report.crossover_step(growmtp, ar) == expected


def test_auto_depth_rows_the_table_and_the_summary(tmp_path):
    """--growmtp_depth auto: alpha logged up to each step's depth only; the table shows the depth, the summary
    averages the positions where they were logged."""
    growmtp = rows_for("growmtp", [(0.5, 3.0, 6.0), (0.5, 3.0, 6.6), (0.5, 2.0, 4.0), (0.5, 2.0, 4.0)], k=3)
    for row, depth in zip(growmtp, (1, 1, 3, 3)):
        row["depth"] = depth
        row["alpha"] = row["alpha"][:depth] + [None] * (3 - depth)
    ar = rows_for("ar", [(0.5, 3.0, 6.0)] * 4)
    table = report.table(growmtp, ar, 3)
    assert "depth" in table and "    1     1  1.100  0.10     -     -" in table
    s = report.summarize(growmtp, ar, k=3, extra={})
    assert s["alpha_final"] == pytest.approx([0.4, 0.0, 0.0])  # the last step (window 1), every position drafted
    assert report.plot(tmp_path, growmtp, ar, 3)[2].name == "time.png"
