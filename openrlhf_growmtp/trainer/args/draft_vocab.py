"""`--growmtp_draft_vocab N`: the head drafts over the run's N most frequent token ids (`core/draft_vocab.py`).

Its flag and its startup checks, which the package (`args/__init__.py`) registers and runs with the others.
Where it works: a GrowMTP head drafting in engines of one tensor-parallel rank, trained on its draft paths by an
objective that reads only α (DCA or TV), under the synchronous controller (the vocabulary is re-ranked between
rollouts and every record must be drafted over the one the trainer holds).
"""

from __future__ import annotations

from ...core.checkpoint import HeadCheckpointError, resolve_backbone
from ...core.objectives import CHAIN_OBJECTIVES
from ...hub import ModelLocationError, local_dir


def add_draft_vocab_flag(flag) -> None:
    """Register the flag through the package's `flag` (both spellings)."""
    flag("draft_vocab", type=int, default=None,
         help="draft over the N token ids most frequent in the run's committed tokens (its prompts, then every "
              "rollout's), re-ranked each RL step; q is zero outside them and rejection sampling stays exact. "
              "Default: the whole vocabulary")


def check_draft_vocab(flat: dict) -> list[str]:
    """Every problem with --growmtp_draft_vocab in this configuration."""
    size = flat.get("growmtp.draft_vocab")
    if size is None:
        return []
    get = flat.get
    errors, vocab_size = [], model_vocab_size(get("actor.model_name_or_path"))
    if size < 1 or (vocab_size is not None and size > vocab_size):
        errors.append(f"--growmtp_draft_vocab must be between 1 and the vocabulary's {vocab_size or 'size'}, "
                      f"got {size}")
    if (get("growmtp.k") or 0) < 1:
        errors.append("--growmtp_draft_vocab is what the head drafts over: it needs --growmtp_k >= 1")
    if get("growmtp.loss", "dca") not in CHAIN_OBJECTIVES:
        errors.append(f"--growmtp_draft_vocab leaves q zero outside it, where log q (CE, KL, the hybrid's CE) is "
                      f"infinite: use --growmtp_loss dca or tv (got {get('growmtp.loss')})")
    if get("train.async_enable"):
        errors.append("--growmtp_draft_vocab is re-ranked between rollouts and checked against every record: it "
                      "needs the synchronous controller (not --train.async_enable)")
    if (get("vllm.tensor_parallel_size") or 1) > 1:
        errors.append("--growmtp_draft_vocab gathers its lm_head rows on one rank: it needs "
                      "--vllm.tensor_parallel_size 1")
    return errors


def model_vocab_size(model: str | None) -> int | None:
    """The model's vocabulary size, None where its config cannot be read (`check_args` reports that)."""
    try:
        return None if not model else int(resolve_backbone(local_dir(model))[1].vocab_size)
    except (HeadCheckpointError, ModelLocationError, KeyError, ValueError, OSError):
        return None
