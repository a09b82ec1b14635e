"""`--growmtp_draft_vocab N` in the controller: rank the run's committed tokens, and hand each ranking to the
engines (which draft over it) and to the policy actors (whose head loss reads the same q).

Before the first rollout the ranking counts the prompt set's tokens; after every RL step it adds that step's
committed tokens (prompts and responses) and ranks again, after the step's weight sync: an engine gathers the
vocabulary's lm_head rows when it is set, so they are the synced policy's. The next rollout drafts over the
new vocabulary; before the step that trains on it, the policy actors receive that same vocabulary
(`GrowMTPActorTrainer` checks each record's tag against it). `growmtp/draft_vocab_coverage` is the share of a rollout's
response tokens inside the vocabulary that drafted them.
"""

from __future__ import annotations

import ray
import torch

from ..core.draft_vocab import DraftVocab, TokenCounts
from .args.draft_vocab import model_vocab_size


class DraftVocabRanking:
    """The run's token counts and its current draft vocabulary: the engines get each ranking when it is made,
    the policy actors the one that drafted a rollout when they train on it."""

    def __init__(self, args, prompts: list[str], tokenizer, vllm_engines, actor_group):
        vocab_size = model_vocab_size(args.actor.model_name_or_path)
        if vocab_size is None:
            raise ValueError(f"--growmtp_draft_vocab: cannot read the vocabulary size of "
                             f"{args.actor.model_name_or_path}")
        self.size, self.engines, self.actors = int(args.growmtp.draft_vocab), vllm_engines, actor_group
        self.counts = TokenCounts(vocab_size)
        for prompt in prompts:
            self.counts.add(torch.tensor(tokenizer(prompt, add_special_tokens=False)["input_ids"], dtype=torch.long))
        self.vocab = self.counts.top(self.size)
        self._sync([engine.growmtp_set_draft_vocab for engine in self.engines])

    def _sync(self, methods) -> None:
        ray.get([method.remote(self.vocab.ids.tolist(), self.vocab.tag) for method in methods])

    def before_step(self, samples) -> dict[str, float]:
        """The rollout's vocabulary to the policy actors (their head's q for this step's update), and its
        coverage: the share of the rollout's response tokens inside it."""
        ids, tag = self.vocab.ids.tolist(), self.vocab.tag
        ray.get(self.actors.async_run_method(method_name="growmtp_set_draft_vocab", ids=ids, tag=tag))
        responses = torch.cat([s.sequences[:, 1:][s.action_mask.bool()] for s in samples])
        return {"growmtp/draft_vocab_coverage": self.vocab.coverage(responses),
                "growmtp/draft_vocab_size": float(self.vocab.size)}

    def after_step(self, samples) -> None:
        """Count the step's committed tokens, rank again and set it on the engines (after the step's weight
        sync: they gather the synced policy's lm_head rows)."""
        for s in samples:
            self.counts.add(s.sequences[s.attention_mask.bool()])
        self.vocab = self.counts.top(self.size)
        self._sync([engine.growmtp_set_draft_vocab for engine in self.engines])


def actor_draft_vocab(ids: list[int], tag: str, vocab_size: int) -> DraftVocab:
    """The vocabulary a policy actor received, checked against the tag the controller computed."""
    vocab = DraftVocab(torch.tensor(ids, dtype=torch.long), vocab_size)
    if vocab.tag != tag:
        raise ValueError(f"draft vocabulary {tag} arrived as {vocab.tag}")
    return vocab
