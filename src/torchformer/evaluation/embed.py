"""Sentence embeddings from an encoder: pool the final hidden states over the real tokens, then
L2-normalise (Reimers & Gurevych 2019, Sentence-BERT; the sentence-transformers recipe).

A sentence-transformers folder says how: ``1_Pooling/config.json`` (pooling_mode_mean_tokens,
_cls_token, _max_tokens, _mean_sqrt_len_tokens), ``modules.json`` (a Normalize module or not) and
``sentence_bert_config.json`` (max_seq_length). Without them: mean pooling, normalised, the
model's max_seq_len. Texts are batched with right padding; padding never enters a pool.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# hidden (B, T, D), mask (B, T) of 1 for real tokens -> (B, D)
Pool = Callable[[Tensor, Tensor], Tensor]


def mean_pool(hidden: Tensor, mask: Tensor) -> Tensor:
    m = mask[..., None].to(hidden.dtype)  # (B, T, 1)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)


def mean_sqrt_len_pool(hidden: Tensor, mask: Tensor) -> Tensor:
    m = mask[..., None].to(hidden.dtype)  # (B, T, 1)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9).sqrt()


def cls_pool(hidden: Tensor, mask: Tensor) -> Tensor:
    return hidden[:, 0]


def max_pool(hidden: Tensor, mask: Tensor) -> Tensor:
    return hidden.masked_fill(mask[..., None] == 0, float("-inf")).amax(1)


POOLINGS: dict[str, Pool] = {"mean": mean_pool, "cls": cls_pool, "max": max_pool, "mean_sqrt_len": mean_sqrt_len_pool}
_ST_KEYS = {
    "mean": "pooling_mode_mean_tokens",
    "cls": "pooling_mode_cls_token",
    "max": "pooling_mode_max_tokens",
    "mean_sqrt_len": "pooling_mode_mean_sqrt_len_tokens",
}


def folder_settings(folder: str | os.PathLike) -> dict:
    """pooling, normalize and max_length as the sentence-transformers files of ``folder`` say."""
    folder, out = Path(folder), {"pooling": "mean", "normalize": True, "max_length": None}
    pooling_file = folder / "1_Pooling" / "config.json"
    if pooling_file.is_file():
        raw = json.loads(pooling_file.read_text())
        modes = [name for name, key in _ST_KEYS.items() if raw.get(key)]
        if len(modes) != 1:
            raise ValueError(
                f"{pooling_file}: exactly one pooling mode must be on, found {modes or 'none'}; "
                f"supported: {[_ST_KEYS[k] for k in POOLINGS]}"
            )
        out["pooling"] = modes[0]
    modules_file = folder / "modules.json"
    if modules_file.is_file():
        kinds = [m.get("type", "") for m in json.loads(modules_file.read_text())]
        out["normalize"] = any(k.endswith(".Normalize") for k in kinds)
    st_config = folder / "sentence_bert_config.json"
    if st_config.is_file():
        out["max_length"] = json.loads(st_config.read_text()).get("max_seq_length")
    return out


def embed(
    model: nn.Module | str | os.PathLike,
    texts: str | Sequence[str],
    *,
    tokenizer=None,
    pooling: str | None = None,
    normalize: bool | None = None,
    batch_size: int = 32,
    max_length: int | None = None,
) -> Tensor:
    """(len(texts), D) sentence embeddings. ``model`` is an encoder or a folder (its tokenizer.json
    and sentence-transformers settings are read); pooling/normalize/max_length override them."""
    from ..loading import load_any, load_tokenizer

    texts = [texts] if isinstance(texts, str) else list(texts)
    if not texts or not all(isinstance(t, str) for t in texts):
        raise TypeError(f"texts={texts!r}: must be a string or a non-empty list of strings")
    settings = {"pooling": "mean", "normalize": True, "max_length": None}
    if isinstance(model, (str, os.PathLike)):
        folder = Path(model)
        settings = folder_settings(folder) if folder.is_dir() else settings
        tokenizer = load_tokenizer(folder) if tokenizer is None else tokenizer
        model = load_any(folder)
    given = {"pooling": pooling, "normalize": normalize, "max_length": max_length}
    settings.update({k: v for k, v in given.items() if v is not None})
    _check(model, tokenizer, settings, batch_size)
    limit = min(settings["max_length"] or model.config.max_seq_len, model.config.max_seq_len)
    tokenizer.no_padding()  # a folder's tokenizer.json may pad every input to a fixed width
    tokenizer.no_truncation()
    rows = [e.ids[:limit] for e in tokenizer.encode_batch(texts)]
    return embed_ids(model, rows, pooling=settings["pooling"], normalize=settings["normalize"], batch_size=batch_size)


def embed_ids(model: nn.Module, rows: list[list[int]], *, pooling: str, normalize: bool, batch_size: int) -> Tensor:
    """(len(rows), D) embeddings of token-id rows, as ``embed`` makes them from its texts' ids
    (the server's /v1/embeddings takes ids too)."""
    pool, out = POOLINGS[pooling], []
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    with torch.no_grad():
        for i in range(0, len(rows), batch_size):
            ids, mask = _pad(rows[i : i + batch_size], pad, next(model.parameters()).device)
            pooled = pool(model(ids, attention_mask=mask), mask)  # (B, D)
            out.append(F.normalize(pooled, dim=-1) if normalize else pooled)
    return torch.cat(out)


def _pad(rows: list[list[int]], pad: int, device) -> tuple[Tensor, Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=device)  # (B, T)
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=device)  # (B, T)
    return ids, mask


def _check(model: nn.Module, tokenizer, settings: dict, batch_size: int) -> None:
    cfg = getattr(model, "config", None)
    if cfg is None or cfg.arch != "encoder":
        arch = getattr(cfg, "arch", type(model).__name__)
        raise ValueError(f"embed needs an encoder model (arch 'encoder', e.g. BERT / MiniLM), got {arch!r}")
    if tokenizer is None or not hasattr(tokenizer, "encode_batch"):
        raise TypeError(f"tokenizer={tokenizer!r}: pass a tokenizers.Tokenizer (or a model folder with tokenizer.json)")
    if settings["pooling"] not in POOLINGS:
        raise ValueError(f"pooling={settings['pooling']!r}: must be one of {list(POOLINGS)}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}: must be an integer >= 1")
