"""Inference: ``generate`` / ``stream`` (greedy and sampled, over the static KV cache) and
``beam_search``; the logits processors live in ``sampling``, the blocked argmax and top-k of
large vocabularies in ``topk``."""

from .beam import Beams, beam_search
from .generate import generate, stream

__all__ = ["Beams", "beam_search", "generate", "stream"]
