"""Which checkpoints a resumed run can load, decided at startup.

`--ckpt.load_enable` resumes from DeepSpeed's checkpoint under `<ckpt.path>/_actor/<tag>` (the tag named in
its `latest` file). A run with a training head saves the head inside it: the head's parameters in the model's
state (under `mtp_head.`) and the head's own param group in the optimizer's. DeepSpeed loads both strictly, so a
run without a training head (`--growmtp_k 0`, or `--growmtp_mode frozen`) cannot load a checkpoint that has one,
nor a run with a training head one that has none. Either way DeepSpeed would fail only after Ray and the
engines have started, with a list of unexpected keys; this check says so before anything starts.

A checkpoint has a head when its tag holds SNAPSHOT_FILE, which a run with a training head writes beside every
checkpoint it saves (`ppo_actor.GrowMTPPolicyActor`). Such a run names the tag in `latest` itself, once the
snapshot is there too (`publish_latest`), so a save cut short leaves `latest` naming the tag it named before,
never a tag without its snapshot (upstream's rotation, before the save, may have deleted that tag: then the
`latest` check below refuses the resume).

Every file the resume will load is checked here too (`unloadable_files`): DeepSpeed's model and optimizer states
of every rank this run trains on (DeepSpeed loads ZeRO's states only on as many ranks as saved them; no rank's
missing, the last one's included) and the head snapshot, each readable and whole (a
`torch.save` file is a zip archive, whose directory is its last bytes: a file cut short has none). DeepSpeed would
otherwise fail on a cut file only after Ray and the engines had started, naming none. No openrlhf or DeepSpeed
import here.
"""

from __future__ import annotations

import os
import re
import zipfile
from pathlib import Path

SNAPSHOT_FILE = "growmtp_head_snapshot.pt"  # head weights, rank-0 head Adam moments and head LR
ACTOR_DIR = "_actor"  # upstream's actor checkpoints under --ckpt.path
LATEST = "latest"  # DeepSpeed's file naming the newest tag
CRITIC_DIR = "_critic"  # upstream's critic checkpoints under --ckpt.path (a run with a critic)
MODEL_STATES = "mp_rank_00_model_states.pt"  # DeepSpeed's model states (ZeRO-2: one file for every rank)
# DeepSpeed's per-rank files: ZeRO's optimizer partitions (bf16_ under bf16), ZeRO-3's model-state partitions
RANK_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_(optim|model)_states\.pt$")


def checkpoint_to_load(ckpt_path: str | Path, role: str = ACTOR_DIR) -> Path | None:
    """The checkpoint directory a resume from `ckpt_path` would load for `role` (None: none, and it starts fresh)."""
    latest = Path(ckpt_path) / role / LATEST
    if not latest.is_file():
        return None
    tag = latest.read_text().strip()
    tag_dir = latest.parent / tag
    return tag_dir if tag and tag_dir.is_dir() else None


def publish_latest(actor_dir: str | Path, tag: str) -> None:
    """Name `tag` in `latest`, atomically: a reader sees the old tag or the new one, never an empty file."""
    latest = Path(actor_dir) / LATEST
    partial = latest.with_name(LATEST + ".partial")
    partial.write_text(tag)
    os.replace(partial, latest)


def _unreadable_latest(ckpt_path: str | Path) -> str | None:
    """Why `latest` names no checkpoint, where it exists (DeepSpeed would then start the run afresh)."""
    actor_dir = Path(ckpt_path) / ACTOR_DIR
    latest = actor_dir / LATEST
    if not latest.is_file() or checkpoint_to_load(ckpt_path) is not None:
        return None
    tag = latest.read_text().strip()
    saved = sorted((d.name for d in actor_dir.iterdir() if d.is_dir()), key=lambda n: (actor_dir / n).stat().st_mtime)
    what = f"names {tag!r}, which is not there" if tag else "is empty (a save cut short while writing it)"
    return (f"--ckpt.load_enable: {latest} {what}, so the run would start afresh instead of resuming. Write the tag "
            f"of the checkpoint to resume into it (the checkpoints there, oldest first: {saved or 'none'}), or drop "
            "--ckpt.load_enable to start afresh")


