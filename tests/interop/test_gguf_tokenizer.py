"""The tokenizer rebuilt from a GGUF file's tokenizer.ggml.* metadata encodes a fixed multilingual
text set exactly as llama.cpp's Llama.tokenize does on the same file, and decodes back; BOS and
the chat template come along (issue 29)."""

from __future__ import annotations

import pytest

from torchformer.interop.gguf.tokenizer import chat_template_from_gguf, tokenizer_from_gguf

from .gguf_llamacpp import CHAT, TEXTS, gguf_file, llama_tokenize, need_llama_cpp

# One xdist worker makes the GGUF files once (a conversion takes ~15 s).
pytestmark = pytest.mark.xdist_group("gguf")

need_llama_cpp()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_byte_level_bpe_encodes_as_llama_cpp_and_decodes_back(family):
    path = gguf_file(family)
    tok = tokenizer_from_gguf(path)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert ids == llama_tokenize(path, text, add_bos=False), text
        assert tok.decode(ids) == text
        assert tok.encode(text).ids == llama_tokenize(path, text, add_bos=True), text


def test_sentencepiece_with_byte_fallback_encodes_as_llama_cpp_and_decodes_back():
    path = gguf_file("llama-spm")
    tok, pieces = tokenizer_from_gguf(path), set()
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert ids == llama_tokenize(path, text, add_bos=False), text
        assert tok.decode(ids) == text
        assert tok.encode(text).ids == llama_tokenize(path, text, add_bos=True), text
        pieces |= {tok.id_to_token(i) for i in ids}
    assert any(p.startswith("<0x") for p in pieces)  # characters outside the pieces went through byte fallback


def test_chat_template_and_special_token_texts_come_from_the_file():
    assert chat_template_from_gguf(gguf_file("llama")) == (CHAT, "<s>", "</s>")
