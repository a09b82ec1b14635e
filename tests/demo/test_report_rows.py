"""`report.read_arm` over an auto run's TensorBoard log: positions a step did not draft read as None."""

from __future__ import annotations

import pytest

from growmtp_lab import report


def test_positions_no_step_drafted_read_as_none(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    logged = {1: {"alpha_1": 0.25}, 2: {"alpha_1": 0.5, "alpha_3": 0.125}}  # depth 1, then 3; alpha_2 never logged
    for step, alphas in logged.items():
        writer.add_scalar("train/reward", 0.5, step)
        for name, value in alphas.items():
            writer.add_scalar(f"train/growmtp/{name}", value, step)
    writer.close()
    rows = report.read_arm(tmp_path, "auto", 3)
    assert [row["alpha"] for row in rows] == [[0.25, None, None], [0.5, None, pytest.approx(0.125)]]
