"""Embeddings and the block stack, plus the per-forward context every layer shares.

The stack computes positions, RoPE rows, the score bias and the mask once per forward and hands
them to all blocks in one AttnInputs. Positions are per row: token t of a row has position
(number of real tokens before it in that row), so left padding does not shift a row's positions.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..nn.attention import AttnInputs
from ..nn.masks import causal_mask, combine, padding_mask, window_mask


class Embeddings(nn.Module):
    """tokens * scale + absolute positions + token types, then an optional norm and dropout."""

    def __init__(
        self,
        tok: nn.Embedding,
        *,
        scale: float,
        absolute: nn.Module | None,
        token_types: nn.Embedding | None,
        norm: nn.Module | None,
        dropout: nn.Module,
    ) -> None:
        super().__init__()
        self.tok, self.scale, self.absolute = tok, scale, absolute
        self.token_types, self.norm, self.drop = token_types, norm, dropout

    def forward(self, ids: Tensor, pos: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        x = self.tok(ids) * self.scale if self.scale != 1.0 else self.tok(ids)  # (B, T, D)
        if self.absolute is not None:
            x = x + self.absolute(pos).to(x.dtype)
        if self.token_types is not None:
            types = torch.zeros_like(ids) if token_type_ids is None else token_type_ids
            x = x + self.token_types(types)
        if self.norm is not None:
            x = self.norm(x)
        return self.drop(x)


class Stack(nn.Module):
    """Blocks and the final norm; builds the shared per-forward context."""

    def __init__(
        self,
        blocks: list[nn.Module],
        final_norm: nn.Module,
        *,
        causal: bool,
        rope: nn.Module | None,
        score_bias: nn.Module | None,
        window: int | None,
    ) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.final_norm = final_norm
        self.causal, self.rope, self.score_bias, self.window = causal, rope, score_bias, window

    def context(self, pos: Tensor, attention_mask: Tensor | None, cache) -> AttnInputs:
        """Mask, bias and RoPE rows for self-attention of queries at positions pos (B, T).

        Without a cache, keys are this chunk's tokens (columns); with one, keys are the cache
        slots 0..S_max, whose positions are their indices.
        """
        if cache is None:
            k_pos = pos
            columns = torch.arange(pos.shape[1], device=pos.device)[None, :]
            order = causal_mask(columns, columns) if self.causal else None
            keys = None if attention_mask is None else padding_mask(attention_mask)
            slots = None
        else:
            k_pos = cache.key_positions  # (1, S_max + 1)
            order, keys = causal_mask(pos, k_pos), None
            # Padding tokens go to the extra last slot, which no query can see.
            slots = pos if attention_mask is None else pos.masked_fill(attention_mask == 0, cache.max_len)
        window = None if self.window is None else window_mask(pos, k_pos, self.window)
        bias = None if self.score_bias is None else self.score_bias(pos, k_pos.expand(pos.shape[0], -1))
        fast = cache is None and attention_mask is None and window is None and bias is None and self.causal
        mask = None if fast else combine(order, keys, window)
        rope = None if self.rope is None else self.rope(pos)
        return AttnInputs(rope=rope, mask=mask, bias=bias, is_causal=fast, slots=slots)

    def forward(self, x: Tensor, ctx: AttnInputs, cache=None, memory_kv=None, cross_ctx=None) -> Tensor:
        for i, block in enumerate(self.blocks):
            layer_cache = None if cache is None else cache.layers[i]
            cross_kv = None if memory_kv is None else memory_kv[i]
            x = block(x, ctx, layer_cache, cross_kv, cross_ctx)
        return self.final_norm(x)


def positions_from(ids: Tensor, positions: Tensor | None, attention_mask: Tensor | None) -> Tensor:
    """Per-row positions (B, T): given, or counted over real tokens (left padding-aware)."""
    if positions is not None:
        return positions.expand(ids.shape[0], -1)  # (T,) or (1, T) or (B, T) -> (B, T)
    if attention_mask is not None:
        return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    return torch.arange(ids.shape[1], device=ids.device)[None, :].expand(ids.shape[0], -1)


def cross_context(src_mask: Tensor | None) -> AttnInputs:
    mask = None if src_mask is None else padding_mask(src_mask)
    return AttnInputs(rope=None, mask=mask, bias=None, is_causal=False, slots=None)


def embed_scale(enabled: bool, d_model: int) -> float:
    return math.sqrt(d_model) if enabled else 1.0
