"""Pictures of attention: a layer x head grid of heatmaps (PNG, matplotlib from the `viz` extra)
and an ASCII map for terminals, where denser characters mean larger weights.

The grid is sized from the token count so its labels stay legible at the saved size: every text
is at least LABEL_PT points, a panel grows with the sequence up to a cap that keeps the figure
near 16 inches, and when the tokens do not fit a panel at that size every k-th one is labelled.
Each panel's title carries the head's ``head_stats`` (entropy, max weight, distance).
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from .files import check_file_path, write_file
from .stats import head_stats

RAMP = " .:-=+*#%@"  # light to dense
LABEL_PT = 6.5  # the smallest text on a figure (token labels); titles are TITLE_PT
TITLE_PT = 7.0
PITCH_IN = LABEL_PT * 1.35 / 72  # inches one label line needs along an axis, with leading
MAX_FIGURE_IN = 16.0  # the grid's longer side, before the colour bar
LABEL_CHARS = 10  # longer tokens are cut, so rotated labels do not eat the panel
DPI = 110


def ascii_attention(
    matrix: Tensor, labels: Sequence[str] | None = None, key_labels: Sequence[str] | None = None, width: int = 4
) -> str:
    """One head's (T, S) weights as text: one row per query, one character per key, chosen from
    RAMP by the weight relative to the largest weight of its row (early queries, which see few
    keys, would otherwise outshine every later row). Row labels are the queries'."""
    if matrix.dim() != 2:
        raise ValueError(f"matrix must be (T, S), got shape {tuple(matrix.shape)}")
    m = matrix.detach().float()
    top = m.amax(-1, keepdim=True).clamp_min(torch.finfo(m.dtype).tiny)  # (T, 1)
    levels = (m / top * (len(RAMP) - 1)).round().long().clamp(0, len(RAMP) - 1)
    labels = [str(i) for i in range(m.shape[0])] if labels is None else [_printable(s) for s in labels]
    lines = []
    if key_labels is not None:
        keys = [_printable(s)[:1] or " " for s in key_labels]
        lines.append(" " * (width + 1) + "".join(keys))
    for label, row in zip(labels, levels.tolist()):
        lines.append(f"{label[:width]:>{width}} " + "".join(RAMP[v] for v in row))
    return "\n".join(lines)


def _printable(token: str, space: str = "\u2423") -> str:
    return token.replace("\n", "\u21b5").replace("\t", "\u2192").replace(" ", space)


def panel_inches(n_tokens: int, rows: int, cols: int) -> float:
    """A panel's side: room for one label per token, capped so the grid stays near MAX_FIGURE_IN."""
    cap = max(2.4, MAX_FIGURE_IN / max(rows, cols))
    return min(cap, max(1.8, 1.2 * n_tokens * PITCH_IN))


def label_step(n: int, inches: float) -> int:
    """Label every k-th of n tokens so that labels PITCH_IN apart fit in ``inches``."""
    return max(1, math.ceil(n / max(1, math.floor(inches / PITCH_IN))))


def attention_figure(
    weights: Sequence[Tensor],
    *,
    tokens: Sequence[str] | None = None,
    key_tokens: Sequence[str] | None = None,
    titles: Sequence[str] | None = None,
    heads: Sequence[int] | None = None,
    batch_index: int = 0,
    mask: Tensor | None = None,
    cell: float | None = None,
):
    """The layer x head grid as a matplotlib Figure (see ``plot_attention``)."""
    plt = _pyplot()
    from matplotlib.colors import PowerNorm

    _check(weights, tokens, key_tokens, titles, heads, batch_index)
    heads = list(range(weights[0].shape[1])) if heads is None else list(heads)
    rows, cols = len(weights), len(heads)
    T, S = weights[0].shape[2], weights[0].shape[3]
    cell = panel_inches(max(T, S), rows, cols) if cell is None else cell
    fig, axes = plt.subplots(
        rows, cols, figsize=(cell * cols + 1.4, cell * rows + 0.8), squeeze=False, layout="constrained"
    )
    norm = PowerNorm(gamma=0.5, vmin=0.0, vmax=1.0)
    for r, layer in enumerate(weights):
        row_mask = None if mask is None else mask[batch_index : batch_index + 1]
        stats = head_stats(layer[batch_index : batch_index + 1], mask=row_mask)
        for c, h in enumerate(heads):
            ax = axes[r][c]
            image = ax.imshow(layer[batch_index, h].detach().float().cpu().numpy(), cmap="viridis", norm=norm)
            ax.set_aspect("auto")
            name = titles[r] if titles else f"layer {r}"
            line = f"ent {float(stats.entropy[h]):.2f}  max {float(stats.max_weight[h]):.2f}  "
            ax.set_title(f"{name} head {h}\n{line}dist {float(stats.distance[h]):.1f}", fontsize=TITLE_PT)
            ax.set_xticks([])
            ax.set_yticks([])
    bar = fig.colorbar(image, ax=axes.ravel().tolist(), shrink=min(1.0, 3.0 / (cell * rows)), pad=0.01)
    bar.set_label("attention weight (square-root scale)", fontsize=LABEL_PT)
    bar.ax.tick_params(labelsize=LABEL_PT)
    keys = key_tokens if key_tokens is not None else tokens
    fig.draw_without_rendering()  # lay out once, then thin labels to the panels' real size
    for ax in axes[:, 0]:
        _label(ax, "y", tokens, fig)
    for ax in axes[-1, :]:
        _label(ax, "x", keys, fig)
    return fig


