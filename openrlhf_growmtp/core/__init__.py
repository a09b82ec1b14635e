"""The GrowMTP core: pure torch (+ transformers decoder layers). Imports neither openrlhf nor vllm."""

from .checkpoint import export_head, init_random_head_, load_head, load_native_head, materialize_random_head
from .families import FAMILIES, HeadFamily, family_for_backbone, get_family
from .head import HeadOutput, MTPHead
from .head_cache import HeadKVCache
from .head_config import make_head_config
from .head_loss import HeadLossConfig, HeadLossStats, head_loss_backward, measure_head_loss
from .lockstep import ONE_RANK, Lockstep
from .metrics import AcceptanceSummary, acceptance_summary
from .objectives import acceptance_rates, chain_loss, log_acceptance_rates, position_loss
from .reconstruction import reconstruct_draft_logits
from .records import RecordError, SequenceRecord
from .schedule import HeadLRSchedule
from .teacher_forcing import teacher_forced_chains
from .validation import validate_record, validate_records

__all__ = [
    "AcceptanceSummary", "FAMILIES", "HeadFamily", "HeadKVCache", "HeadLRSchedule", "HeadLossConfig",
    "HeadLossStats", "HeadOutput", "Lockstep", "MTPHead", "ONE_RANK", "RecordError", "SequenceRecord",
    "acceptance_rates", "acceptance_summary", "chain_loss", "export_head", "family_for_backbone", "get_family",
    "head_loss_backward", "init_random_head_", "load_head", "load_native_head", "log_acceptance_rates",
    "make_head_config", "materialize_random_head", "measure_head_loss", "position_loss", "reconstruct_draft_logits",
    "teacher_forced_chains", "validate_record", "validate_records",
]
