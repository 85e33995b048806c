"""Decoder-only language model: embeddings -> causal blocks -> final norm -> lm_head."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..configs import ModelConfig, cache_widths
from ..nn.kv_cache import KVCache
from .checks import check_documents, check_ids, check_mask, check_positions
from .stack import Embeddings, Stack, positions_from


class DecoderLM(nn.Module):
    # Tensor parallelism (parallel/apply.py) splits the K/V heads over this many ranks; each rank's
    # static cache holds its own n_kv_heads / kv_shards heads.
    kv_shards: int = 1

    def __init__(self, config: ModelConfig, embed: Embeddings, stack: Stack, lm_head: nn.Linear) -> None:
        super().__init__()
        self.config = config
        self.embed, self.stack, self.lm_head = embed, stack, lm_head

    def forward(
        self,
        input_ids: Tensor,
        *,
        positions: Tensor | None = None,
        attention_mask: Tensor | None = None,
        cache: KVCache | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """input_ids (B, T) -> logits (B, T, V).

        attention_mask (B, T): 1 for real tokens, 0 for padding (left padding for generation).
        With ``cache`` (from ``new_cache``), ``positions`` (T,) or (B, T) are the positions of
        these tokens; their keys and values are stored there for later steps.
        document_ids (B, T): packed rows; attention stays inside each run of equal ids and
        positions restart at each run (training; not with a cache).
        """
        check_ids(input_ids, "input_ids", self.config.vocab_size, self.config.max_seq_len)
        check_mask(attention_mask, "attention_mask", input_ids, "input_ids")
        check_positions(positions, input_ids, cache, self.config.max_seq_len)
        check_documents(document_ids, input_ids, cache)
        pos = positions_from(input_ids, positions, attention_mask, document_ids)
        hidden = self.hidden(input_ids, pos, attention_mask, cache, document_ids, aligned=positions is None)
        return self.lm_head(hidden)  # (B, T, V)

    def logits(self, ids: Tensor, pos: Tensor, attention_mask: Tensor | None, cache: KVCache | None) -> Tensor:
        """The unchecked forward (generation loops and compiled steps call this)."""
        return self.lm_head(self.hidden(ids, pos, attention_mask, cache))  # (B, T, V)

    def hidden(
        self, ids: Tensor, pos: Tensor, attention_mask: Tensor | None, cache: KVCache | None, document_ids=None,
        aligned: bool = False,
    ) -> Tensor:
        """Unchecked final hidden states (B, T, D); a prefill applies lm_head to the last one only.
        aligned: pos are the default column positions (Stack.context)."""
        ctx = self.stack.context(pos, attention_mask, cache, document_ids, aligned)
        return self.stack(self.embed(ids, pos), ctx, cache)

    def new_cache(self, batch_size: int, max_len: int | None = None, *, dtype: torch.dtype | None = None) -> KVCache:
        """A static cache for ``batch_size`` rows of up to ``max_len`` positions."""
        # dtype and device from the token table: the head may be quantized (integer weights).
        return new_self_cache(
            self.config, self.embed.like(), len(self.stack.blocks), batch_size, max_len, dtype, self.kv_shards
        )


def new_self_cache(
    cfg: ModelConfig, like: Tensor, n_layers: int, batch_size: int, max_len, dtype, shards: int = 1
) -> KVCache:
    max_len = cfg.max_seq_len if max_len is None else max_len
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}: must be an integer >= 1")
    if not isinstance(max_len, int) or not 1 <= max_len <= cfg.max_seq_len:
        raise ValueError(f"max_len={max_len!r}: must be an integer in [1, max_seq_len={cfg.max_seq_len}]")
    heads, k_dim, v_dim = cache_widths(cfg)  # K/V heads, or MLA's latent + rotary key
    heads //= shards  # this rank's K/V heads under tensor parallelism
    return KVCache.allocate(
        n_layers,
        batch_size,
        max_len,
        heads,
        k_dim,
        dtype=like.dtype if dtype is None else dtype,
        device=like.device,
        v_dim=v_dim,
    )
