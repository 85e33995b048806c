"""Byte-level BPE's alphabet (GPT-2's convention), shared by the tokenizers training fits
(training/tokenizers.py) and the GGUF vocabularies interop reads (interop/gguf/vocab.py)."""

from __future__ import annotations


def byte_alphabet() -> list[str]:
    """The printable stand-in for each byte 0..255 used by byte-level BPE (GPT-2's convention):
    printable bytes map to themselves, the others to code points from 256 up, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]
