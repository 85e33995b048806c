"""RoPE settings of a config.json <-> ``RoPE(base, fraction, scaling)``.

Reads transformers 5.x ``rope_parameters`` and 4.x top-level ``rope_theta`` + ``rope_scaling``
(``type`` or ``rope_type``); writes the 5.x form plus a top-level ``rope_theta`` for 4.x readers.
Key names are transformers' (``modeling_rope_utils.py``): original_max_position_embeddings is
our original_max_seq_len. For llama3, yarn and longrope, HF's max_position_embeddings is the
extended context (our max_seq_len); for dynamic it is the original one, and the model's
max_seq_len becomes factor times it (the context the scaling is for).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..configs import SCALING_KIND_OF, DynamicNTK, LinearScaling, Llama3Scaling, LongRoPE, ModelConfig, RoPE, YaRN

SUPPORTED = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
HF_NAMES = {"original_max_seq_len": "original_max_position_embeddings"}  # ours -> theirs, where they differ


class _Missing(Exception):
    pass


def _need(params: dict[str, Any], key: str) -> Any:
    if key not in params:
        raise _Missing(key)
    return params[key]


def _original(params: dict[str, Any], max_len: int) -> int:
    # transformers' standardize_rope_params fills it with max_position_embeddings when absent.
    return params.get("original_max_position_embeddings", max_len)


def _dynamic(params: dict[str, Any], max_len: int) -> tuple[DynamicNTK, int]:
    factor = _need(params, "factor")
    scaled = round(factor * max_len) if isinstance(factor, int | float) else max_len
    return DynamicNTK(factor=factor, original_max_seq_len=max_len), max(max_len, scaled)


def _yarn(params: dict[str, Any], max_len: int) -> tuple[YaRN, int]:
    scaling = YaRN(
        factor=_need(params, "factor"),
        original_max_seq_len=_original(params, max_len),
        beta_fast=params.get("beta_fast") or 32.0,  # HF: `or` defaults, so 0 and None mean 32 / 1
        beta_slow=params.get("beta_slow") or 1.0,
        attention_factor=params.get("attention_factor"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=params.get("truncate", True),
    )
    return scaling, max_len


def _llama3(params: dict[str, Any], max_len: int) -> tuple[Llama3Scaling, int]:
    scaling = Llama3Scaling(
        factor=_need(params, "factor"),
        low_freq_factor=_need(params, "low_freq_factor"),
        high_freq_factor=_need(params, "high_freq_factor"),
        original_max_seq_len=_original(params, max_len),
    )
    return scaling, max_len


def _longrope(params: dict[str, Any], max_len: int) -> tuple[LongRoPE, int]:
    scaling = LongRoPE(
        short_factor=_need(params, "short_factor"),
        long_factor=_need(params, "long_factor"),
        original_max_seq_len=_original(params, max_len),
        factor=params.get("factor"),
        attention_factor=params.get("attention_factor"),
    )
    return scaling, max_len


READERS: dict[str, Callable[[dict[str, Any], int], tuple[Any, int]]] = {
    "default": lambda params, max_len: (None, max_len),
    "linear": lambda params, max_len: (LinearScaling(factor=_need(params, "factor")), max_len),
    "dynamic": _dynamic,
    "llama3": _llama3,
    "yarn": _yarn,
    "longrope": _longrope,
}


def rope_from_hf(hf: dict[str, Any], problems: list[str]) -> tuple[RoPE, int]:
    """(RoPE, max_seq_len) of a config.json; what cannot be represented is added to problems
    (nothing is raised here, so the caller reports every problem at once)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    base = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    fraction = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    max_len = hf.get("max_position_embeddings", 2048)
    if rope_type not in READERS:
        problems.append(f"rope_parameters.rope_type={rope_type!r}: supported are {list(SUPPORTED)}")
        return RoPE(), max_len
    try:
        scaling, max_len = READERS[rope_type](params, max_len)
        return RoPE(base=base, fraction=fraction, scaling=scaling), max_len
    except _Missing as missing:
        problems.append(f"rope_parameters.{missing}: missing; rope_type={rope_type!r} needs it")
    except ValueError as err:  # a value out of range: the config class names the field
        problems.append(f"rope_parameters (rope_type={rope_type!r}): {err}")
    return RoPE(), max_len


def dynamic_max_len(scaling: DynamicNTK) -> int:
    return max(scaling.original_max_seq_len, round(scaling.factor * scaling.original_max_seq_len))


def rope_unfit(cfg: ModelConfig) -> list[str]:
    """Why cfg's RoPE cannot be written to a config.json and read back unchanged."""
    s = cfg.positions.scaling if isinstance(cfg.positions, RoPE) else None
    if isinstance(s, DynamicNTK) and cfg.max_seq_len != dynamic_max_len(s):
        return [
            f"max_seq_len={cfg.max_seq_len} with dynamic RoPE: must be factor * original_max_seq_len = "
            f"{dynamic_max_len(s)} (config.json stores only the original length)"
        ]
    return []


def rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """rope_theta, rope_parameters and max_position_embeddings for config.json."""
    pos, max_len = cfg.positions, cfg.max_seq_len
    params: dict[str, Any] = {"rope_theta": pos.base, "rope_type": "default"}
    if pos.scaling is not None:
        params["rope_type"] = SCALING_KIND_OF[type(pos.scaling)]
        for f in dataclasses.fields(pos.scaling):  # None values too: HF requires yarn's factor key
            value = getattr(pos.scaling, f.name)
            params[HF_NAMES.get(f.name, f.name)] = list(value) if isinstance(value, tuple) else value
    if isinstance(pos.scaling, DynamicNTK):
        max_len = pos.scaling.original_max_seq_len
        del params["original_max_position_embeddings"]  # HF's dynamic reads max_position_embeddings
    if pos.fraction != 1:
        params["partial_rotary_factor"] = pos.fraction
    return {"rope_theta": pos.base, "rope_parameters": params, "max_position_embeddings": max_len}
