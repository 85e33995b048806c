"""A self-contained interactive attention explorer: one HTML file, no network.

``to_html(recording, tokens)`` turns a Recording into a page with a model view (layers x heads
thumbnails, each captioned with its ``head_stats``) and a head view (the tokens on both sides,
lines weighted by attention; hover a token to see where it looks and what looks at it), in the
manner of bertviz's head and model views (Vig 2019) but without a notebook kernel: the weights
are embedded as base64 float32 and drawn by the inline script ``explorer.js``; CSS, script and
data are all inline, so the file opens offline and makes no request.

Legend: B batch, H heads, T queries, S keys. Padded positions (0 in ``mask``) are dropped from
the page; the statistics are computed on the full row with the same mask, as ``head_stats`` does.
"""

from __future__ import annotations

import base64
import html
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from torch import Tensor

from .files import write_file
from .record import Capture, Recording
from .stats import head_stats

# (stack, kind) -> heading, in page order; decoders and encoders record as stack "stack".
GROUPS = {
    ("encoder", "self"): "encoder self-attention",
    ("decoder", "self"): "decoder self-attention",
    ("decoder", "cross"): "decoder cross-attention",
    ("stack", "self"): "self-attention",
}


@dataclass(frozen=True)
class AttentionHTML:
    """The explorer page. ``save(path)`` writes it; in Jupyter it renders inline."""

    html: str

    def save(self, path: str | os.PathLike) -> Path:
        """Write the page to ``path`` (atomically: a reader sees the old file or the new one)."""
        return write_file(path, self.html.encode("utf-8"))

    def _repr_html_(self) -> str:
        # An iframe keeps the page's script and styles apart from the notebook's own.
        doc = html.escape(self.html, quote=True)
        return f'<iframe srcdoc="{doc}" style="width:100%;height:720px;border:0"></iframe>'


def _mask_row(mask: Tensor | Sequence[int] | None, name: str, B: int, n: int, batch_index: int) -> Tensor | None:
    """The 1/0 mask of row ``batch_index`` (given as (n,) or as the batch's (B, n)) as bool (n,)."""
    if mask is None:
        return None
    m = torch.as_tensor(mask)
    if m.shape != (n,) and m.shape != (B, n):
        raise ValueError(f"{name} has shape {tuple(m.shape)}; expected ({n},) or (B, {n}) = {(B, n)}")
    row = (m if m.dim() == 1 else m[batch_index]).bool()
    if not row.any():
        raise ValueError(f"{name} row {batch_index} marks no real token")
    return row


def _check_tokens(tokens: Sequence[str] | None, name: str) -> list[str] | None:
    if tokens is None:
        return None
    if isinstance(tokens, str) or not all(isinstance(t, str) for t in tokens):
        raise TypeError(f"{name} must be a list of token strings, got {type(tokens).__name__}")
    if not tokens:
        raise ValueError(f"{name} is empty: give one label per position")
    return list(tokens)


def _encode(weights: Tensor) -> str:
    """(H, T, S) float32 little-endian bytes as base64: exact, and ~5.3 characters per weight."""
    data = weights.detach().to(torch.float32).cpu().contiguous().numpy().astype("<f4").tobytes()
    return base64.b64encode(data).decode("ascii")


def _layer(c: Capture, b: int, heads: list[int], q_keep: Tensor, k_keep: Tensor, q_mask: Tensor | None) -> dict:
    stats = head_stats(c.weights[b : b + 1], mask=None if q_mask is None else q_mask[None])
    kept = c.weights[b][heads][:, q_keep][:, :, k_keep]  # (H', T', S') real positions only
    exact = [[float(stats.entropy[h]), float(stats.max_weight[h]), float(stats.distance[h])] for h in heads]
    return {
        "name": c.name,
        "layer": c.layer,
        "heads": heads,
        "stats": [[f"{e:.2f}", f"{m:.2f}", f"{d:.1f}"] for e, m, d in exact],
        "exact": exact,
        "weights": _encode(kept),
    }


