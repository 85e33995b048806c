"""Embeddings and the block stack, plus the per-forward context every layer of a kind shares.

The stack computes positions, RoPE rows and the attention pattern (mask and bias rules, see
nn/patterns.py) once per forward, lets the backend's prepare step (nn/routing.py) turn the
pattern into what that backend consumes, and hands it to the blocks in one AttnInputs. Layers
that differ (configs/layers.py: Gemma's sliding/global layers, SmolLM3's NoPE layers) get one
context per kind: the shared rules (order, padding, documents, score bias) are computed once,
the kind's window and RoPE rows once per kind; each block receives its kind's. Positions
are per row: token t of a row has position (number of real tokens before it in that row), so left
padding does not shift a row's positions; packed rows restart them at each document.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..fast.compiled import cpp_wrapper_forced
from ..nn.attention import AttnInputs
from ..nn.masks import padding_mask
from ..nn.patterns import Pattern, Rule, all_of, causal, key_valid, same_document, window
from ..nn.routing import prepare_dense
from .regions import REGION_PARAMS, frozen_contexts, region_block, region_frozen, run_block


class Embeddings(nn.Module):
    """tokens * scale + absolute positions + token types, then an optional norm and dropout."""

    def __init__(
        self,
        tok: nn.Embedding,
        *,
        scale: float,
        multiply: Callable[[Tensor, float], Tensor] | None = None,
        absolute: nn.Module | None,
        token_types: nn.Embedding | None,
        norm: nn.Module | None,
        dropout: nn.Module,
    ) -> None:
        super().__init__()
        self.tok, self.scale, self.absolute = tok, scale, absolute
        self.multiply = times if multiply is None else multiply
        self.token_types, self.norm, self.drop = token_types, norm, dropout

    def like(self) -> Tensor:
        """A tensor of the rows' dtype and device: the table's, or what a table kept quantized gives
        for its rows (interop/gguf/table.py)."""
        return self.tok.like if hasattr(self.tok, "like") else self.tok.weight

    def forward(self, ids: Tensor, pos: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        x = self.multiply(self.tok(ids), self.scale) if self.scale != 1.0 else self.tok(ids)  # (B, T, D)
        if self.absolute is not None:
            x = x + self.absolute(pos).to(x.dtype)
        if self.token_types is not None:
            types = torch.zeros_like(ids) if token_type_ids is None else token_type_ids
            x = x + self.token_types(types)
        if self.norm is not None:
            x = self.norm(x)
        return self.drop(x)


def times(x: Tensor, scale: float) -> Tensor:
    return x * scale  # a Python float: computed at the activations' compute precision (Marian, Vaswani)


def times_in_dtype(x: Tensor, scale: float) -> Tensor:
    # Gemma: sqrt(hidden_size) is a tensor cast to the weights' dtype before the product (in bf16
    # 45.2548 -> 45.25), so bf16 embeddings match Gemma's exactly.
    return x * torch.tensor(scale, dtype=x.dtype, device=x.device)


class KindContext(nn.Module):
    """What differs between layer kinds in the context: the RoPE table (None: NoPE) and window."""

    def __init__(self, rope: nn.Module | None, window: int | None) -> None:
        super().__init__()
        self.rope, self.window = rope, window


@dataclass(frozen=True)
class Shared:
    """What every layer kind's context shares in one forward, computed once by ``Stack.context``:
    the rules of order, padding, documents and score bias, and the facts the backends route on."""

    pos: Tensor  # (B, T) query positions
    k_pos: Tensor  # (B, S) key positions: the chunk's, or every cache slot's
    slots: Tensor | None  # (B, T) the cache slot each token is written to (None: no cache)
    order: Rule | None  # causal order (None: bidirectional)
    keys: Rule | None  # key padding
    docs: Rule | None  # packed documents
    bias: Rule | None  # the position scheme's score bias (ALiBi, T5)
    no_cache: bool
    aligned: bool  # Pattern.aligned: queries and keys at the same positions
    live: Tensor | None  # Pattern.live: the cache slots any query can see (CPU cached steps)


class Stack(nn.Module):
    """Blocks and the final norm; builds the per-forward context of each layer kind.

    rope / window are the first layer's kind's; ``kinds`` holds the other kinds (KindContext) and
    ``layer_kind[i]`` the kind of block i (0: the stack's own rope and window).
    """

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
        kinds: list[KindContext] | None = None,
        layer_kind: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        big = bool(blocks) and sum(p.numel() for p in blocks[0].parameters()) >= REGION_PARAMS
        self.regions = big and not cpp_wrapper_forced()
        self.final_norm = final_norm
        self.causal, self.rope, self.score_bias, self.window = causal, rope, score_bias, window
        self.n_heads = n_heads
        self.prepare = prepare_dense if prepare is None else prepare  # what the backend consumes
        self.kinds = nn.ModuleList(kinds or [])
        self.layer_kind = (0,) * len(blocks) if layer_kind is None else tuple(layer_kind)
        assert len(self.layer_kind) == len(blocks) and max(self.layer_kind) <= len(self.kinds)

    def context(
        self, pos: Tensor, attention_mask: Tensor | None, cache, document_ids: Tensor | None = None, aligned=False
    ):
        """RoPE rows and the attention pattern for self-attention of queries at positions pos (B, T).

        Without a cache, keys are this chunk's tokens (columns); with one, keys are the cache
        slots 0..S_max, whose positions are their indices. document_ids (B, T) (packed rows, no
        cache) keep attention inside each document. aligned: pos are the column indices (plus one
        shift per row), which with no mask, documents or cache makes every rule a function of
        kv - q (Pattern.aligned). Returns the first kind's context; its
        ``by_kind`` holds every kind's (what ``forward`` hands the blocks).
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
        docs = None if document_ids is None else same_document(document_ids, document_ids)
        bias = None if self.score_bias is None else self.score_bias.rule(pos, k_pos)
        aligned = aligned and cache is None and keys is None and docs is None
        # Slots past the highest query are dead: CPU cached steps skip them (nn/backends.py, prefix_sdpa).
        live = pos.max() + 1 if cache is not None and pos.is_cpu else None
        shared = Shared(pos, k_pos, slots, order, keys, docs, bias, cache is None, aligned, live)
        ctxs = tuple(self.kind_context(shared, kind.rope, kind.window) for kind in (self, *self.kinds))
        return ctxs[0]._replace(by_kind=ctxs)

    def kind_context(self, s: Shared, rope: nn.Module | None, size: int | None) -> AttnInputs:
        """One kind's context: the shared rules plus this kind's window and RoPE rows."""
        near = None if size is None else window(s.pos, s.k_pos, size)
        local = near is None and s.docs is None  # no rule that depends on the query beyond causal order
        fast = s.order is not None and s.no_cache and s.keys is None and local and s.bias is None
        mask = all_of([s.order, s.keys, near, s.docs])
        pattern = None
        if mask is not None or s.bias is not None:
            params = () if s.bias is None else self.score_bias.params
            reach = getattr(self.score_bias, "reach", None) if params else None
            B, T = s.pos.shape
            pattern = Pattern(mask, s.bias, B, self.n_heads, T, s.k_pos.shape[1], s.pos.device,
                              key_only=s.order is None and local, params=params, aligned=s.aligned, reach=reach,
                              live=s.live)  # fmt: skip
        rows = None if rope is None else rope(s.pos)
        return self.prepare(AttnInputs(rope=rows, mask=None, bias=None, is_causal=fast, slots=s.slots, pattern=pattern))

    def forward(self, x: Tensor, ctx: AttnInputs, cache=None, memory_kv=None, cross_ctx=None) -> Tensor:
        ctxs = ctx.by_kind or (ctx,)  # a context built by hand (tests) is every layer's
        # Big layers under torch.compile: one region traced once and reused (models/regions.py).
        frozen = frozen_contexts(ctxs, x, cache, memory_kv) if self.regions else None
        if frozen is not None:
            for i, block in enumerate(self.blocks):
                lean, pattern = frozen[self.layer_kind[i]]
                k, v = (None, None) if cache is None else (cache.layers[i].k, cache.layers[i].v)
                x = region_frozen(block, x, lean, pattern, k, v)
            return self.final_norm(x)
        call = region_block if self.regions else run_block
        for i, block in enumerate(self.blocks):
            layer_cache = None if cache is None else cache.layers[i]
            cross_kv = None if memory_kv is None else memory_kv[i]
            x = call(block, x, ctxs[self.layer_kind[i]], layer_cache, cross_kv, cross_ctx)
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