def resume_problem(flat: dict) -> str | None:
    """Why this run cannot load the checkpoint it would resume from (None: it can, or it resumes nothing).
    `flat` is vars(the parsed namespace)."""
    if not flat.get("ckpt.load_enable") or not flat.get("ckpt.path"):
        return None
    if unreadable := _unreadable_latest(flat["ckpt.path"]):
        return unreadable
    checkpoint = checkpoint_to_load(flat["ckpt.path"])
    if checkpoint is None:
        return None
    saved_with_head = (checkpoint / SNAPSHOT_FILE).is_file()
    training_head = (flat.get("growmtp.k") or 0) > 0 and flat.get("growmtp.mode") != "frozen"
    fresh_run = ("start a new run (a new --ckpt.path) from the run's HF export (--ckpt.output_dir, or a "
                 "--ckpt.save_hf checkpoint) as --actor.model_name_or_path: the policy's weights carry over, its "
                 "optimizer state and LR schedule start again")
    if saved_with_head and not training_head:
        return (f"--ckpt.load_enable: {checkpoint} holds a training GrowMTP head (its weights and Adam state), "
                "which a run without one (--growmtp_k 0 or --growmtp_mode frozen) cannot load. Resume with "
                f"--growmtp_k >= 1 (any depth), or, to go on without the head, {fresh_run}")
    if training_head and not saved_with_head:
        return (f"--ckpt.load_enable: {checkpoint} has no {SNAPSHOT_FILE}: it was saved without a training GrowMTP "
                "head (--growmtp_k 0 or --growmtp_mode frozen), and a run that trains one cannot load it. Resume it "
                f"as it was saved, or, to start growing a head from this policy, {fresh_run}")
    checkpoints = [(checkpoint, _ranks(flat, "actor")), (checkpoint_to_load(flat["ckpt.path"], CRITIC_DIR),
                                                        _ranks(flat, "critic"))]
    problems = [problem for saved, ranks in checkpoints if saved is not None
                for problem in unloadable_files(saved, ranks)]
    if problems:
        saved = sorted(d.name for d in checkpoint.parent.iterdir() if d.is_dir() and d != checkpoint)
        return (f"--ckpt.load_enable: the checkpoint {checkpoint.name} would not load: {'; '.join(problems)}. Resume "
                f"from an earlier checkpoint (write its tag into {checkpoint.parent / LATEST}; there: "
                f"{saved or 'none'}), or drop --ckpt.load_enable to start afresh")
    return None


def _ranks(flat: dict, role: str) -> int | None:
    """The data-parallel ranks of `role` in this run, which DeepSpeed's ZeRO files are saved per (it loads
    ZeRO's optimizer states only on as many ranks as saved them); None where ring attention or DeepSpeed's
    tensor parallelism split them further (the files alone then)."""
    if (flat.get("ds.ring_attn_size") or 1) > 1 or (flat.get("ds.tensor_parallel_size") or 1) > 1:
        return None
    return (flat.get(f"{role}.num_nodes") or 1) * (flat.get(f"{role}.num_gpus_per_node") or 1)


def unloadable_files(checkpoint: Path, ranks: int | None = None) -> list[str]:
    """What of the files a resume on `ranks` training ranks (None: as many as saved it) loads from `checkpoint`
    (a tag directory) is missing, unreadable or cut short."""
    files = sorted(checkpoint.glob("*.pt"))
    saved: dict[str, set[int]] = {}  # kind -> the ranks whose file of that kind is there
    for path in files:
        if match := RANK_FILE.match(path.name):
            saved.setdefault(match.group(2), set()).add(int(match.group(1)))
    problems = []
    if not (checkpoint / MODEL_STATES).is_file() and "model" not in saved:
        problems.append(f"{checkpoint} holds no DeepSpeed model states ({MODEL_STATES} or "
                        "zero_pp_rank_*_model_states.pt)")
    highest = max((max(ids) + 1 for ids in saved.values()), default=0)  # files there of ranks 0..highest-1
    if ranks is not None and highest > ranks:
        problems.append(f"{checkpoint} was saved by at least {highest} ranks, and this run trains on {ranks}: "
                        "DeepSpeed loads ZeRO's states only on as many ranks as saved them")
    saved_by = highest if ranks is None else ranks  # the files alone miss a last rank that lost all of its
    for kind, ids in sorted(saved.items()):
        if missing := sorted(set(range(saved_by)) - ids):
            problems.append(f"{checkpoint} lacks the {kind} states of rank(s) {missing} of the {saved_by} that "
                            "saved it")
    return problems + [problem for path in files if (problem := _unloadable(path))]


def _unloadable(path: Path) -> str | None:
    """Why a `torch.save` file would not load (None: readable, with its whole zip directory)."""
    try:
        size = path.stat().st_size
        with zipfile.ZipFile(path) as archive:
            beyond = [info.filename for info in archive.infolist() if info.header_offset + info.compress_size > size]
    except zipfile.BadZipFile:
        return f"{path} is cut short or not a torch.save file ({size:,} bytes, no whole zip directory at its end)"
    except OSError as err:
        return f"{path} cannot be read ({err.strerror or err})"
    return f"{path} is cut short: its entries {beyond[:3]} reach past its {size:,} bytes" if beyond else None
