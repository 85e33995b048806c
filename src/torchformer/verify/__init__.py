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

import torch
from torch import nn

from .attention_checks import fp16_headroom, masked_keys, score_scale
from .model_checks import backend_parity, cached_equals_uncached, causality, padding_invariance, relative_positions
from .numerics import CPU_FLOP_BUDGET, initial_loss, low_precision, saturation
from .probes import Runner
from .report import FAIL, Report, Row
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
        with torch.no_grad():
            checks = {
                "causality": causality,
                "cached == uncached": cached_equals_uncached,
                "math == sdpa": backend_parity,
                "padding invariance": padding_invariance,
                "relative positions": relative_positions,
                "masked keys zero weight": masked_keys,
                "score scale": score_scale,
                "softmax saturation": saturation,
                "fp16/bf16 attention": fp16_headroom,
                "fp16/bf16 forward": lambda r: low_precision(r, flop_budget),
                "initial loss ~ ln(V)": lambda r: initial_loss(r, untrained),
            }
            rows = [_run(name, check, Runner(model, seq_len, seed)) for name, check in checks.items()]
    finally:
        model.train(was_training)
    return Report(rows=rows)


def _run(name: str, check, runner: Runner) -> Row:
    """One check; an exception inside it becomes a failing row, so one broken part of a model
    does not hide the other checks' results."""
    try:
        return check(runner)
    except Exception as err:  # reported in the table, not swallowed
        return Row(name, None, "-", FAIL, f"the check raised {type(err).__name__}: {err}")
