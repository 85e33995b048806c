"""A ``tokenizers.Tokenizer`` -> tokenizer.ggml.* metadata (the reverse of tokenizer.py), for
to_gguf. Everything is written as llama.cpp's ``gpt2`` model (byte-level BPE, ``pre = "gpt-2"``),
which reproduces three kinds exactly:

- byte-level BPE with GPT-2's pre-tokenizer (``torchformer train``'s bpe, GPT-2's own): as it is;
- bytes (``torchformer train``'s byte kind: the 256 byte symbols, no merges): as it is, since with
  no merges the pre-tokenizer's cuts change nothing;
- characters (``torchformer train``'s char kind: a WordLevel vocabulary of single characters)
  of one UTF-8 byte (ASCII, as the shakespeare-char corpus): llama.cpp's BPE works on the bytes
  of the text, so each character is written as its byte-level symbol (GPT-2's byte alphabet:
  " " is "Ġ", "\n" is "Ċ") and, with no merges, every character is its own token. A character of
  more bytes would need merges whose parts are no tokens, which llama.cpp accepts but a
  ``tokenizers`` BPE (what we read GGUF vocabularies into) refuses: refused here, naming them.
  One difference remains by llama.cpp's design: a character outside the alphabet is dropped
  there (its byte is no token), where the char tokenizer gives <unk>.

Other tokenizers are refused with that list. The vocabulary is padded to the model's vocab_size
with unused tokens, as llama.cpp's converter does (random or trained heads may emit any id below
it). The chat template, when given, is written as tokenizer.chat_template (what llama.cpp's
server and Ollama render chats with).
"""

from __future__ import annotations

import json

from ...configs import ModelConfig
from ...text.byte_level import byte_alphabet

NORMAL, CONTROL, UNUSED = 1, 3, 5
PER_CHARACTER = {"type": "Split", "pattern": {"Regex": "[\\s\\S]"}, "behavior": "Isolated", "invert": False}


def tokenizer_metadata(tokenizer, cfg: ModelConfig, chat_template: str | None = None) -> list[tuple]:
    """The tokenizer.ggml.* entries as (GGUFWriter method, its arguments...) tuples, checked and computed
    before anything is written (a tokenizer we cannot write is refused before any tensor work)."""
    raw = json.loads(tokenizer.to_str())
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > cfg.vocab_size:
        raise ValueError(f"tokenizer has {size} tokens, the model's vocab_size is {cfg.vocab_size}")
    special = {t["id"] for t in raw.get("added_tokens", []) if t.get("special")}
    tokens, merges = vocabulary(tokenizer, raw, size, special)
    types = [CONTROL if i in special else NORMAL for i in range(size)]
    tokens += [f"[PAD{i}]" for i in range(size, cfg.vocab_size)]
    types += [UNUSED] * (cfg.vocab_size - size)
    # The merges key is required by llama.cpp for a gpt2 vocabulary, and the gguf writer refuses an
    # empty array: byte and char vocabularies get one empty merge, which llama.cpp keys as the pair
    # ("", "") that no two symbols ever form (and our reader skips).
    out = [("add_tokenizer_model", "gpt2"), ("add_tokenizer_pre", "gpt-2"), ("add_token_list", tokens),
           ("add_token_types", types), ("add_token_merges", merges or [""])]  # fmt: skip
    # The config's ids, else `torchformer train`'s special tokens: without them llama.cpp assumes
    # GPT-2's (id 11 for BOS and EOS), an ordinary character in a char vocabulary.
    ids = {
        "add_bos_token_id": (cfg.bos_token_id, "<s>"),
        "add_eos_token_id": (cfg.eos_token_id, "</s>"),
        "add_pad_token_id": (cfg.pad_token_id, "<pad>"),
        "add_unk_token_id": (None, "<unk>"),
    }
    resolved = {add: tokenizer.token_to_id(text) if value is None else value for add, (value, text) in ids.items()}
    out += [(add, value) for add, value in resolved.items() if value is not None]
    bos = resolved["add_bos_token_id"]
    with_specials, plain = tokenizer.encode("a").ids, tokenizer.encode("a", add_special_tokens=False).ids
    out.append(("add_add_bos_token", with_specials[:1] == [bos] and with_specials != plain))  # its post-processor's
    if chat_template:
        out.append(("add_chat_template", chat_template))
    return out


def write_tokenizer(writer, entries: list[tuple]) -> None:
    for method, *args in entries:
        getattr(writer, method)(*args)


def vocabulary(tokenizer, raw: dict, size: int, special: set[int]) -> tuple[list[str], list[str]]:
    """(the token texts in id order, the merges) of the byte-level BPE that splits text as
    ``tokenizer`` does; ValueError for a tokenizer no such BPE reproduces."""
    model, pre = raw.get("model") or {}, raw.get("pre_tokenizer") or {}
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    plain = raw.get("normalizer") is None
    byte_level = pre.get("type") == "ByteLevel" and (pre.get("use_regex", True) or not merges)  # no merges: no cuts
    if plain and model.get("type") == "BPE" and byte_level:
        return [tokenizer.id_to_token(i) or f"[PAD{i}]" for i in range(size)], merges
    if plain and model.get("type") == "WordLevel" and pre == PER_CHARACTER:
        return _characters(tokenizer, size, special)
    raise ValueError(
        f"tokenizer: model {model.get('type')!r} with pre-tokenizer {pre.get('type')!r}: GGUF export writes "
        "byte-level BPE (ByteLevel pre-tokenizer, as `torchformer train` and GPT-2 make), byte and char "
        "tokenizers (`torchformer train`'s)"
    )


def _characters(tokenizer, size: int, special: set[int]) -> tuple[list[str], list[str]]:
    symbol = byte_alphabet()
    tokens, wide = [], []
    for i in range(size):
        text = tokenizer.id_to_token(i)
        if i in special:
            tokens.append(text)
        elif text is None or len(text) != 1:
            raise ValueError(f"tokenizer: token {i} is {text!r}; a char tokenizer's tokens are single characters")
        elif ord(text) > 127:
            wide.append(text)
        else:
            tokens.append(symbol[ord(text)])
    if wide:
        raise ValueError(
            f"tokenizer: characters beyond ASCII {wide[:10]} ({len(wide)} in all): GGUF export writes char "
            "tokenizers over one-byte (ASCII) characters; train with data.tokenizer 'byte' or 'bpe' for other text"
        )
    return tokens, []
