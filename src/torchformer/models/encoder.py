"""Encoder-only model (BERT-style): embeddings (+ token types) -> bidirectional blocks."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from ..configs import ModelConfig
from ..nn.linear import linear
from .checks import check_ids, check_mask, check_positions
from .stack import Embeddings, Stack, positions_from


def by_column(attention_mask: Tensor | None) -> None:
    """Positions are columns (BERT): nothing of the mask is needed."""
    return None


def by_count(attention_mask: Tensor | None) -> Tensor | None:
    """Positions count the real tokens before each one (RoBERTa): positions_from reads the mask."""
    return attention_mask


class Encoder(nn.Module):
    def __init__(self, config: ModelConfig, embed: Embeddings, stack: Stack, numbering: Callable = by_column) -> None:
        super().__init__()
        self.config = config
        self.embed, self.stack = embed, stack
        self.numbering = numbering  # by_column or by_count, picked in build.py

    def forward(
        self,
        input_ids: Tensor,
        *,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        positions: Tensor | None = None,
    ) -> Tensor:
        """input_ids (B, T) -> hidden states (B, T, D). attention_mask (B, T): 0 marks padding."""
        cfg = self.config
        check_ids(input_ids, "input_ids", cfg.vocab_size, cfg.max_seq_len)
        check_mask(attention_mask, "attention_mask", input_ids, "input_ids")
        check_mask(token_type_ids, "token_type_ids", input_ids, "input_ids")
        check_positions(positions, input_ids, None, cfg.max_seq_len)
        # Encoders pad on the right, so columns (BERT) and counted tokens (RoBERTa) agree on real
        # tokens there; with left padding only counting matches RoBERTa.
        pos = positions_from(input_ids, positions, self.numbering(attention_mask))
        return self.hidden(input_ids, pos, attention_mask, token_type_ids, aligned=positions is None)

    def hidden(
        self, ids: Tensor, pos: Tensor, attention_mask: Tensor | None, token_type_ids=None, aligned: bool = False
    ) -> Tensor:
        """ids, pos (B, T) -> final hidden states (B, T, D); ``aligned``: positions are 0..T-1."""
        ctx = self.stack.context(pos, attention_mask, None, aligned=aligned)
        return self.stack(self.embed(ids, pos, token_type_ids), ctx)  # (B, T, D)

    def mlm_logits(self, hidden: Tensor) -> Tensor:
        """Masked-LM logits (B, T, V) through the tied token embeddings."""
        return linear(hidden, self.embed.tok.weight)