def plot_attention(
    weights: Sequence[Tensor],
    path: str | os.PathLike,
    *,
    tokens: Sequence[str] | None = None,
    key_tokens: Sequence[str] | None = None,
    titles: Sequence[str] | None = None,
    heads: Sequence[int] | None = None,
    batch_index: int = 0,
    mask: Tensor | None = None,
    cell: float | None = None,
) -> Path:
    """Write a grid of heatmaps (rows = the given layers' (B, H, T, S) weights, columns = heads)
    with query/key token labels to ``path`` (PNG). Returns the path.

    tokens label the queries, key_tokens the keys (default tokens); titles name the layers; heads
    picks a subset; mask (B, T) marks real queries for the statistics; cell is inches per panel
    (default from the token count). Colours use a square-root scale over [0, 1], so weights of a
    few percent stay visible next to a query that puts all its weight on one key; each panel's
    title has the head's mean entropy (nats), max weight and distance (tokens).
    """
    path = check_file_path(path)
    fig = attention_figure(
        weights,
        tokens=tokens,
        key_tokens=key_tokens,
        titles=titles,
        heads=heads,
        batch_index=batch_index,
        mask=mask,
        cell=cell,
    )
    return save_png(fig, path)


def save_png(fig, path: str | os.PathLike) -> Path:
    """Render ``fig`` to PNG bytes, close it, then write the file atomically."""
    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format="png", dpi=DPI)
    finally:
        _pyplot().close(fig)
    return write_file(path, buffer.getvalue())


def _pyplot():
    from ..extras import require

    matplotlib = require("matplotlib")
    matplotlib.use("Agg")  # files only: never open a window
    return require("matplotlib.pyplot")


def _check(weights, tokens, key_tokens, titles, heads, batch_index) -> None:
    """Argument errors before any drawing."""
    if not weights:
        raise ValueError("weights is empty: give at least one layer's (B, H, T, S) weights")
    shape = tuple(weights[0].shape)
    if any(not isinstance(w, Tensor) or w.dim() != 4 or tuple(w.shape) != shape for w in weights):
        raise ValueError(f"weights must be (B, H, T, S) tensors of one shape, got {[tuple(w.shape) for w in weights]}")
    B, H, T, S = shape
    if not 0 <= batch_index < B:
        raise ValueError(f"batch_index={batch_index}: must be in [0, {B})")
    if heads is not None and (not list(heads) or any(not 0 <= h < H for h in heads)):
        raise ValueError(f"heads={list(heads)!r}: must be a non-empty list of head indices in [0, {H})")
    if titles is not None and len(titles) != len(weights):
        raise ValueError(f"titles has {len(titles)} entries for {len(weights)} layers")
    for name, labels, n in (("tokens", tokens, T), ("key_tokens", key_tokens if key_tokens is not None else tokens, S)):
        if labels is not None and len(labels) != n:
            raise ValueError(f"{name} has {len(labels)} labels for {n} positions")


def _label(ax, axis: str, labels: Sequence[str] | None, fig) -> None:
    """Token labels on one axis of an outer panel, every k-th one where they would not fit."""
    if labels is None:
        return
    box = ax.get_window_extent().transformed(fig.dpi_scale_trans.inverted())  # inches
    step = label_step(len(labels), box.height if axis == "y" else box.width)
    where = list(range(0, len(labels), step))
    text = [_printable(labels[i], "_")[:LABEL_CHARS] for i in where]
    if axis == "y":
        ax.set_yticks(where, text, fontsize=LABEL_PT)
    else:
        # Upright when every label is a character or two (char-level models), else rotated.
        ax.set_xticks(where, text, fontsize=LABEL_PT, rotation=90 if max(map(len, text)) > 2 else 0)
    if step > 1:  # say that labels were thinned, and how
        getattr(ax, f"set_{axis}label")(f"1 token in {step} labelled", fontsize=LABEL_PT)
