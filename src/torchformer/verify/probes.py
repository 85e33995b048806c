"""Arch-agnostic inputs and calls for the checks: one Runner turns "run the part under test on
these token ids" into the right call for a decoder, an encoder or an encoder-decoder.

For encoder-decoders the part under test is the decoder over a fixed random source; the
source side is exercised by the padding check.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import Tensor, nn

from ..nn.attention import Attention

PAD = 3  # tokens of padding given to the second row in the padded probes


class Runner:
    def __init__(self, model: nn.Module, length: int, seed: int) -> None:
        self.model, self.cfg = model, model.config
        self.arch = self.cfg.arch
        self.gen = torch.Generator().manual_seed(seed)
        self.T = max(2, min(length, self.cfg.max_seq_len))
        device = next(model.parameters()).device
        self.device = device
        self.src = self.ids(2, self.T) if self.arch == "encoder_decoder" else None

    def ids(self, batch: int, length: int) -> Tensor:
        return torch.randint(0, self.cfg.vocab_size, (batch, length), generator=self.gen).to(self.device)

    def out(self, ids: Tensor, mask: Tensor | None = None, positions: Tensor | None = None, src=None, src_mask=None):
        """Logits (decoder, encoder-decoder's decoder) or hidden states (encoder): (B, T, X)."""
        m = self.model
        if self.arch == "decoder":
            return m(ids, attention_mask=mask, positions=positions)
        if self.arch == "encoder":
            return m(ids, attention_mask=mask, positions=positions)
        src = self.src[: ids.shape[0]] if src is None else src
        memory = m.encode(src, src_mask=src_mask)
        return m.decode(ids, memory, src_mask=src_mask, attention_mask=mask, positions=positions)

    def padded(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """Row 1 gets PAD padding tokens: on the left for causal models (generation's
        convention), on the right for encoders (BERT's). Returns (ids, mask)."""
        n = min(PAD, ids.shape[1] - 1)
        mask = torch.ones_like(ids)
        if self.arch == "encoder":
            mask[1, ids.shape[1] - n :] = 0
        else:
            mask[1, :n] = 0
        pad = self.cfg.pad_token_id if self.cfg.pad_token_id is not None else 0
        return ids.masked_fill(mask == 0, pad), mask


def attention_modules(model: nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


@contextmanager
def backends_set_to(model: nn.Module, backend):
    """Every Attention's backend replaced by ``backend`` inside the block, restored after."""
    modules = attention_modules(model)
    saved = [m.backend for m in modules]
    try:
        for m in modules:
            m.backend = backend
        yield model
    finally:
        for m, b in zip(modules, saved):
            m.backend = b


def rel_diff(a: Tensor, b: Tensor) -> float:
    """max |a - b| / max(1, max |b|): an absolute error for small outputs, relative for large."""
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1.0))


def looks_untrained(model: nn.Module) -> bool:
    """Fresh from build_model (or HF's init): every norm weight is 1 and every bias is 0."""
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 2)
        if leaf[-1] == "bias" and not bool((p == 0).all()):
            return False
        if leaf[-1] == "weight" and leaf[-2].endswith("norm") and not bool((p == 1).all()):
            return False
    return True
