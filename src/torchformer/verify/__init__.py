"""``verify(model)``: the seed's correctness checks, runnable on any torchformer model.

Each check returns a Row (check, measured value, threshold, pass/fail, a message naming the
fault); ``Report.ok`` is False when any check failed. Checks:

- causality: changing token t leaves outputs before t exactly unchanged (is_causal and mask paths);
  encoders instead must be bidirectional;
- cached == uncached: prefill + token-by-token through the static cache == one full forward;
- math == sdpa: the math reference, SDPA and the model's own backend agree on a padded batch;
- padding invariance: a padded row's outputs == the row alone;
- relative positions (RoPE, ALiBi, relative bias): shifting all positions changes nothing; for
  RoPE also <R_m q, R_n k> depends only on m - n;
- masked keys zero weight: recorded weights are exactly 0 on future / padding / out-of-window
  keys and each real query's row sums to 1;
- score scale: unit-variance q, k give scaled scores of std ~1 through each layer's backend;
- fp16/bf16 attention: each backend stays finite and accurate on |q.k| up to 2^17;
- fp16/bf16 forward: no NaN/inf at the longest length (capped on CPU, see numerics.py);
- softmax saturation (warning) and, for an untrained model, initial loss ~ ln(V).
"""

from __future__ import annotations

from torch import nn

from .attention_checks import fp16_headroom, masked_keys, score_scale
from .model_checks import backend_parity, cached_equals_uncached, causality, padding_invariance, relative_positions
from .numerics import CPU_FLOP_BUDGET, initial_loss, low_precision, saturation
from .probes import Runner
from .report import Report, Row
from .shrink import shrink_config

__all__ = ["Report", "Row", "shrink_config", "verify"]


def verify(
    model: nn.Module,
    *,
    untrained: bool | None = None,
    seq_len: int = 16,
    seed: int = 0,
    flop_budget: float | None = CPU_FLOP_BUDGET,
) -> Report:
    """Run every check on ``model`` (a DecoderLM, Encoder or EncoderDecoder) and return a Report.

    untrained: check the initial loss (True), skip it (False) or decide from the weights (None:
    untrained when every norm weight is 1 and every bias 0, as build_model leaves them).
    seq_len: length of the probe sequences (capped at max_seq_len).
    flop_budget: FLOPs allowed for each fp16/bf16 forward on CPU (None: always max_seq_len).
    The model is put in eval mode for the checks and its mode and backends are restored.
    """
    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"verify needs a torchformer model (built by build_model), got {type(model).__name__}")
    if not isinstance(seq_len, int) or seq_len < 4:
        raise ValueError(f"seq_len={seq_len!r}: must be an integer >= 4")
    was_training = model.training
    model.eval()
    try:
        with _no_grad():
            r = Runner(model, seq_len, seed)
            rows = [
                causality(r),
                cached_equals_uncached(r),
                backend_parity(r),
                padding_invariance(r),
                relative_positions(r),
                masked_keys(r),
                score_scale(r),
                saturation(r),
                fp16_headroom(r),
                low_precision(r, flop_budget),
                initial_loss(r, untrained),
            ]
    finally:
        model.train(was_training)
    return Report(rows=rows)


def _no_grad():
    import torch

    return torch.no_grad()
