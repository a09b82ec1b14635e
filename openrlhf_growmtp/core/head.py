"""The EAGLE-style single-layer recurrent MTP draft head.

    x   = fc(cat[norm_e(embed(token)), norm_h(hidden)])      (bias-free 2H -> H)
    o   = decoder_layer(x)                                     (one layer of the backbone's family)
    q   = softmax(lm_head(norm(o)) / T)                        (the backbone's lm_head)
    h'  = o or norm(o), per family                             (the state fed to the next draft position)

The embedding and the lm_head are the backbone's modules, passed in and never copied or registered:
the head's state dict holds only its own parameters, under the native checkpoint names.

Alignment with drafting (measured against vLLM): the head's KV cache holds one entry per
committed position p, written from (H_p, x_{p+1}) at RoPE position p, where H_p is the target's
final-norm hidden state. A cycle starting at s drafts d_1 from the output at s, then feeds
(h'_{j-1}, d_{j-1}) at position s+j-1 for j = 2..K.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from .draft_attention import ATTENTION_NAME
from .draft_vocab import DraftRows, DraftVocab, masked_logits, no_gather
from .families import FEED_PRE_NORM, get_family
from .head_cache import HeadKVCache, prefix_extension_mask
from .head_config import HEAD_CONFIG_FIELD
from .rms_norm import family_norm, replace_norms


@dataclass
class HeadOutput:
    hidden: torch.Tensor  # [B, T, H] decoder-layer output o (pre-norm)
    normed: torch.Tensor  # [B, T, H] norm(o), what the lm_head reads
    feed_back: torch.Tensor  # [B, T, H] the state the next draft position consumes

    def last(self) -> "HeadOutput":
        """The last slot only ([B, 1, H] each): the output a cycle's chain starts from."""
        return HeadOutput(self.hidden[:, -1:], self.normed[:, -1:], self.feed_back[:, -1:])


class FP32RoPE(nn.Module):
    """The family's rotary embedding, kept out of the head's registered modules so that casting the head
    (`load_head(dtype=...)`, DeepSpeed's bf16 engine) never rounds its inverse frequencies: a RoPE angle is
    position x inv_freq, and vLLM computes it in fp32 from the base. It follows the inputs' device."""

    def __init__(self, rotary: nn.Module):
        super().__init__()
        self.__dict__["rotary"] = rotary

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        rotary = self.__dict__["rotary"]
        if rotary.inv_freq.device != x.device:
            rotary.to(x.device)  # a device move keeps the buffers' fp32
        return rotary(x, position_ids)


