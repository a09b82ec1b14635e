"""Committed chains: how draft positions that a rollout did not draft still learn (`--growmtp_depth auto`).

A rollout drafted at depth d < K records draft positions 1..d of each cycle; positions d+1..K were never
drafted, so the draft paths hold nothing for them. They learn along the sequence the policy committed, in the
cycles that accepted all d drafts, the ones a deeper draft would have reached:

- the *committed chain* of such a cycle r (start s) is the head's chain fed the committed tokens: draft
  position k feeds x_{s+k} (k >= 2) at position s+k-1 and predicts the token at s+1+k. Up to position d it is
  the recorded draft path (its accepted drafts are the committed tokens); past d it is the path a deeper draft
  has where every earlier draft is accepted, reconstructed like any draft path (`reconstruction.py`). A
  cycle that rejected one of its d drafts never reached position d+1 and trains nothing past d, as VGM
  stops a drafted chain at its first rejection: position k learns in the contexts drafting reaches it in;
- its target at position k is the policy's distribution there, p(. | x_{<=s+k}) = softmax(lm_head(H_{s+k}) / T):
  the hidden states the head already reads, through the policy's own lm_head (the distribution the
  verifier samples from; no [T, V] logits kept from the policy's forward), stored as a recorded target is
  (top-k ids and their full-vocabulary log-probs);
- it runs over positions 1..L, L = min(K, s_last - s) with s_last the record's last start (H_p is known
  there in the engine's hidden states and the trainer's alike), and its objective, the run's own, reads
  positions d+1..L only, without VGM (nothing was verified there): for DCA, -log sum_{d<l<=L} prod_{d<i<=l}
  alpha_i, the conditional chain given the first d drafts accepted;
- a chain's loss adds to its cycle's; the batch loss stays the mean over the drafted cycles. The hidden
  states enter detached: its gradient reaches the head's parameters only (the launcher refuses it in joint mode).

`committed_chains` builds them as records of depth K (drafts: the committed tokens; accepted: L - 1, so that a
chain's length is L) that `head_loss` reconstructs and scores from position d on.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from .lockstep import Lockstep
from .prefix import hidden_of
from .records import SequenceRecord
from .topk_logq import SOFTMAX_BLOCK, score_groups


def chain_lengths_from(rec: SequenceRecord, max_depth: int) -> torch.Tensor:
    """L per cycle [R]: min(K, s_last - s), the positions whose target H_{s+k} lies at or before the last start."""
    if not rec.num_cycles:
        return torch.zeros(0, dtype=torch.long)
    return (rec.start[-1] - rec.start).clamp(max=max_depth).long()


def committed_chains(head, records: Sequence[SequenceRecord], hiddens: Sequence[torch.Tensor] | None, depth: int,
                     max_depth: int, lockstep: Lockstep) -> tuple[list[SequenceRecord], list[torch.Tensor]]:
    """The committed chains of the cycles drafted at `depth` (< `max_depth` = K) that accepted every draft and
    reach past it, as records of depth K with their H_p (detached), one per record that has any; ranks make
    the same lm_head calls.

    hiddens: H_p [T, H] per record (None: each record's own). The targets are computed here, in as many
    lm_head calls as the busiest rank needs (`topk_logq.score_groups`), none where no rank has a chain.
    """
    assert 0 < depth < max_depth, (depth, max_depth)
    param = next(head.parameters())
    width = int(records[0].topk_ids.shape[2]) if records else 1
    chosen, rows, row_temperature = [], [], []
    for i, rec in enumerate(records):
        lengths = chain_lengths_from(rec, max_depth)
        keep = ((lengths > depth) & (rec.accepted == depth)).nonzero().flatten()  # reached position depth+1
        if not keep.numel():
            continue
        hidden = hidden_of(records, hiddens, i).detach()
        scored = _scored_positions(lengths[keep], depth, max_depth)  # [R', K]
        rows.append(hidden[(rec.start[keep, None] + torch.arange(1, max_depth + 1))[scored].to(hidden.device)])
        row_temperature.append(torch.full((int(scored.sum()),), float(rec.temperature)))
        chosen.append((i, keep, lengths[keep], scored, hidden))
    local = sum(int(r.shape[0]) for r in rows)
    most, groups = lockstep.most([local, score_groups(local, head.config.vocab_size, param.device.type)])
    if not most:
        return [], []
    hidden_rows = torch.cat(rows) if rows else param.new_zeros(0, head.config.hidden_size)
    temperature = torch.cat(row_temperature) if row_temperature else torch.zeros(0)
    ids, logp = policy_topk(head, hidden_rows.to(device=param.device, dtype=param.dtype), temperature, width, groups)
    out_records, out_hiddens, offset = [], [], 0
    for i, keep, lengths, scored, hidden in chosen:
        rec, count = records[i], int(scored.sum())
        out_records.append(_chain_record(rec, keep, lengths, scored, ids[offset:offset + count],
                                         logp[offset:offset + count], max_depth))
        out_hiddens.append(hidden)
        offset += count
    return out_records, out_hiddens


def _scored_positions(lengths: torch.Tensor, depth: int, max_depth: int) -> torch.Tensor:
    """[R', K] bool: draft positions depth+1..L of each chain, the ones its objective reads."""
    position = torch.arange(1, max_depth + 1)[None, :]
    return (position > depth) & (position <= lengths[:, None])


def _chain_record(rec: SequenceRecord, keep: torch.Tensor, lengths: torch.Tensor, scored: torch.Tensor,
                  ids: torch.Tensor, logp: torch.Tensor, max_depth: int) -> SequenceRecord:
    """A record of depth K holding the committed chains of cycles `keep`: drafts x_{s+2..s+K+1} (clipped at the
    sequence's end, past every chain's length), targets at the scored positions (uniform elsewhere, read by
    nothing), accepted L - 1."""
    start = rec.start[keep]
    last = int(rec.token_ids.shape[0]) - 1
    drafts = rec.token_ids[(start[:, None] + 2 + torch.arange(max_depth)[None, :]).clamp(max=last)]
    topk_ids = torch.arange(ids.shape[-1]).expand(*scored.shape, -1).clone()
    topk_logprobs = torch.full(topk_ids.shape, -math.log(ids.shape[-1]))
    topk_ids[scored], topk_logprobs[scored] = ids.cpu(), logp.cpu()
    return SequenceRecord(token_ids=rec.token_ids, prompt_len=rec.prompt_len, start=start, drafts=drafts,
                          topk_ids=topk_ids, topk_logprobs=topk_logprobs, accepted=lengths - 1,
                          temperature=rec.temperature)


@torch.no_grad()
def policy_topk(head, hidden: torch.Tensor, temperature: torch.Tensor, width: int,
                groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy's top-`width` ids [M, width] and their log-probs [M, width] (fp32, normalised over the full
    vocabulary) at final-norm hidden states `hidden` [M, H], temperature [M] applied: softmax(lm_head(H) / T).

    In `groups` lm_head calls of about equal rows (an empty group runs one row of zeros, for lockstep), each
    reduced in fp32 blocks of rows (`topk_logq.SOFTMAX_BLOCK`)."""
    assert hidden.ndim == 2 and temperature.shape == hidden.shape[:1], (hidden.shape, temperature.shape)
    vocab = head.config.vocab_size
    rows = max(1, SOFTMAX_BLOCK.get(hidden.device.type, SOFTMAX_BLOCK["cpu"]) // vocab)
    bounds = [hidden.shape[0] * g // groups for g in range(groups + 1)]
    ids, logp = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        # the policy's p: over every id, whatever the head drafts over
        logits = head.policy_logits(hidden[lo:hi] if hi > lo else hidden.new_zeros(1, hidden.shape[1]))
        for b in range(lo, hi, rows):
            block = logits[b - lo:min(hi, b + rows) - lo].float() / temperature[b:min(hi, b + rows), None].to(
                logits.device)
            top = block.topk(width, dim=-1)
            ids.append(top.indices)
            logp.append(top.values - torch.logsumexp(block, dim=-1, keepdim=True))
    if not ids:
        empty = torch.zeros(0, width)
        return empty.long(), empty
    return torch.cat(ids), torch.cat(logp)
