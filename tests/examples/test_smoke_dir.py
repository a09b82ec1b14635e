"""GROWMTP_SMOKE=1 and GROWMTP_REHEARSAL=1 never delete a directory they did not make (`fresh_own_dir` in common.sh).

The script runs under a stand-in python (a shell script that logs its arguments, decides a GPU run and
succeeds), so only the shell's own file handling is exercised: which directory the smoke writes to, and what
it removes before it starts."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "scripts" / "qwen3_4b_math.sh"

STAND_IN = """#!/usr/bin/env bash
printf '%s\\n' "$*" >> "$STAND_IN_LOG"
case "$*" in
  *pathlib*) echo /nowhere/math_reward.py ;;  # the reward's path, printed by python -c
  *decide_run*) echo "a GPU run"; exit 1 ;;  # cpu_support's decision: exit 1 is "no CPU run needed", a GPU run
esac
exit 0  # every other call succeeds
"""


def run_script(tmp_path: Path, *args: str, **env_vars: str) -> tuple[subprocess.CompletedProcess, str]:
    """qwen3_4b_math.sh under the stand-in python with `env_vars` (none of the modes unless given): the result
    and the stand-in's calls."""
    python = tmp_path / "python"
    python.write_text(STAND_IN)
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "calls.log"
    log.write_text("")
    env = {key: value for key, value in os.environ.items()
           if key not in ("OUTPUT_ROOT", "GROWMTP_REHEARSAL", "GROWMTP_SMOKE")}
    env.update(PYTHON=str(python), STAND_IN_LOG=str(log), DATA_ROOT=str(tmp_path / "data"), **env_vars)
    result = subprocess.run(["bash", str(SCRIPT), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=60)
    return result, log.read_text()


def run_smoke(tmp_path: Path, run_root: Path) -> tuple[subprocess.CompletedProcess, str]:
    return run_script(tmp_path, GROWMTP_SMOKE="1", RUN_ROOT=str(run_root))


def test_smoke_writes_beside_run_root_and_keeps_its_files(tmp_path):
    real = tmp_path / "my_run"
    (real / "ckpt").mkdir(parents=True)
    (real / "ckpt" / "weights.pt").write_text("a real run's checkpoint")
    result, calls = run_smoke(tmp_path, real)
    assert result.returncode == 0, result.stderr
    assert (real / "ckpt" / "weights.pt").read_text() == "a real run's checkpoint"
    train = next(line for line in calls.splitlines() if "openrlhf_growmtp.cli.train_ppo_ray" in line)
    assert f"--ckpt.path {tmp_path}/my_run_smoke/ckpt " in train
    assert (tmp_path / "my_run_smoke" / ".growmtp_smoke").is_file()


def test_smoke_refuses_a_directory_it_did_not_make(tmp_path):
    taken = tmp_path / "other_smoke"  # a RUN_ROOT already ending in _smoke is used as it is
    taken.mkdir()
    (taken / "notes.txt").write_text("keep me")
    result, calls = run_smoke(tmp_path, taken)
    assert result.returncode == 2
    assert f"{taken} exists and was not made by a smoke" in result.stderr
    assert (taken / "notes.txt").read_text() == "keep me"
    assert "train_ppo_ray" not in calls  # stopped before the run


def test_smoke_empties_its_own_directory_from_an_earlier_smoke(tmp_path):
    real = tmp_path / "my_run"
    first, _ = run_smoke(tmp_path, real)
    assert first.returncode == 0, first.stderr
    leftover = tmp_path / "my_run_smoke" / "ckpt" / "step_3"
    leftover.mkdir(parents=True)
    second, _ = run_smoke(tmp_path, real)
    assert second.returncode == 0, second.stderr
    assert not leftover.exists() and (tmp_path / "my_run_smoke" / ".growmtp_smoke").is_file()
    assert not real.exists()  # the real run's directory was never made


def run_rehearsal(tmp_path: Path, rehearsal_dir: Path) -> tuple[subprocess.CompletedProcess, str]:
    return run_script(tmp_path, GROWMTP_REHEARSAL="1", GROWMTP_REHEARSAL_DIR=str(rehearsal_dir))


def test_a_rehearsal_never_deletes_a_run_directory_it_did_not_make(tmp_path):
    """GROWMTP_REHEARSAL_DIR=. puts a rehearsal's run at ./runs/<run>, a real run's default directory."""
    real = tmp_path / "runs" / "qwen3_4b_math_k5"
    (real / "ckpt").mkdir(parents=True)
    (real / "ckpt" / "weights.pt").write_text("a real run's checkpoint")
    result, calls = run_rehearsal(tmp_path, tmp_path)
    assert result.returncode == 2
    assert f"{real} exists and was not made by a rehearsal" in result.stderr
    assert (real / "ckpt" / "weights.pt").read_text() == "a real run's checkpoint"
    assert "train_ppo_ray" not in calls
    own = tmp_path / "rehearsal"
    leftover = own / "runs" / "qwen3_4b_math_k5" / "leftover"
    for _ in range(2):  # the second rehearsal empties the first one's directory
        result, calls = run_rehearsal(tmp_path, own)
        assert result.returncode == 0, result.stderr
        assert "train_ppo_ray" in calls and not leftover.exists()
        assert (own / "runs" / "qwen3_4b_math_k5" / ".growmtp_rehearsal").is_file()
        leftover.write_text("")


def test_a_second_run_into_a_runs_directory_is_refused_unless_it_resumes(tmp_path):
    """Upstream rotates older checkpoints away as a run saves: a second run of one script would remove the
    first one's checkpoints and replace its export."""
    root = tmp_path / "my_run"
    (root / "ckpt" / "_actor").mkdir(parents=True)
    (root / "ckpt" / "_actor" / "latest").write_text("global_step50")
    for extra, code in (([], 2), (["--ckpt.load_enable"], 0)):
        result, calls = run_script(tmp_path, *extra, RUN_ROOT=str(root))
        assert result.returncode == code, result.stderr
        assert ("train_ppo_ray" in calls) == (code == 0)
        assert ("already holds a run's checkpoints" in result.stderr) == (code == 2)
    smoke, _ = run_smoke(tmp_path, root)  # the smoke writes beside the run, so it goes ahead
    assert smoke.returncode == 0, smoke.stderr
