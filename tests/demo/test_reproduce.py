"""`make reproduce`'s comparison: every logged number but wall-clock time and memory, step by step."""

from growmtp_lab.reproduce import compare_scalars, is_machine_reading


def test_wall_clock_and_memory_tags_are_left_out_and_everything_else_is_compared():
    assert is_machine_reading("train/timing/generation") and is_machine_reading("train/growmtp/head_update_s")
    assert is_machine_reading("train/growmtp/mem_trainer_peak_gib")
    assert not is_machine_reading("train/growmtp/tau") and not is_machine_reading("train/reward")
    first = {"train/growmtp/tau": {1: 1.5, 2: 1.75, 3: 2.0}, "train/reward": {1: 0.5, 2: 0.5, 3: 0.25},
             "train/timing/step_total": {1: 3.0, 2: 3.1, 3: 2.9}}
    same = {tag: dict(values) for tag, values in first.items()}
    same["train/timing/step_total"] = {1: 9.0, 2: 9.0, 3: 9.0}
    assert compare_scalars(first, same) == (6, [])
    drifted = {tag: dict(values) for tag, values in first.items()}
    drifted["train/reward"][2] = 0.5000001
    compared, differences = compare_scalars(first, drifted)
    assert compared == 6 and len(differences) == 1 and "first differs at step 2 (1 of 3 steps)" in differences[0]
    shorter = {tag: dict(values) for tag, values in first.items()}
    del shorter["train/growmtp/tau"][3]
    assert "logged at steps" in compare_scalars(first, shorter)[1][0]
