"""Pictures of attention: a layer x head grid of heatmaps (PNG, matplotlib from the `viz` extra)
and an ASCII map for terminals, where denser characters mean larger weights."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

RAMP = " .:-=+*#%@"  # light to dense


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


def plot_attention(
    weights: Sequence[Tensor],
    path: str | os.PathLike,
    *,
    tokens: Sequence[str] | None = None,
    key_tokens: Sequence[str] | None = None,
    titles: Sequence[str] | None = None,
    heads: Sequence[int] | None = None,
    batch_index: int = 0,
    cell: float | None = None,
) -> Path:
    """Write a grid of heatmaps (rows = the given layers' (B, H, T, S) weights, columns = heads)
    with query/key token labels to ``path`` (PNG). Returns the path.

    Colours use a square-root scale over [0, 1], so weights of a few percent stay visible next
    to a query that puts all its weight on one key. cell: inches per panel (default grows with T).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: never open a window
        import matplotlib.pyplot as plt
    except ImportError as err:  # pragma: no cover - the viz extra installs it
        raise ImportError("plot_attention needs matplotlib: pip install 'torchformer[viz]'") from err
    if not weights:
        raise ValueError("weights is empty: give at least one layer's (B, H, T, S) weights")
    from matplotlib.colors import PowerNorm

    heads = list(range(weights[0].shape[1])) if heads is None else list(heads)
    rows, cols = len(weights), len(heads)
    cell = min(4.0, max(1.6, 0.06 * weights[0].shape[2])) if cell is None else cell
    fig, axes = plt.subplots(rows, cols, figsize=(cell * cols + 1, cell * rows + 0.6), squeeze=False)
    for r, layer in enumerate(weights):
        for c, h in enumerate(heads):
            ax = axes[r][c]
            matrix = layer[batch_index, h].detach().float().cpu().numpy()
            ax.imshow(matrix, cmap="viridis", norm=PowerNorm(gamma=0.5, vmin=0.0, vmax=1.0))
            ax.set_title(f"{titles[r] if titles else f'layer {r}'} head {h}", fontsize=7)
            _label(ax, tokens, key_tokens, layer.shape[2], layer.shape[3], r == rows - 1, c == 0)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _label(ax, tokens, key_tokens, T: int, S: int, bottom: bool, left: bool) -> None:
    """Token labels on the outer edges only (long sequences get bare ticks)."""
    keys = key_tokens if key_tokens is not None else tokens
    ax.set_xticks([])
    ax.set_yticks([])
    if left and tokens is not None and len(tokens) == T and T <= 64:
        ax.set_yticks(range(T), [_printable(t, "_") for t in tokens], fontsize=5)
    if bottom and keys is not None and len(keys) == S and S <= 64:
        ax.set_xticks(range(S), [_printable(t, "_") for t in keys], fontsize=5, rotation=90)