class MTPHead(nn.Module):
    """One implementation for all families; see `families.FAMILIES` for what differs."""

    def __init__(self, config: PretrainedConfig, embed_tokens: nn.Module | None = None,
                 lm_head: nn.Module | None = None):
        super().__init__()
        self.family = get_family(getattr(config, HEAD_CONFIG_FIELD))
        config = copy.deepcopy(config)
        # SDPA unless a call passes draft_path= (draft_attention.py). NOTE: prefill relies on SDPA's
        # is_causal; later draft positions pass an explicit additive mask.
        config._attn_implementation = ATTENTION_NAME
        self.config = config
        fam, hidden, eps = self.family, config.hidden_size, config.rms_norm_eps
        self.add_module(fam.norm_embedding_name, family_norm(fam, hidden, eps))
        self.add_module(fam.norm_hidden_name, family_norm(fam, hidden, eps))
        self.add_module(fam.fc_name, nn.Linear(2 * hidden, hidden, bias=False))
        layer = fam.layer_class(config, 0)
        replace_norms(layer, fam)  # the same norms, fewer launches (rms_norm.py)
        if fam.layer_prefix:
            container, index = fam.layer_prefix.split(".")
            self.add_module(container, nn.ModuleList([layer]))
        else:
            # MiMo keeps the block's parameters at the top level of the head: register its children here
            # and keep the layer itself unregistered (its forward uses these very child modules).
            for child_name, child in layer.named_children():
                self.add_module(child_name, child)
        self.__dict__["decoder_layer"] = layer
        self.add_module(fam.final_norm_name, family_norm(fam, hidden, eps))
        self.rotary_emb = FP32RoPE(fam.rotary_class(config))
        self.bind(embed_tokens, lm_head)
        # drafting over these ids only (q zero elsewhere; core/draft_vocab.py), None: every id; not a weight
        self.draft_vocab: DraftVocab | None = None
        # their lm_head rows, during a head update only (`sliced_draft_rows`): what its scoring reads
        self.draft_rows: DraftRows | None = None

    # ---- the backbone's modules -------------------------------------------------------------
    def bind(self, embed_tokens: nn.Module | None, lm_head: nn.Module | None) -> None:
        """Point the head at the backbone's embedding and lm_head (kept unregistered: never copied)."""
        self.__dict__["embed_tokens"] = embed_tokens
        self.__dict__["lm_head"] = lm_head

    def _shared(self, name: str) -> nn.Module:
        module = self.__dict__.get(name)
        if module is None:
            raise RuntimeError(f"MTPHead has no {name}: call head.bind(embed_tokens, lm_head) with the backbone's")
        return module

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # The embedding lookup is an input of the head, never trained by the head loss.
        with torch.no_grad():
            return self._shared("embed_tokens")(input_ids)

    def logits(self, normed: torch.Tensor, train_lm_head: bool = False) -> torch.Tensor:
        """lm_head(norm(o)) [..., V], -inf outside the draft vocabulary; unless `train_lm_head`, no gradient
        reaches the backbone's lm_head."""
        return masked_logits(self.policy_logits(normed, train_lm_head), self.draft_vocab)

    def policy_logits(self, hidden: torch.Tensor, train_lm_head: bool = False) -> torch.Tensor:
        """The backbone's lm_head over every id, whatever the draft vocabulary: the policy's logits where
        `hidden` is its final-norm H_p."""
        lm_head = self._shared("lm_head")
        context = contextlib.nullcontext() if train_lm_head else _frozen(lm_head)
        with context:
            return lm_head(hidden)

    @property
    def scored_vocab_size(self) -> int:
        """How many ids a head update's logits span: the draft vocabulary's, else the whole vocabulary."""
        return self.config.vocab_size if self.draft_vocab is None else self.draft_vocab.size

    @contextlib.contextmanager
    def sliced_draft_rows(self, gathered=no_gather):
        """Inside: `draft_rows` holds the draft vocabulary's lm_head rows as they are now (nothing without a
        draft vocabulary). Enter it once per head update: the policy's step changes the lm_head between
        updates. `gathered` (`Lockstep.gathered`) makes a partitioned lm_head whole to slice it."""
        if self.draft_vocab is None:
            yield
            return
        outer, self.draft_rows = self.draft_rows, DraftRows.slice(self._shared("lm_head"), self.draft_vocab, gathered)
        try:
            yield
        finally:
            self.draft_rows = outer  # an enclosing context's rows again (None outside any)

    # ---- the head's computation -------------------------------------------------------------
    def fuse(self, hidden: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """fc(cat[norm_e(embed(token)), norm_h(hidden)]) -> [B, T, H]."""
        fam = self.family
        emb = self.embed(input_ids).to(hidden.dtype)
        if fam.zero_embed_at_position_0:
            emb = emb * (position_ids != 0).unsqueeze(-1).to(emb.dtype)
        emb = getattr(self, fam.norm_embedding_name)(emb)
        hid = getattr(self, fam.norm_hidden_name)(hidden)
        return getattr(self, fam.fc_name)(torch.cat([emb, hid], dim=-1))

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                cache: HeadKVCache | None = None, attention_mask: torch.Tensor | None = None,
                draft_path=None) -> HeadOutput:
        """One head application to T new slots per row.

        hidden [B, T, H] (target final-norm hidden, or the fed-back head state), input_ids [B, T],
        position_ids [B, T] absolute RoPE positions. New keys/values are appended to `cache`.
        attention_mask: additive [B, 1, T, L_cache + T]; None means causal over the new slots with
        everything already in the cache visible (SDPA is_causal, valid when the cache is empty or T == 1).
        draft_path: the attention to run instead of SDPA (`draft_attention.DraftPathAttention`).
        """
        assert hidden.ndim == 3 and input_ids.shape == hidden.shape[:2] == position_ids.shape, (
            hidden.shape, input_ids.shape, position_ids.shape)
        if draft_path is None and attention_mask is None and cache is not None and len(cache) > 0 \
                and hidden.shape[1] > 1:
            raise ValueError("several new slots over a non-empty cache need an explicit attention_mask")
        x = self.fuse(hidden, input_ids, position_ids)
        position_embeddings = self.rotary_emb(x, position_ids)
        o = self.decoder_layer(hidden_states=x, attention_mask=attention_mask, position_ids=position_ids,
                               past_key_values=cache, position_embeddings=position_embeddings,
                               draft_path=draft_path)
        normed = getattr(self, self.family.final_norm_name)(o)
        feed_back = o if self.family.feed_back == FEED_PRE_NORM else normed
        return HeadOutput(hidden=o, normed=normed, feed_back=feed_back)

    def keys_values(self, hidden: torch.Tensor, input_ids: torch.Tensor,
                    position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values [B, kv, T, d] that `forward` writes to the cache for these slots: the input
        norm and the layer's key and value path only (its k/v projections, key norm where the family has
        one, RoPE), without queries, attention or MLP. Equal to what `forward` caches: the batched
        reconstruction that reads them is tested against chain-by-chain drafting for every family."""
        x = self.fuse(hidden, input_ids, position_ids)
        attn = self.decoder_layer.self_attn
        normed = self.decoder_layer.input_layernorm(x)
        shape = (*normed.shape[:-1], -1, attn.head_dim)
        key = attn.k_proj(normed).view(shape)
        if getattr(attn, "k_norm", None) is not None:
            key = attn.k_norm(key)
        value = attn.v_proj(normed).view(shape).transpose(1, 2)
        cos, sin = self.rotary_emb(x, position_ids)
        key = key.transpose(1, 2)
        _, key = self.family.apply_rotary(key, key, cos, sin)  # (queries, keys): the keys' half is used
        return key, value

    # ---- recurrent drafting (the chain-by-chain reference, and the demo's drafter) --------------
    def prefill(self, target_hidden: torch.Tensor, next_token_ids: torch.Tensor, start_position: int,
                cache: HeadKVCache) -> HeadOutput:
        """Write cache entries for committed positions start_position.. from (H_p, x_{p+1}).

        target_hidden [B, T, H] = H_p, next_token_ids [B, T] = x_{p+1}. Slots attend causally to each
        other and to every entry already in the cache.
        """
        batch, length = next_token_ids.shape
        positions = torch.arange(start_position, start_position + length, device=next_token_ids.device)
        positions = positions.expand(batch, length)
        mask = None
        if len(cache) > 0 and length > 1:
            mask = prefix_extension_mask(len(cache), length, target_hidden.dtype, target_hidden.device)
        return self.forward(target_hidden, next_token_ids, positions, cache=cache, attention_mask=mask)

    def next_position(self, feed_back: torch.Tensor, token_ids: torch.Tensor, position: int | torch.Tensor,
             cache: HeadKVCache) -> HeadOutput:
        """The chain's next draft position: feed_back [B, H], token_ids [B] at `position`; attends to the whole
        cache."""
        positions = torch.as_tensor(position, device=token_ids.device).reshape(-1, 1).expand(token_ids.shape[0], 1)
        return self.forward(feed_back.unsqueeze(1), token_ids.unsqueeze(1), positions, cache=cache)

    def draft_chain(self, first: HeadOutput, start: int, draft_ids: torch.Tensor | None, num_steps: int,
                    cache: HeadKVCache, temperature: float = 1.0,
                    generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run a cycle's chain from the output at `start` (first: HeadOutput of that one slot, [B, 1, H]).

        With `draft_ids` [B, num_steps] the chain is fed those tokens (reconstruction); without, each
        draft is sampled from q (drafting). Returns (drafts [B, num_steps], logits [B, num_steps, V]),
        logits already divided by the temperature. Chain entries are appended to `cache`; crop them
        before the next cycle.
        """
        out, drafts, logits = first, [], []
        for j in range(num_steps):
            step_logits = self.logits(out.normed[:, -1]).float() / temperature
            logits.append(step_logits)
            if draft_ids is not None:
                token = draft_ids[:, j]
            else:
                token = torch.multinomial(torch.softmax(step_logits, dim=-1), 1, generator=generator).squeeze(-1)
            drafts.append(token)
            if j + 1 < num_steps:
                out = self.next_position(out.feed_back[:, -1], token, start + j + 1, cache)
        return torch.stack(drafts, dim=1), torch.stack(logits, dim=1)


@contextlib.contextmanager
def _frozen(module: nn.Module):
    """Run `module` without recording gradients for its parameters (but still for its inputs).

    Autograd decides at op time, so parameters frozen during the forward get no gradient edge.
    """
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)