def _group(caps: list[Capture], title: str, q_tok, k_tok, q_mask, k_mask, b: int, heads) -> dict:
    T, S = len(q_tok), len(k_tok)
    for c in caps:
        shape = tuple(c.weights.shape)
        if len(shape) != 4 or shape[2:] != (T, S) or not 0 <= b < shape[0]:
            raise ValueError(
                f"{c.name} recorded weights of shape {shape}; {title} needs (B, H, {T}, {S}) for {T} query and "
                f"{S} key tokens with batch_index={b} (record one full forward, not a cached decoding step)"
            )
    H = caps[0].weights.shape[1]
    chosen = list(range(H)) if heads is None else list(heads)
    bad = [h for h in chosen if not isinstance(h, int) or not 0 <= h < H]
    if bad or not chosen:
        raise ValueError(f"heads={list(heads)!r}: must be a non-empty list of head indices in [0, {H})")
    q_keep = torch.arange(T) if q_mask is None else q_mask.nonzero().flatten()
    k_keep = torch.arange(S) if k_mask is None else k_mask.nonzero().flatten()
    return {
        "title": title,
        "queries": [q_tok[i] for i in q_keep.tolist()],
        "keys": [k_tok[j] for j in k_keep.tolist()],
        "layers": [_layer(c, b, chosen, q_keep, k_keep, q_mask) for c in sorted(caps, key=lambda c: c.layer)],
    }


def to_html(
    recording: Recording,
    tokens: Sequence[str],
    *,
    target_tokens: Sequence[str] | None = None,
    mask: Tensor | Sequence[int] | None = None,
    target_mask: Tensor | Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    batch_index: int = 0,
    title: str = "attention",
) -> AttentionHTML:
    """The explorer for the latest call of every recorded module, one row ``batch_index``.

    tokens label row ``batch_index`` of the input (the source of an encoder-decoder); target_tokens
    the decoder input of an encoder-decoder (default: tokens). mask / target_mask (B, T) or (T,): 1 real, 0 padding;
    padded positions are not drawn. heads: a subset of heads to show (default all).
    """
    if not isinstance(recording, Recording):
        raise TypeError(f"recording must be a Recording from record_attention, got {type(recording).__name__}")
    if not recording.captures:
        raise ValueError("recording has no captures: run the model inside `with record_attention(model) as rec:`")
    B = recording.captures[0].weights.shape[0]
    if not isinstance(batch_index, int) or not 0 <= batch_index < B:
        raise ValueError(f"batch_index={batch_index!r}: must be an int in [0, {B}) (the recorded batch)")
    src = _check_tokens(tokens, "tokens")
    tgt = _check_tokens(target_tokens, "target_tokens") or src
    known = {(c.stack, c.kind) for c in recording.captures}
    if not known <= set(GROUPS):
        raise ValueError(f"recording holds (stack, kind) {sorted(known)}; the explorer draws {list(GROUPS)}")
    src_mask = _mask_row(mask, "mask", B, len(src), batch_index)
    tgt_mask = src_mask if target_tokens is None else _mask_row(target_mask, "target_mask", B, len(tgt), batch_index)
    groups = []
    for (stack, kind), heading in GROUPS.items():
        caps = recording.select(kind=kind, stack=stack)
        if caps:
            q_tok, q_mask = (tgt, tgt_mask) if stack == "decoder" else (src, src_mask)
            k_tok, k_mask = (src, src_mask) if kind == "cross" else (q_tok, q_mask)
            groups.append(_group(caps, heading, q_tok, k_tok, q_mask, k_mask, batch_index, heads))
    return AttentionHTML(page({"title": title, "groups": groups}))


def _asset(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def page(data: dict) -> str:
    """The HTML document: inline CSS, the data as JSON, the inline script. ``<`` is escaped in
    the JSON so that no token text (``</script>``, ``<!--``) can end the data block."""
    blob = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    blob = blob.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{html.escape(data['title'])}</title>\n"
        '<link rel="icon" href="data:,">\n'  # no favicon request
        f"<style>\n{_asset('explorer.css')}</style>\n</head>\n<body>\n"
        '<main id="tf-app"></main>\n'
        f'<script type="application/json" id="tf-data">{blob}</script>\n'
        f"<script>\n{_asset('explorer.js')}</script>\n</body>\n</html>\n"
    )
