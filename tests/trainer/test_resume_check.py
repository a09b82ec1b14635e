"""The startup check of a resume (`trainer/resume.py`) on checkpoint layouts made here, as DeepSpeed and a run
with a training head write them: a `latest` file naming the tag, the tag's directory, DeepSpeed's files of every
rank (ZeRO-3's names, written by torch.save) and the head snapshot in it."""

from __future__ import annotations

import pytest
import torch

from openrlhf_growmtp.trainer.resume import (ACTOR_DIR, CRITIC_DIR, LATEST, MODEL_STATES, SNAPSHOT_FILE,
                                             checkpoint_to_load, publish_latest, resume_problem)

RANKS = 2
DEEPSPEED_FILES = [f"{prefix}zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt" for rank in range(RANKS)
                   for prefix, kind in (("", "model"), ("bf16_", "optim"))]


def saved(tmp_path, with_head: bool, tag: str = "global_step7", role: str = ACTOR_DIR):
    (tmp_path / role / tag).mkdir(parents=True)
    (tmp_path / role / LATEST).write_text(tag)
    for name in DEEPSPEED_FILES + ([SNAPSHOT_FILE] if with_head else []):
        torch.save({"state": torch.arange(1000.0 + len(name))}, tmp_path / role / tag / name)
    return tmp_path


def flags(ckpt, k: int, mode: str = "detached", load: bool = True, ranks: int = RANKS) -> dict:
    return {"ckpt.path": str(ckpt), "ckpt.load_enable": load, "growmtp.k": k, "growmtp.mode": mode,
            "actor.num_nodes": 1, "actor.num_gpus_per_node": ranks, "critic.num_gpus_per_node": ranks}


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


def test_latest_is_replaced_whole(tmp_path, monkeypatch):
    saved(tmp_path, True, tag="global_step1")
    publish_latest(tmp_path / ACTOR_DIR, "global_step2")
    assert (tmp_path / ACTOR_DIR / LATEST).read_text() == "global_step2"
    assert sorted(p.name for p in (tmp_path / ACTOR_DIR).iterdir()) == ["global_step1", LATEST]

    def cut_short(src, dst):  # the process dies between writing the new name and putting it in place
        raise KeyboardInterrupt

    monkeypatch.setattr("openrlhf_growmtp.trainer.resume.os.replace", cut_short)
    with pytest.raises(KeyboardInterrupt):
        publish_latest(tmp_path / ACTOR_DIR, "global_step3")
    assert (tmp_path / ACTOR_DIR / LATEST).read_text() == "global_step2"  # the old name, whole


@pytest.mark.parametrize("name", [DEEPSPEED_FILES[3], DEEPSPEED_FILES[0], SNAPSHOT_FILE])
@pytest.mark.parametrize("keep", [0.5, 0.999, 0.0])
def test_a_file_the_resume_loads_cut_short_is_refused_by_name(tmp_path, name, keep):
    """A save cut short by a full disk (or a copy) leaves a file without the end of its zip archive; DeepSpeed would
    fail on it only after Ray and the engines had started, naming no file."""
    ckpt = saved(tmp_path, True)
    path = ckpt / ACTOR_DIR / "global_step7" / name
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])
    problem = resume_problem(flags(ckpt, 3))
    assert f"{path} is cut short" in problem and "global_step7 would not load" in problem
    assert "write its tag into" in problem and "drop --ckpt.load_enable" in problem
    path.write_bytes(data)  # whole again: nothing else is wrong
    assert resume_problem(flags(ckpt, 3)) is None


def test_a_rank_missing_its_files_and_an_unreadable_file_are_refused_by_name(tmp_path):
    ckpt = saved(tmp_path, True)
    tag = ckpt / ACTOR_DIR / "global_step7"
    (tag / DEEPSPEED_FILES[3]).unlink()  # rank 1's optimizer partition
    assert "lacks the optim states of rank(s) [1] of the 2 that saved it" in resume_problem(flags(ckpt, 3))
    torch.save({}, tag / DEEPSPEED_FILES[3])
    for name in DEEPSPEED_FILES[:1] + DEEPSPEED_FILES[2:3]:
        (tag / name).unlink()  # ZeRO-3's model states of every rank, and not ZeRO-2's one file either
    assert "holds no DeepSpeed model states" in resume_problem(flags(ckpt, 3))
    torch.save({}, tag / MODEL_STATES)  # ZeRO-2's layout: one model-states file
    assert resume_problem(flags(ckpt, 3)) is None
    (tag / DEEPSPEED_FILES[1]).unlink()
    (tag / DEEPSPEED_FILES[1]).mkdir()  # there, but no file to read (a permission the user lacks reads alike)
    assert f"{tag / DEEPSPEED_FILES[1]} cannot be read" in resume_problem(flags(ckpt, 3))


def test_the_last_rank_losing_every_file_and_another_world_size_are_refused(tmp_path):
    """The files alone cannot tell a checkpoint of 2 ranks whose rank 1 lost both files from one of 1 rank: the
    ranks this run trains on can (DeepSpeed loads ZeRO's optimizer states only on as many ranks as saved them)."""
    ckpt = saved(tmp_path, True)
    tag = ckpt / ACTOR_DIR / "global_step7"
    assert "was saved by at least 2 ranks, and this run trains on 1" in resume_problem(flags(ckpt, 3, ranks=1))
    for name in DEEPSPEED_FILES[2:]:
        (tag / name).unlink()  # rank 1's model and optimizer states
    problem = resume_problem(flags(ckpt, 3))
    assert "lacks the model states of rank(s) [1] of the 2" in problem
    assert "lacks the optim states of rank(s) [1] of the 2" in problem
    assert resume_problem(flags(ckpt, 3, ranks=1)) is None  # as one rank saved it
    # with ring attention DeepSpeed's data-parallel ranks are fewer than the GPUs: the files alone decide
    assert resume_problem({**flags(ckpt, 3), "ds.ring_attn_size": 2}) is None


def test_the_critics_checkpoint_is_checked_too(tmp_path):
    ckpt = saved(saved(tmp_path, True), False, role=CRITIC_DIR)
    assert resume_problem(flags(ckpt, 3)) is None
    path = ckpt / CRITIC_DIR / "global_step7" / DEEPSPEED_FILES[1]
    path.write_bytes(path.read_bytes()[:100])
    assert f"{path} is cut short" in resume_problem(flags(ckpt, 3))
