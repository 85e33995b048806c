"""POST /v1/embeddings for an encoder model: the request checked, its inputs as token ids, the
answer shaped (no torch here: the engine thread computes, engine.py ``embed``).

Served for encoder models only (BERT, MiniLM, ...), pooled as ``tfm.embed`` pools them: the
folder's sentence-transformers settings (``1_Pooling/config.json``, ``modules.json``,
``sentence_bert_config.json``), else mean pooling, L2-normalised. A decoder's hidden states are
no embedding unless the model was trained for it (and which pooling it was trained with is not in
its folder), so a generating server answers /v1/embeddings with a 400, and an embedding server
answers the generating routes with one.

``input``: a string, a list of strings, a list of token ids, or a list of such lists (ids are
taken as they are; text is tokenized with the tokenizer's special tokens, as ``tfm.embed`` does).
An input longer than the model's length is a 400 naming it (not cut silently).
``encoding_format``: ``float`` (lists of numbers) or ``base64`` (the float32 little-endian bytes,
as OpenAI sends them). ``usage`` counts the inputs' tokens.
"""

from __future__ import annotations

import base64
import struct

from .protocol import APIError, bad, check_fields, check_model_name

FIELDS = {"model", "input", "encoding_format"}
MAX_INPUTS = 2048  # OpenAI's limit on inputs per request
FORMATS = ("float", "base64")


def embedding_request(body, served: str) -> tuple[list, str]:
    """(inputs, encoding_format): inputs a list of strings and id lists."""
    check_fields(body, FIELDS | {"dimensions"})
    check_model_name(body, served)
    if body.get("dimensions") is not None:
        raise bad("dimensions", f"{body['dimensions']!r}: not supported (embeddings have the model's width)")
    fmt = body.get("encoding_format") or "float"
    if fmt not in FORMATS:
        raise bad("encoding_format", f"{fmt!r} must be one of {list(FORMATS)}")
    value = body.get("input")
    items = [value] if isinstance(value, str) or (is_ids(value) and value) else value
    if not isinstance(items, list) or not items or len(items) > MAX_INPUTS:
        raise bad(
            "input", f"must be a string, a list of token ids, or a non-empty list of at most {MAX_INPUTS} of them"
        )
    for i, item in enumerate(items):
        if not (isinstance(item, str) and item) and not (is_ids(item) and item):
            raise bad(f"input[{i}]", "must be a non-empty string or a non-empty list of token ids")
    return items, fmt


def is_ids(value) -> bool:
    return isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)


def token_rows(items: list, tokenizer, vocab_size: int, limit: int) -> list[list[int]]:
    """Each input as token ids, checked against the vocabulary and the model's length."""
    rows = []
    for i, item in enumerate(items):
        param = "input" if len(items) == 1 else f"input[{i}]"
        if isinstance(item, str):
            if tokenizer is None:
                raise APIError(
                    400,
                    f"{param}: this model has no tokenizer.json, so it embeds token ids only",
                    param=param,
                    code="no_tokenizer",
                )
            row = tokenizer.encode(item).ids  # with the special tokens, as tfm.embed encodes
        else:
            row = item
            if not all(0 <= t < vocab_size for t in row):
                raise bad(param, f"token ids must be in [0, vocab_size={vocab_size})")
        if len(row) > limit:
            raise APIError(
                400,
                f"{param}: {len(row)} tokens; this model embeds at most {limit}. Please shorten the input.",
                param=param,
                code="context_length_exceeded",
            )
        rows.append(row)
    return rows


def encoded(vector: list[float], fmt: str):
    if fmt == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


def embedding_response(vectors: list[list[float]], fmt: str, model: str, tokens: int) -> dict:
    data = [{"object": "embedding", "index": i, "embedding": encoded(v, fmt)} for i, v in enumerate(vectors)]
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def wrong_task(task: str) -> APIError:
    """The 400 of a route this server's model does not serve."""
    if task == "embed":
        message = "this server embeds (an encoder model): use /v1/embeddings; it does not generate text"
    else:
        message = "this server generates text (a decoder model); /v1/embeddings needs an encoder model (e.g. MiniLM)"
    return APIError(400, message, param="model", code="model_not_supported")
