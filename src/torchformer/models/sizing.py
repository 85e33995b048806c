"""A model too large for this machine is refused before it is built (training/recipe.py asks at
recipe time): its size from meta-device builds, which need no memory."""

from __future__ import annotations

import os

import torch

from .build import build_model


def check_fits_memory(cfg, where: str) -> None:
    """A model larger than this machine's memory is refused before it is built: building 1e9
    layers would fill the memory for minutes before failing. Its size is extrapolated from
    meta-device builds (no memory) of one and two layers per stack, exact for uniform layers;
    configs whose layers differ by position (layer_kinds) are not estimated."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no sysconf here
        return
    # Arithmetic first: the token table, a norm per layer and a RoPE table (built on the CPU even
    # for a meta model) are a lower bound that needs no build.
    floor = cfg.vocab_size * cfg.d_model + cfg.n_layers * cfg.d_model + cfg.max_seq_len * cfg.head_dim
    if 4 * floor > memory:
        _too_big(cfg, floor, memory, where, "at least ")
    try:
        one = _meta_params(cfg, 1)
        two = _meta_params(cfg, 2)
    except ValueError:  # per-layer settings (layer_kinds) tie n_layers
        return
    except (RuntimeError, OverflowError, MemoryError) as err:  # "Storage size calculation overflowed"
        raise ValueError(f"{where}: sizes too large to build a model from (d_model={cfg.d_model}): {err}") from None
    params = one + (two - one) * (cfg.n_layers - 1)
    if 4 * params > memory:
        _too_big(cfg, params, memory, where, "about ")


def _too_big(cfg, params: int, memory: int, where: str, about: str) -> None:
    raise ValueError(
        f"{where}: n_layers={cfg.n_layers}, d_model={cfg.d_model} make a model of {about}{params:,} parameters "
        f"({4 * params / 2**30:,.0f} GiB in fp32), more than this machine's {memory / 2**30:.0f} GiB of memory"
    )


def _meta_params(cfg, n_layers: int) -> int:
    decoder = None if cfg.n_decoder_layers is None else n_layers  # one layer per stack, then two
    with torch.device("meta"):
        model = build_model(cfg.replace(n_layers=n_layers, n_decoder_layers=decoder))
    return sum(p.numel() for p in model.parameters())
