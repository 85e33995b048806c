"""Embeddings and the block stack, plus the per-forward context every layer shares.

The stack computes positions, RoPE rows and the attention pattern (mask and bias rules, see
nn/patterns.py) once per forward, lets the backend's prepare step (nn/routing.py) turn the
pattern into what that backend consumes, and hands it to all blocks in one AttnInputs. Positions
are per row: token t of a row has position (number of real tokens before it in that row), so left
padding does not shift a row's positions; packed rows restart them at each document.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..nn.attention import AttnInputs
from ..nn.masks import padding_mask
from ..nn.patterns import Pattern, all_of, causal, key_valid, same_document, window
from ..nn.routing import prepare_dense


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
        n_heads: int = 1,
        prepare: Callable[[AttnInputs], AttnInputs] | None = None,
    ) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.final_norm = final_norm
        self.causal, self.rope, self.score_bias, self.window = causal, rope, score_bias, window
        self.n_heads = n_heads
        self.prepare = prepare_dense if prepare is None else prepare  # what the backend consumes

    def context(self, pos: Tensor, attention_mask: Tensor | None, cache, document_ids: Tensor | None = None):
        """RoPE rows and the attention pattern for self-attention of queries at positions pos (B, T).

        Without a cache, keys are this chunk's tokens (columns); with one, keys are the cache
        slots 0..S_max, whose positions are their indices. document_ids (B, T) (packed rows, no
        cache) keep attention inside each document.
        """
        B, T = pos.shape
        if cache is None:
            k_pos = pos
            columns = torch.arange(T, device=pos.device)[None, :].expand(B, T)
            order = causal(columns, columns) if self.causal else None
            keys = None if attention_mask is None else key_valid(attention_mask.bool())
            slots = None
        else:
            k_pos = cache.key_positions.expand(B, -1)  # (B, S_max + 1)
            order, keys = causal(pos, k_pos), None
            # Padding tokens go to the extra last slot, which no query can see.
            slots = pos if attention_mask is None else pos.masked_fill(attention_mask == 0, cache.max_len)
        near = None if self.window is None else window(pos, k_pos, self.window)
        docs = None if document_ids is None else same_document(document_ids, document_ids)
        bias = None if self.score_bias is None else self.score_bias.rule(pos, k_pos)
        fast = order is not None and cache is None and keys is None and near is None and docs is None and bias is None
        mask = all_of([order, keys, near, docs])
        pattern = None
        if mask is not None or bias is not None:
            params = () if bias is None else self.score_bias.params
            pattern = Pattern(mask, bias, B, self.n_heads, T, k_pos.shape[1], pos.device,
                              key_only=order is None and near is None and docs is None, params=params)  # fmt: skip
        rope = None if self.rope is None else self.rope(pos)
        return self.prepare(AttnInputs(rope=rope, mask=None, bias=None, is_causal=fast, slots=slots, pattern=pattern))

    def forward(self, x: Tensor, ctx: AttnInputs, cache=None, memory_kv=None, cross_ctx=None) -> Tensor:
        for i, block in enumerate(self.blocks):
            layer_cache = None if cache is None else cache.layers[i]
            cross_kv = None if memory_kv is None else memory_kv[i]
            x = block(x, ctx, layer_cache, cross_kv, cross_ctx)
        return self.final_norm(x)


def positions_from(
    ids: Tensor, positions: Tensor | None, attention_mask: Tensor | None, document_ids: Tensor | None = None
) -> Tensor:
    """Per-row positions (B, T): given, counted over real tokens (left padding-aware), or, for
    packed rows, counted from each document's first token."""
    if positions is not None:
        return positions.expand(ids.shape[0], -1)  # (T,) or (1, T) or (B, T) -> (B, T)
    if document_ids is not None:
        return document_positions(document_ids)
    if attention_mask is not None:
        return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    return torch.arange(ids.shape[1], device=ids.device)[None, :].expand(ids.shape[0], -1)


def document_positions(document_ids: Tensor) -> Tensor:
    """Index of each token within its document: (B, T) ids -> (B, T), 0 at each document start."""
    col = torch.arange(document_ids.shape[1], device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return col - torch.where(starts, col, torch.zeros_like(col)).cummax(dim=-1).values


def cross_context(src_mask: Tensor | None) -> AttnInputs:
    mask = None if src_mask is None else padding_mask(src_mask)
    return AttnInputs(rope=None, mask=mask, bias=None, is_causal=False, slots=None)


def embed_scale(enabled: bool, d_model: int) -> float:
    return math.sqrt(d_model) if enabled else 1.0
