"""Looking inside models: attention capture, head statistics, plots, the HTML explorer and cost accounting."""

from .accounting import (
    activation_bytes,
    count_params,
    flops_per_token,
    kv_cache_bytes,
    matmul_peak_flops,
    mfu,
    param_breakdown,
    training_bytes,
)
from .html import AttentionHTML, to_html
from .plots import ascii_attention, attention_figure, plot_attention
from .record import Capture, Recording, record_attention
from .stats import HeadStats, head_stats

__all__ = [
    "AttentionHTML",
    "Capture",
    "HeadStats",
    "Recording",
    "activation_bytes",
    "ascii_attention",
    "attention_figure",
    "count_params",
    "flops_per_token",
    "head_stats",
    "kv_cache_bytes",
    "matmul_peak_flops",
    "mfu",
    "param_breakdown",
    "plot_attention",
    "record_attention",
    "to_html",
    "training_bytes",
]
