"""Encoder-decoder (Vaswani 2017): encoder over the source, causal decoder with cross-attention."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..configs import ModelConfig
from ..nn.kv_cache import KVCache
from .checks import check_ids, check_mask, check_positions
from .decoder import new_self_cache
from .stack import Embeddings, Stack, cross_context, positions_from


class EncoderDecoder(nn.Module):
    kv_shards: int = 1  # tensor parallelism's split of the K/V heads (DecoderLM.kv_shards)

    def __init__(
        self,
        config: ModelConfig,
        src_embed: Embeddings,
        encoder: Stack,
        tgt_embed: Embeddings,
        decoder: Stack,
        lm_head: nn.Linear,
    ) -> None:
        super().__init__()
        self.config = config
        self.src_embed, self.encoder = src_embed, encoder
        self.tgt_embed, self.decoder, self.lm_head = tgt_embed, decoder, lm_head

    def forward(
        self, src_ids: Tensor, tgt_ids: Tensor, *, src_mask: Tensor | None = None, tgt_mask: Tensor | None = None
    ) -> Tensor:
        """Teacher forcing: src (B, S), tgt (B, T) -> logits (B, T, V). Masks: 0 marks padding."""
        memory = self.encode(src_ids, src_mask=src_mask)
        return self.decode(tgt_ids, memory, src_mask=src_mask, attention_mask=tgt_mask)

    def encode(self, src_ids: Tensor, *, src_mask: Tensor | None = None) -> Tensor:
        """src (B, S) -> memory (B, S, D)."""
        cfg = self.config
        check_ids(src_ids, "src_ids", cfg.vocab_size, cfg.max_seq_len)
        check_mask(src_mask, "src_mask", src_ids, "src_ids")
        pos = positions_from(src_ids, None, None)
        ctx = self.encoder.context(pos, src_mask, None, aligned=True)
        return self.encoder(self.src_embed(src_ids, pos), ctx)

    def decode(
        self,
        tgt_ids: Tensor,
        memory: Tensor | None = None,
        *,
        src_mask: Tensor | None = None,
        positions: Tensor | None = None,
        attention_mask: Tensor | None = None,
        cache: KVCache | None = None,
    ) -> Tensor:
        """tgt (B, T) -> logits (B, T, V), attending to memory (B, S, D) or to the cross K/V
        stored in ``cache`` (see ``new_cache``)."""
        cfg = self.config
        check_ids(tgt_ids, "tgt_ids", cfg.vocab_size, cfg.max_seq_len)
        check_mask(attention_mask, "attention_mask", tgt_ids, "tgt_ids")
        check_positions(positions, tgt_ids, cache, cfg.max_seq_len)
        if memory is None and (cache is None or cache.cross is None):
            raise ValueError("decode needs memory=encode(src) or a cache made by new_cache(..., memory=memory)")
        if cache is None or cache.cross is None:
            memory_kv, src_mask = self.cross_kv(memory), src_mask
        else:
            memory_kv, src_mask = cache.cross, cache.src_mask
        pos = positions_from(tgt_ids, positions, attention_mask)
        return self.logits(tgt_ids, pos, attention_mask, cache, memory_kv, src_mask, aligned=positions is None)

    def logits(self, ids, pos, attention_mask, cache, memory_kv, src_mask, aligned: bool = False) -> Tensor:
        """The unchecked decoder forward (generation loops and compiled steps call this)."""
        ctx = self.decoder.context(pos, attention_mask, cache, aligned=aligned)
        x = self.decoder(self.tgt_embed(ids, pos), ctx, cache, memory_kv, cross_context(src_mask))
        return self.lm_head(x)  # (B, T, V)

    def cross_kv(self, memory: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Each decoder layer's cross-attention keys and values of memory: (B, K, S, E) each."""
        return [blk.cross_attn.project_kv(memory) for blk in self.decoder.blocks]

    def new_cache(
        self,
        batch_size: int,
        max_len: int | None = None,
        *,
        memory: Tensor | None = None,
        src_mask: Tensor | None = None,
        dtype: torch.dtype | None = None,
    ) -> KVCache:
        """A static decoder cache; with ``memory``, the cross-attention K/V are computed once here."""
        like = self.tgt_embed.tok.weight  # dtype and device; the head may be quantized (integer weights)
        cache = new_self_cache(self.config, like, len(self.decoder.blocks), batch_size, max_len, dtype, self.kv_shards)
        if memory is not None:
            if memory.shape[0] != batch_size:
                raise ValueError(f"memory has batch {memory.shape[0]} but batch_size={batch_size}")
            cache.cross, cache.src_mask = self.cross_kv(memory), src_mask
        return cache
