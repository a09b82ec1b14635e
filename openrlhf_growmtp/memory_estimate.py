"""What one training GPU of a run holds, by arithmetic (derived, not measured): the terms of docs/guide.md's
envelope (`benchmarks/envelope.py` tabulates them for the example recipes) and the dry run's warning
(GROWMTP_DRY_RUN=1) when a run's estimate exceeds its card.

Per training GPU (ranks: actor nodes x GPUs per node):
- the policy: bf16 weights and gradients and fp32 Adam state (master, m, v), 16 bytes a parameter; ZeRO-3 splits
  all of it over the ranks, ZeRO-2 keeps the weights whole; `--ds.adam_offload` moves Adam's 12 bytes to the host;
- the reference (a KL term, colocated with the policy): bf16 weights, 2 bytes a parameter, split under ZeRO-3;
- a training head: its parameters like the policy's, and its update's peak at chunks of 4,096 cycles, measured on
  an H100 at Qwen3-4B's shapes (`HEAD_UPDATE_PEAK_MIB`), plus its family's CPU line above Qwen3-4B's
  (`HEAD_PEAK_ABOVE_QWEN3_MIB`; docs/guide.md, "The head update's peak per chunk"), scaled with larger chunks;
- one micro-batch's logits over the vocabulary at the longest sequence (`--data.max_len`: prompt and response):
  in the experience forward of the reference and the policy (`--rollout.micro_batch_size`) bf16 and upstream's
  fp32 copy, 6 bytes each, at the cast; in training (`--train.micro_batch_size`) 8 bytes each, the fp32 copy
  that the cross-entropy keeps for its backward and the fp32 gradient that backward writes beside it (flash-attn's
  `cross_entropy_loss`, not in place; the bf16 logits are freed after the cast, which keeps nothing of them);
- with gradient checkpointing, every layer's saved input for the training micro-batch, 2 bytes x hidden a token
  (left out where the layer count is not known).
Training holds the weights, the head's update and the training micro-batch's logits and saved inputs; the
experience forward the weights and its micro-batch's logits. The estimate is the larger. It fits a card when it
stays below the card less a tenth (`MARGIN`), kept for what the arithmetic leaves out: the CUDA context,
allocator fragmentation, NCCL and ZeRO-3 gather buffers, a checkpointed layer's recomputed activations. The tenth
is a choice, not a measurement; the smoke run at full length measures (docs/guide.md, step 4).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

GIB, MIB = 2**30, 2**20
POLICY_BYTES, REFERENCE_BYTES, ADAM_BYTES = 16, 2, 12  # a parameter: weights + grads + Adam; bf16 weights; Adam
# a logit: in the experience forward bf16 and its fp32 copy; in training's backward the fp32 copy and its fp32
# gradient (module docstring); a bf16 hidden state
EXPERIENCE_LOGIT_BYTES, TRAINING_LOGIT_BYTES, HIDDEN_BYTES = 2 + 4, 4 + 4, 2
# docs/data/gpu/head_checks_chunk4096_2026-11-27.json head_update_cost.peak_mb.head (tests/test_memory_estimate.py)
HEAD_UPDATE_PEAK_MIB, HEAD_PEAK_CHUNK = 4443.728515625, 4096
HEAD_PEAK_ABOVE_QWEN3_MIB = {"qwen3": 0.0, "qwen3_5": 230.0, "mimo": 820.0}  # CPU lines at 4,096 (docs/guide.md)
MARGIN = 0.1  # of the card, for what the arithmetic leaves out (module docstring)
CARD_ENV, DEFAULT_CARD_GIB = "GROWMTP_CARD_GIB", 80.0  # the dry run sees no GPU: the card it reads against


@dataclass(frozen=True)
class ModelShape:
    params: float  # the policy's parameters
    vocab: int
    hidden: int
    layers: int | None  # None: not known (the checkpointed layers' inputs are left out)
    head_params: float  # a head of the model's family
    family: str  # core.families name


@dataclass(frozen=True)
class TrainingLayout:
    ranks: int  # training GPUs
    zero_stage: int
    adam_offload: bool
    reference: bool  # a reference model colocated with the policy
    trains_head: bool
    chunk_cycles: int
    tokens: int  # the longest sequence: prompt + response
    micro_batch: int  # --train.micro_batch_size
    rollout_micro_batch: int  # --rollout.micro_batch_size
    checkpointing: bool


def training_gpu(shape: ModelShape, layout: TrainingLayout) -> dict[str, float]:
    """Every term of the module docstring in GiB, `training_gib`, `experience_gib` and `estimate_gib` (the larger)."""
    ranks = layout.ranks
    sharded = layout.zero_stage >= 3
    per_param = (POLICY_BYTES - ADAM_BYTES if layout.adam_offload else POLICY_BYTES)
    whole = 0 if sharded else 2  # ZeRO-2: the bf16 weights on every rank
    terms = {"policy_gib": shape.params * (whole + (per_param - whole) / ranks) / GIB,
             "reference_gib": (shape.params * REFERENCE_BYTES / (ranks if sharded else 1) / GIB
                               if layout.reference else 0.0),
             "head_gib": (shape.head_params * (whole + (per_param - whole) / ranks) / GIB if layout.trains_head
                          else 0.0),
             "head_update_peak_gib": ((HEAD_UPDATE_PEAK_MIB + HEAD_PEAK_ABOVE_QWEN3_MIB.get(shape.family, 0.0))
                                      * max(1.0, layout.chunk_cycles / HEAD_PEAK_CHUNK) * MIB / GIB
                                      if layout.trains_head else 0.0),
             "micro_batch_logits_gib": (layout.micro_batch * layout.tokens * shape.vocab * TRAINING_LOGIT_BYTES
                                        / GIB),
             "rollout_micro_batch_logits_gib": (layout.rollout_micro_batch * layout.tokens * shape.vocab
                                                * EXPERIENCE_LOGIT_BYTES / GIB),
             "checkpointed_inputs_gib": (shape.layers * layout.micro_batch * layout.tokens * shape.hidden
                                         * HIDDEN_BYTES / GIB if layout.checkpointing and shape.layers else 0.0)}
    weights = terms["policy_gib"] + terms["reference_gib"] + terms["head_gib"]
    terms["training_gib"] = (weights + terms["head_update_peak_gib"] + terms["micro_batch_logits_gib"]
                             + terms["checkpointed_inputs_gib"])
    terms["experience_gib"] = weights + terms["rollout_micro_batch_logits_gib"]
    terms["estimate_gib"] = max(terms["training_gib"], terms["experience_gib"])
    return terms


def usable_gib(card_gib: float) -> float:
    return card_gib * (1 - MARGIN)


def card_gib() -> float:
    """The card the dry run reads against: $GROWMTP_CARD_GIB, else 80 GiB (an H100 or A100 80GB)."""
    raw = os.environ.get(CARD_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_CARD_GIB
    except ValueError:
        raise ValueError(f"${CARD_ENV}={raw!r}: not a number of GiB") from None
    if not value > 0:
        raise ValueError(f"${CARD_ENV}={raw!r}: must be a positive number of GiB")
    return value


def model_shape(model_dir: str | Path) -> ModelShape:
    """A model directory's shape from its config.json alone: the backbone and its head built on the meta device
    (no memory, no weights read) and their parameters counted."""
    import torch
    from transformers import AutoModelForCausalLM

    from openrlhf_growmtp.core.checkpoint import head_config_for, resolve_backbone
    from openrlhf_growmtp.core.head import MTPHead

    family, text, _ = resolve_backbone(model_dir)
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(text).parameters())
        head_params = sum(p.numel() for p in MTPHead(head_config_for(text)).parameters())
    return ModelShape(params=params, vocab=text.vocab_size, hidden=text.hidden_size, layers=text.num_hidden_layers,
                      head_params=head_params, family=family.name)


def run_layout(args) -> TrainingLayout:
    """The training layout of upstream's parsed (nested) arguments."""
    return TrainingLayout(
        ranks=args.actor.num_nodes * args.actor.num_gpus_per_node, zero_stage=args.ds.zero_stage,
        adam_offload=bool(args.ds.adam_offload),
        reference=bool(args.algo.kl.init_coef > 0 and (args.train.colocate_actor_ref or args.train.colocate_all)),
        trains_head=args.growmtp.k > 0 and args.growmtp.mode != "frozen",
        chunk_cycles=args.growmtp.chunk_cycles or HEAD_PEAK_CHUNK,  # unset: a GPU's default, 4,096
        tokens=args.data.max_len, micro_batch=args.train.micro_batch_size,
        rollout_micro_batch=args.rollout.micro_batch_size, checkpointing=bool(args.actor.gradient_checkpointing_enable))


