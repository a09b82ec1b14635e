"""The startup check of a resume (`trainer/resume.py`) on checkpoint layouts made here, as DeepSpeed and a run
with a training head write them: a `latest` file naming the tag, the tag's directory, the head snapshot in it."""

from __future__ import annotations

import pytest

from openrlhf_growmtp.trainer.resume import (ACTOR_DIR, LATEST, SNAPSHOT_FILE, checkpoint_to_load, publish_latest,
                                             resume_problem)


def saved(tmp_path, with_head: bool, tag: str = "global_step7"):
    (tmp_path / ACTOR_DIR / tag).mkdir(parents=True)
    (tmp_path / ACTOR_DIR / LATEST).write_text(tag)
    if with_head:
        (tmp_path / ACTOR_DIR / tag / SNAPSHOT_FILE).write_bytes(b"")
    return tmp_path


def flags(ckpt, k: int, mode: str = "detached", load: bool = True) -> dict:
    return {"ckpt.path": str(ckpt), "ckpt.load_enable": load, "growmtp.k": k, "growmtp.mode": mode}


def test_the_checkpoint_is_the_one_latest_names(tmp_path):
    assert checkpoint_to_load(tmp_path) is None  # nothing saved: a fresh start
    saved(tmp_path, True, tag="global_step3")
    assert checkpoint_to_load(tmp_path) == tmp_path / ACTOR_DIR / "global_step3"
    (tmp_path / ACTOR_DIR / LATEST).write_text("global_step9\n")  # a tag whose directory is gone
    assert checkpoint_to_load(tmp_path) is None


@pytest.mark.parametrize("k,mode", [(3, "detached"), (5, "detached"), (1, "joint")])
def test_a_head_checkpoint_resumes_with_a_training_head_at_any_depth(tmp_path, k, mode):
    assert resume_problem(flags(saved(tmp_path, True), k, mode)) is None


@pytest.mark.parametrize("k,mode", [(0, "detached"), (3, "frozen")])
def test_a_head_checkpoint_is_refused_without_a_training_head(tmp_path, k, mode):
    problem = resume_problem(flags(saved(tmp_path, True), k, mode))
    assert "holds a training GrowMTP head" in problem and "global_step7" in problem
    assert "--growmtp_k >= 1" in problem and "--actor.model_name_or_path" in problem


def test_a_checkpoint_without_a_head_is_refused_with_one_and_resumes_without(tmp_path):
    ckpt = saved(tmp_path, False)
    assert f"has no {SNAPSHOT_FILE}: it was saved without a training GrowMTP head" in resume_problem(flags(ckpt, 3))
    assert resume_problem(flags(ckpt, 0)) is None
    assert resume_problem(flags(ckpt, 3, "frozen")) is None


def test_nothing_is_checked_without_a_resume(tmp_path):
    ckpt = saved(tmp_path, True)
    assert resume_problem(flags(ckpt, 0, load=False)) is None
    assert resume_problem(flags(tmp_path / "elsewhere", 0)) is None  # --ckpt.load_enable with nothing saved


@pytest.mark.parametrize("text, says", [("global_step9\n", "names 'global_step9', which is not there"),
                                        ("", "is empty"), ("\n", "is empty")])
@pytest.mark.parametrize("k", [0, 3])
def test_a_latest_that_names_no_checkpoint_is_refused_not_started_afresh(tmp_path, text, says, k):
    """A save cut short while DeepSpeed rewrote `latest` (in place) leaves it empty; rotated-out checkpoints leave
    it naming a missing tag. DeepSpeed would then start the run afresh with a warning."""
    ckpt = saved(tmp_path, True, tag="global_step3")
    (ckpt / ACTOR_DIR / LATEST).write_text(text)
    assert checkpoint_to_load(ckpt) is None
    problem = resume_problem(flags(ckpt, k))
    assert says in problem and "['global_step3']" in problem and "drop --ckpt.load_enable" in problem
    assert resume_problem(flags(ckpt, k, load=False)) is None


def test_latest_is_replaced_whole(tmp_path):
    saved(tmp_path, True, tag="global_step1")
    publish_latest(tmp_path / ACTOR_DIR, "global_step2")
    assert (tmp_path / ACTOR_DIR / LATEST).read_text() == "global_step2"
    assert sorted(p.name for p in (tmp_path / ACTOR_DIR).iterdir()) == ["global_step1", LATEST]
