"""A ``tokenizers.Tokenizer`` -> tokenizer.ggml.* metadata (the reverse of tokenizer.py), for
to_gguf. Byte-level BPE with GPT-2's pre-tokenizer is what llama.cpp's ``gpt2`` model with
``pre = "gpt-2"`` splits the same way; other tokenizers are refused with that list. The
vocabulary is padded to the model's vocab_size with unused tokens, as llama.cpp's converter does
(random or trained heads may emit any id below it).
"""

from __future__ import annotations

import json

from ...config import ModelConfig

NORMAL, CONTROL, UNUSED = 1, 3, 5


def write_tokenizer(writer, tokenizer, cfg: ModelConfig) -> None:
    raw = json.loads(tokenizer.to_str())
    model, pre = raw.get("model") or {}, raw.get("pre_tokenizer") or {}
    byte_level = pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
    if model.get("type") != "BPE" or not byte_level or raw.get("normalizer") is not None:
        raise ValueError(
            f"tokenizer: model {model.get('type')!r} with pre-tokenizer {pre.get('type')!r}: GGUF export writes "
            "byte-level BPE tokenizers (ByteLevel pre-tokenizer, as `torchformer train` and GPT-2 make)"
        )
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > cfg.vocab_size:
        raise ValueError(f"tokenizer has {size} tokens, the model's vocab_size is {cfg.vocab_size}")
    tokens = [tokenizer.id_to_token(i) or f"[PAD{i}]" for i in range(size)]
    special = {t["id"] for t in raw.get("added_tokens", []) if t.get("special")}
    types = [CONTROL if i in special else NORMAL for i in range(size)]
    tokens += [f"[PAD{i}]" for i in range(size, cfg.vocab_size)]
    types += [UNUSED] * (cfg.vocab_size - size)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for add, value in ((writer.add_bos_token_id, cfg.bos_token_id), (writer.add_eos_token_id, cfg.eos_token_id),
                       (writer.add_pad_token_id, cfg.pad_token_id)):  # fmt: skip
        if value is not None:
            add(value)
    with_specials, plain = tokenizer.encode("a").ids, tokenizer.encode("a", add_special_tokens=False).ids
    writer.add_add_bos_token(with_specials[:1] == [cfg.bos_token_id] and with_specials != plain)  # its post-processor's