def describe(terms: dict[str, float], card: float, from_env: bool) -> list[str]:
    """The dry run's lines: the estimate against the card, and a warning where it does not fit."""
    where = f"${CARD_ENV}" if from_env else f"the default; ${CARD_ENV} sets it: the dry run sees no GPU"
    lines = [f"  memory per training GPU, by arithmetic (docs/guide.md, the envelope): {terms['estimate_gib']:.1f} GiB "
             f"(training {terms['training_gib']:.1f}: micro-batch logits {terms['micro_batch_logits_gib']:.1f}; "
             f"experience {terms['experience_gib']:.1f}: rollout micro-batch logits "
             f"{terms['rollout_micro_batch_logits_gib']:.1f}) of a {card:g} GiB card ({where})"]
    if terms["estimate_gib"] > usable_gib(card):
        lines.append(f"WARNING: GrowMTP: this run's estimate, {terms['estimate_gib']:.1f} GiB per training GPU, "
                     "exceeds "
                     f"the {usable_gib(card):.0f} GiB it allows of a {card:g} GiB card ({MARGIN:.0%} kept for what it "
                     "leaves out): lower --train.micro_batch_size or --rollout.micro_batch_size (the logits grow with "
                     "them), or --rollout.max_new_tokens; GROWMTP_SMOKE=1 at SMOKE_TOKENS of the full length measures")
    return lines
