"""What a run reports: the reporter protocol the CLI implements (progress bar, eval lines),
metrics.jsonl (one JSON object per evaluation) and the loss-curve PNG. Library code only logs."""

from __future__ import annotations

import json
import logging
import math
import warnings
from pathlib import Path
from typing import Any

log = logging.getLogger("torchformer.train")


class Reporter:
    """Receives events from ``train``; the default logs them. The CLI subclasses it with tqdm."""

    def start(self, info: dict[str, Any]) -> None:
        log.info("training %s", info)

    def step(self, info: dict[str, Any]) -> None:
        log.debug("step %s", info)

    def evaluate(self, info: dict[str, Any]) -> None:
        log.info("eval step %d: val_loss %.4f, ppl %.2f", info["step"], info["val_loss"], info["val_ppl"])

    def message(self, text: str) -> None:
        log.info("%s", text)

    def close(self) -> None:
        return None


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))


def append_metrics(path: Path, row: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_metrics(path: Path, step: int) -> None:
    """Drop rows after ``step`` (a resumed run re-does those steps and re-logs them)."""
    rows = [r for r in read_metrics(path) if r["step"] <= step]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def plot_losses(metrics_file: Path, out: Path) -> Path | None:
    """Train and validation loss against step, as a PNG. None (and a warning) without matplotlib."""
    rows = read_metrics(metrics_file)
    if not rows:
        return None
    try:  # optional: the viz extra
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn("no loss plot: matplotlib is missing (pip install 'torchformer[viz]')", stacklevel=2)
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    trained = [r for r in rows if r["train_loss"] is not None]  # step 0 has no training loss yet
    ax.plot([r["step"] for r in trained], [r["train_loss"] for r in trained], label="train")
    ax.plot([r["step"] for r in rows], [r["val_loss"] for r in rows], label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
